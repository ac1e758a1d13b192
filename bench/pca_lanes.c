/* What a rANS step costs on this CPU when each lane has its own word stream (pca bitstream
 * version 2's units, format-spec/pca.md §11) against lanes that share one stream (version 1's
 * rows, §6.3): the decoder's inner step alone, on synthetic tables and bytes held in L1/L2 as a
 * row's are, no model and no payload format. Three loops, each over 64 interleaved lanes:
 *
 *   shared      8 lanes a 256-bit vector, one table offset for all lanes, the renormalising lanes'
 *               words by one expanding load from the shared stream (version 1: pca_rans.c dec8v)
 *   own-loads   16 lanes a 512-bit vector, a table per lane, each lane's entry and next word by
 *               scalar loads (version 2 on AMD: pca_units_simd.inc units_step_inside)
 *   own-gather  the same by a gather of the entries and a masked gather of the words
 *               (version 2 elsewhere: pca_units_simd.inc units_step)
 *
 * Build and run (x86-64 with AVX-512 F/BW/VL/VBMI2):
 *     gcc -O3 -mavx512f -mavx512bw -mavx512vl -mavx512vbmi2 -o /tmp/pca_lanes bench/pca_lanes.c
 *     /tmp/pca_lanes [TABLES]
 * Prints ns per decoded symbol, the best of 5 runs of 20 M symbols each (bench/RESULTS.md §44).
 * TABLES (1, 2, 4, 8, 16 or 32; default 32): how many of the 32 tables (16 KB each) the own-stream
 * lanes use between them (a row's 64 units use up to 32, one per component's choice): 1 shows
 * what is left of the cost with every lane's table in L1, as the shared stream's is. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SYMBOLS 20000000L
#define SLOTS 4096
#define TABLES 32

static uint32_t dec[TABLES * SLOTS] __attribute__((aligned(64))); /* f << 20 | bias << 4 | symbol */
static uint8_t stream[1 << 16] __attribute__((aligned(64)));
static uint8_t out[1 << 16] __attribute__((aligned(64)));

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* 16 u32 loads at base + idx * scale, one a lane */
static inline __m512i loads16(const uint8_t *base, __m512i idx, int scale) {
    __m128i r[4];
    for (int h = 0; h < 4; h++) {
        const __m128i q = _mm512_extracti32x4_epi32(idx, h);
        const uint64_t a = (uint64_t)_mm_cvtsi128_si64(q), b = (uint64_t)_mm_extract_epi64(q, 1);
        uint32_t w[4];
        memcpy(&w[0], base + (size_t)(uint32_t)a * scale, 4);
        memcpy(&w[1], base + (size_t)(a >> 32) * scale, 4);
        memcpy(&w[2], base + (size_t)(uint32_t)b * scale, 4);
        memcpy(&w[3], base + (size_t)(b >> 32) * scale, 4);
        r[h] = _mm_setr_epi32((int)w[0], (int)w[1], (int)w[2], (int)w[3]);
    }
    const __m256i lo = _mm256_inserti128_si256(_mm256_castsi128_si256(r[0]), r[1], 1);
    const __m256i hi = _mm256_inserti128_si256(_mm256_castsi128_si256(r[2]), r[3], 1);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* the shared stream: 8 vectors of 8 lanes */
static double run_shared(uint32_t *check) {
    __m256i X[8];
    for (int k = 0; k < 8; k++) X[k] = _mm256_add_epi32(_mm256_set1_epi32(1 << 16), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i off = _mm256_set1_epi32(3 * SLOTS);
    const uint16_t *words = (const uint16_t *)stream;
    uint32_t wp = 0;
    uint8_t *o = out;
    const double t = now();
    for (long i = 0; i < SYMBOLS / 64; i++) {
        for (int k = 0; k < 8; k++) {
            const __m256i I = _mm256_add_epi32(_mm256_and_si256(X[k], _mm256_set1_epi32(SLOTS - 1)), off);
            const __m128i i0 = _mm256_castsi256_si128(I), i1 = _mm256_extracti128_si256(I, 1);
            const uint64_t p0 = (uint64_t)_mm_cvtsi128_si64(i0), p1 = (uint64_t)_mm_extract_epi64(i0, 1);
            const uint64_t p2 = (uint64_t)_mm_cvtsi128_si64(i1), p3 = (uint64_t)_mm_extract_epi64(i1, 1);
            const __m256i E = _mm256_setr_epi32((int)dec[(uint32_t)p0], (int)dec[p0 >> 32], (int)dec[(uint32_t)p1],
                                                (int)dec[p1 >> 32], (int)dec[(uint32_t)p2], (int)dec[p2 >> 32],
                                                (int)dec[(uint32_t)p3], (int)dec[p3 >> 32]);
            _mm_storel_epi64((__m128i *)(o + 8 * k), _mm256_cvtepi32_epi8(_mm256_and_si256(E, _mm256_set1_epi32(15))));
            const __m256i bias = _mm256_and_si256(_mm256_srli_epi32(E, 4), _mm256_set1_epi32(SLOTS - 1));
            const __m256i x = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_srli_epi32(E, 20), _mm256_srli_epi32(X[k], 12)), bias);
            const __mmask8 need = _mm256_cmplt_epu32_mask(x, _mm256_set1_epi32(1 << 16));
            const __m256i w = _mm256_cvtepu16_epi32(_mm_maskz_expandloadu_epi16(need, words + wp));
            wp = (wp + (uint32_t)__builtin_popcount(need)) & 16383; /* the stream's 32 KB, again and again */
            X[k] = _mm256_mask_or_epi32(x, need, _mm256_slli_epi32(x, 16), w);
        }
        o = o + 64 < out + sizeof out ? o + 64 : out;
    }
    const double s = now() - t;
    uint32_t v[8];
    _mm256_storeu_si256((__m256i *)v, X[0]);
    *check = v[0];
    return s;
}

/* own streams: 4 vectors of 16 lanes, each lane a table and a stream of its own */
static int used_tables = TABLES;

static double run_own(int gather, uint32_t *check) {
    __m512i X[4], G[4], off[4];
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int k = 0; k < 4; k++) {
        X[k] = _mm512_add_epi32(_mm512_set1_epi32(1 << 16), lane);
        G[k] = _mm512_add_epi32(_mm512_mullo_epi32(lane, _mm512_set1_epi32(512)), _mm512_set1_epi32(8192 * k));
        off[k] = _mm512_mullo_epi32(_mm512_and_si512(_mm512_add_epi32(lane, _mm512_set1_epi32(16 * k)),
                                                     _mm512_set1_epi32(used_tables - 1)), _mm512_set1_epi32(SLOTS));
    }
    uint8_t *o = out;
    const double t = now();
    for (long i = 0; i < SYMBOLS / 64; i++) {
        for (int k = 0; k < 4; k++) {
            const __m512i I = _mm512_add_epi32(_mm512_and_si512(X[k], _mm512_set1_epi32(SLOTS - 1)), off[k]);
            const __m512i E = gather ? _mm512_i32gather_epi32(I, (const void *)dec, 4) : loads16((const uint8_t *)dec, I, 4);
            _mm_storeu_si128((__m128i *)(o + 16 * k), _mm512_cvtepi32_epi8(_mm512_and_si512(E, _mm512_set1_epi32(15))));
            const __m512i bias = _mm512_and_si512(_mm512_srli_epi32(E, 4), _mm512_set1_epi32(SLOTS - 1));
            const __m512i x = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_srli_epi32(E, 20), _mm512_srli_epi32(X[k], 12)), bias);
            const __mmask16 need = _mm512_cmplt_epu32_mask(x, _mm512_set1_epi32(1 << 16));
            const __m512i W = gather ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), need, G[k], stream, 1)
                                     : loads16(stream, G[k], 1);
            X[k] = _mm512_mask_or_epi32(x, need, _mm512_slli_epi32(x, 16), _mm512_srli_epi32(W, 16));
            G[k] = _mm512_and_si512(_mm512_mask_add_epi32(G[k], need, G[k], _mm512_set1_epi32(2)),
                                    _mm512_set1_epi32(sizeof stream - 8)); /* stay in the 64 KB */
        }
        o = o + 64 < out + sizeof out ? o + 64 : out;
    }
    const double s = now() - t;
    uint32_t v[16];
    _mm512_storeu_si512(v, X[0]);
    *check = v[0];
    return s;
}

int main(int argc, char **argv) {
    if (argc > 1) {
        used_tables = atoi(argv[1]);
        if (used_tables < 1 || used_tables > TABLES || (used_tables & (used_tables - 1))) {
            fprintf(stderr, "pca_lanes: TABLES must be 1, 2, 4, 8, 16 or 32\n");
            return 2;
        }
    }
    srand(1);
    for (int i = 0; i < TABLES * SLOTS; i++) /* f in 1..4000, any bias below 4096, any symbol */
        dec[i] = (uint32_t)(rand() % 4000 + 1) << 20 | (uint32_t)(rand() % SLOTS) << 4 | (uint32_t)(rand() & 15);
    for (size_t i = 0; i < sizeof stream; i++) stream[i] = (uint8_t)rand();
    const char *names[3] = {"shared", "own-loads", "own-gather"};
    double best[3] = {1e9, 1e9, 1e9};
    uint32_t check = 0, c;
    for (int r = 0; r < 5; r++) {
        double s = run_shared(&c);
        check ^= c;
        best[0] = s < best[0] ? s : best[0];
        s = run_own(0, &c);
        check ^= c;
        best[1] = s < best[1] ? s : best[1];
        s = run_own(1, &c);
        check ^= c;
        best[2] = s < best[2] ? s : best[2];
    }
    for (int m = 0; m < 3; m++)
        printf("%-11s %.3f ns/symbol  (%.2fx the shared stream's time)\n", names[m], 1e9 * best[m] / SYMBOLS,
               best[m] / best[0]);
    printf("(own-stream lanes over %d table%s; check %08x)\n", used_tables, used_tables > 1 ? "s" : "", check);
    return 0;
}
