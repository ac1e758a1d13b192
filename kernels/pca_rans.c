/* rANS kernels of the pca CPU coder: see pca_rans.h. The AVX2 paths are chosen at run time
 * (pca_simd_avx2: the CPU has it and KVTOOL_PCA_SIMD is not 0); integer arithmetic only, so
 * they give exactly what the portable loops give. */
#include "pca_rans.h"

#include <pthread.h>
#include <string.h>

#include "pca_kernels.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PCA_RANS_AVX2 1
#include <immintrin.h>
#endif

void pca_dec_tables(uint32_t *dec, const uint32_t (*freq)[PCA_NSYM], const uint32_t (*cum)[PCA_NSYM + 1]) {
    for (int t = 0; t < PCA_NTAB; t++) {
        uint32_t *d = dec + (size_t)t * PCA_SLOTS;
        for (uint32_t s = 0; s < PCA_NSYM; s++)
            for (uint32_t slot = cum[t][s]; slot < cum[t][s + 1]; slot++)
                d[slot] = pca_dec_entry(freq[t][s], slot - cum[t][s], s);
    }
}

#ifdef PCA_RANS_AVX2
static int32_t g_perm[256][8]; /* word i of a load goes to the i-th lane (ascending) needing one */
static pthread_once_t g_perm_once = PTHREAD_ONCE_INIT;

static void perm_init(void) {
    for (int m = 0; m < 256; m++)
        for (int lane = 0, k = 0; lane < 8; lane++) g_perm[m][lane] = (m >> lane) & 1 ? k++ : 0;
}

/* One step of 8 lanes: the symbols' entries by 8 scalar loads (a gather is slower on Zen), the
 * state update, then the renormalisation: lane j that needs a word takes the (number of lanes
 * below j needing one)-th word at *wp. */
__attribute__((target("avx2"))) static inline __m256i dec8(__m256i X, const uint32_t *dec, const uint16_t *words,
                                                         uint32_t *wp, uint8_t *sym) {
    const __m256i slot = _mm256_and_si256(X, _mm256_set1_epi32(PCA_SLOTS - 1));
    uint32_t ix[8] __attribute__((aligned(32)));
    _mm256_store_si256((__m256i *)ix, slot);
    const __m256i E = _mm256_setr_epi32((int)dec[ix[0]], (int)dec[ix[1]], (int)dec[ix[2]], (int)dec[ix[3]],
                                        (int)dec[ix[4]], (int)dec[ix[5]], (int)dec[ix[6]], (int)dec[ix[7]]);
    /* the low byte of each entry (its symbol), 8 bytes */
    const __m256i lo = _mm256_shuffle_epi8(E, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                               -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                                               -1, -1, -1, -1));
    const __m128i sb = _mm_unpacklo_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
    _mm_storel_epi64((__m128i *)sym, _mm_and_si128(sb, _mm_set1_epi8(15)));
    const __m256i f = _mm256_srli_epi32(E, 20);
    const __m256i bias = _mm256_and_si256(_mm256_srli_epi32(E, 4), _mm256_set1_epi32(PCA_SLOTS - 1));
    X = _mm256_add_epi32(_mm256_mullo_epi32(f, _mm256_srli_epi32(X, 12)), bias);
    const __m256i need = _mm256_cmpeq_epi32(_mm256_srli_epi32(X, 16), _mm256_setzero_si256());
    const int m = _mm256_movemask_ps(_mm256_castsi256_ps(need));
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(words + *wp)));
    w = _mm256_permutevar8x32_epi32(w, _mm256_loadu_si256((const __m256i *)g_perm[m]));
    *wp += (uint32_t)__builtin_popcount((unsigned)m);
    return _mm256_blendv_epi8(X, _mm256_or_si256(_mm256_slli_epi32(X, 16), w), need);
}

__attribute__((target("avx2"))) static size_t dec_steps_avx2(uint32_t *x, uint32_t N, const uint32_t *dec,
                                                            const uint16_t *words, uint32_t *wp, uint32_t nwords,
                                                            uint8_t *sym, size_t steps) {
    size_t done = 0;
    uint32_t p = *wp;
    if (N == 16) { /* the default: both states stay in registers */
        __m256i a = _mm256_loadu_si256((const __m256i *)x), b = _mm256_loadu_si256((const __m256i *)(x + 8));
        for (; done < steps && nwords - p >= 16u; done++, sym += 16) {
            a = dec8(a, dec, words, &p, sym);
            b = dec8(b, dec, words, &p, sym + 8);
        }
        _mm256_storeu_si256((__m256i *)x, a);
        _mm256_storeu_si256((__m256i *)(x + 8), b);
    } else {
        for (; done < steps && nwords - p >= N; done++, sym += N)
            for (uint32_t g = 0; g < N; g += 8) {
                const __m256i X = _mm256_loadu_si256((const __m256i *)(x + g));
                _mm256_storeu_si256((__m256i *)(x + g), dec8(X, dec, words, &p, sym + g));
            }
    }
    *wp = p;
    return done;
}
#endif

size_t pca_rans_dec_steps(uint32_t *x, uint32_t N, const uint32_t *dec, const uint16_t *words, uint32_t *wp,
                          uint32_t nwords, uint8_t *sym, size_t steps) {
#ifdef PCA_RANS_AVX2
    if (N % 8 == 0 && *wp <= nwords && pca_simd_avx2()) {
        pthread_once(&g_perm_once, perm_init);
        return dec_steps_avx2(x, N, dec, words, wp, nwords, sym, steps);
    }
#endif
    return 0;
}

/* ------------------------------------------------------------------------ */
/* the encoder's choice (§6.2)                                               */

/* 64-bit sums: any Tc, any costs the caller accepted */
static void choose_u64(const uint64_t h[PCA_NSYM], int s, uint64_t Tc, const uint64_t (*cost_t)[PCA_NTAB],
                       uint64_t *best, uint8_t *side) {
    uint64_t cost[PCA_NTAB];
    const uint64_t fixed = 256u * ((uint64_t)s * Tc + 16u * h[PCA_NSYM - 1]);
    for (int t = 0; t < PCA_NTAB; t++) cost[t] = fixed;
    for (int j = 0; j < PCA_NSYM; j++) {
        if (!h[j]) continue;
        const uint64_t n = h[j], *ct = cost_t[j];
        for (int t = 0; t < PCA_NTAB; t++) cost[t] += n * ct[t];
    }
    for (int t = 0; t < PCA_NTAB; t++)
        if (cost[t] < *best) { *best = cost[t]; *side = (uint8_t)(t | (s << 5)); }
}

#ifdef PCA_RANS_AVX2
/* 32-bit sums, 8 tables a vector: the caller passes cost32_t only when no sum can reach 2^32
 * (see pca_choose_shift) */
__attribute__((target("avx2"))) static void choose_u32_avx2(const uint64_t h[PCA_NSYM], int s, uint64_t Tc,
                                                           const uint32_t (*ct)[PCA_NTAB], uint64_t *best,
                                                           uint8_t *side) {
    const __m256i fixed = _mm256_set1_epi32((int)(256u * ((uint32_t)s * (uint32_t)Tc + 16u * (uint32_t)h[PCA_NSYM - 1])));
    __m256i c0 = fixed, c1 = fixed, c2 = fixed, c3 = fixed;
    for (int j = 0; j < PCA_NSYM; j++) {
        if (!h[j]) continue;
        const __m256i n = _mm256_set1_epi32((int)h[j]);
        c0 = _mm256_add_epi32(c0, _mm256_mullo_epi32(n, _mm256_loadu_si256((const __m256i *)ct[j])));
        c1 = _mm256_add_epi32(c1, _mm256_mullo_epi32(n, _mm256_loadu_si256((const __m256i *)(ct[j] + 8))));
        c2 = _mm256_add_epi32(c2, _mm256_mullo_epi32(n, _mm256_loadu_si256((const __m256i *)(ct[j] + 16))));
        c3 = _mm256_add_epi32(c3, _mm256_mullo_epi32(n, _mm256_loadu_si256((const __m256i *)(ct[j] + 24))));
    }
    __m256i mn = _mm256_min_epu32(_mm256_min_epu32(c0, c1), _mm256_min_epu32(c2, c3));
    mn = _mm256_min_epu32(mn, _mm256_permute2x128_si256(mn, mn, 1));
    mn = _mm256_min_epu32(mn, _mm256_shuffle_epi32(mn, 0x4E));
    mn = _mm256_min_epu32(mn, _mm256_shuffle_epi32(mn, 0xB1));
    const uint32_t least = (uint32_t)_mm256_cvtsi256_si32(mn);
    if (least >= *best) return;
    /* the first table with the least cost */
    const uint64_t m = (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(c0, mn))) |
                       (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(c1, mn))) << 8 |
                       (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(c2, mn))) << 16 |
                       (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(c3, mn))) << 24;
    *best = least;
    *side = (uint8_t)(__builtin_ctzll(m) | (s << 5));
}
#endif

void pca_choose_shift(const uint64_t h[PCA_NSYM], int s, uint64_t Tc, const uint64_t (*cost_t)[PCA_NTAB],
                      const uint32_t (*cost32_t)[PCA_NTAB], uint64_t *best, uint8_t *side) {
#ifdef PCA_RANS_AVX2
    if (cost32_t && pca_simd_avx2()) {
        choose_u32_avx2(h, s, Tc, cost32_t, best, side);
        return;
    }
#endif
    choose_u64(h, s, Tc, cost_t, best, side);
}
