/* rANS kernels of the pca CPU coder: see pca_rans.h. The AVX2 paths are chosen at run time
 * (pca_simd_avx2: the CPU has it and KVTOOL_PCA_SIMD is not 0), and the rANS loops' AVX-512 ones
 * where the CPU has that too (pca_simd_avx512); integer arithmetic only, so they give exactly
 * what the portable loops give. */
#include "pca_rans.h"

#include <pthread.h>
#include <string.h>

#include "pca_kernels.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PCA_RANS_AVX2 1
#define PCA_RANS_AVX512 "avx512f,avx512bw,avx512vl,avx512vbmi2,popcnt,bmi2" /* what pca_simd_avx512 checks */
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

/* One step of 8 lanes: the symbols' entries by 8 scalar loads (a gather is slower on Zen) at
 * slot + the lane's table offset, the state update, then the renormalisation: lane j that needs a
 * word takes the (number of lanes below j needing one)-th word at *wp. */
__attribute__((target("avx2"))) static inline __m256i dec8(__m256i X, __m256i off, const uint32_t *dec,
                                                         const uint16_t *words, uint32_t *wp, uint8_t *sym) {
    const __m256i slot = _mm256_and_si256(X, _mm256_set1_epi32(PCA_SLOTS - 1));
    const __m256i I = _mm256_add_epi32(slot, off);
    const __m128i i0 = _mm256_castsi256_si128(I), i1 = _mm256_extracti128_si256(I, 1);
    const uint64_t p0 = (uint64_t)_mm_cvtsi128_si64(i0), p1 = (uint64_t)_mm_extract_epi64(i0, 1);
    const uint64_t p2 = (uint64_t)_mm_cvtsi128_si64(i1), p3 = (uint64_t)_mm_extract_epi64(i1, 1);
    const __m256i E = _mm256_setr_epi32((int)dec[(uint32_t)p0], (int)dec[p0 >> 32], (int)dec[(uint32_t)p1], (int)dec[p1 >> 32],
                                        (int)dec[(uint32_t)p2], (int)dec[p2 >> 32], (int)dec[(uint32_t)p3], (int)dec[p3 >> 32]);
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

#endif

#ifdef PCA_RANS_AVX2
/* dec8 with AVX-512 VL: the same scalar loads of the entries (a gather of 16 is slower: one chain
 * of 16 lanes instead of two of 8); the symbols by one narrowing store, the renormalisation by one
 * expanding load of the words under the compare's mask (lane j that needs a word takes the
 * (number of lanes below j needing one)-th word at *wp: what vpexpandw does) */
__attribute__((target(PCA_RANS_AVX512), always_inline)) static inline __m256i dec8v(__m256i X, __m256i off,
                                                                                   const uint32_t *dec,
                                                                                   const uint16_t *words, uint32_t *wp,
                                                                                   uint8_t *sym) {
    const __m256i slot = _mm256_and_si256(X, _mm256_set1_epi32(PCA_SLOTS - 1));
    const __m256i I = _mm256_add_epi32(slot, off);
    const __m128i i0 = _mm256_castsi256_si128(I), i1 = _mm256_extracti128_si256(I, 1);
    const uint64_t p0 = (uint64_t)_mm_cvtsi128_si64(i0), p1 = (uint64_t)_mm_extract_epi64(i0, 1);
    const uint64_t p2 = (uint64_t)_mm_cvtsi128_si64(i1), p3 = (uint64_t)_mm_extract_epi64(i1, 1);
    const __m256i E = _mm256_setr_epi32((int)dec[(uint32_t)p0], (int)dec[p0 >> 32], (int)dec[(uint32_t)p1], (int)dec[p1 >> 32],
                                        (int)dec[(uint32_t)p2], (int)dec[p2 >> 32], (int)dec[(uint32_t)p3], (int)dec[p3 >> 32]);
    _mm_storel_epi64((__m128i *)sym, _mm256_cvtepi32_epi8(_mm256_and_si256(E, _mm256_set1_epi32(15))));
    const __m256i f = _mm256_srli_epi32(E, 20);
    const __m256i bias = _mm256_and_si256(_mm256_srli_epi32(E, 4), _mm256_set1_epi32(PCA_SLOTS - 1));
    X = _mm256_add_epi32(_mm256_mullo_epi32(f, _mm256_srli_epi32(X, 12)), bias);
    const __mmask8 need = _mm256_cmplt_epu32_mask(X, _mm256_set1_epi32(1 << 16));
    const __m256i w = _mm256_cvtepu16_epi32(_mm_maskz_expandloadu_epi16(need, words + *wp));
    *wp += (uint32_t)__builtin_popcount((unsigned)need);
    return _mm256_mask_or_epi32(X, need, _mm256_slli_epi32(X, 16), w);
}

/* one row's loop state (pca_rans_rows.inc) */
typedef struct {
    const uint8_t *tabs;
    const uint16_t *words;
    uint8_t *sym;
    size_t count, i;
    uint32_t Tc, p, nwords, jc, tc;
    __m256i off;
} pca_row_state;

/* whether a whole step remains, with N words for it (so no load leaves the stream) */
static inline int pca_row_more(const pca_row_state *r, uint32_t N) {
    return r->count - r->i >= N && r->nwords - r->p >= N;
}

#define ROWS_TARGET "avx2"
#define ROWS_DEC8 dec8
#define ROWS(name) name##_avx2
#include "pca_rans_rows.inc"
#undef ROWS_TARGET
#undef ROWS_DEC8
#undef ROWS

#define ROWS_TARGET PCA_RANS_AVX512
#define ROWS_DEC8 dec8v
#define ROWS(name) name##_avx512
#include "pca_rans_rows.inc"
#undef ROWS_TARGET
#undef ROWS_DEC8
#undef ROWS

#include "pca_units_simd.inc"
#include "pca_units_avx2.inc"
#endif

int pca_rans_dec_units(pca_unit_rans *u, uint32_t count, const uint32_t *dec, const uint8_t *payload, size_t len,
                       const int32_t *tab_off, uint32_t Tc, uint8_t *tmp) {
#ifdef PCA_RANS_AVX2
    if (len < (1u << 31) - 16 && pca_simd_avx512()) { /* the gathers' indices are int32 offsets */
        for (uint32_t b = 0; b < count; b += UNITS_BATCH)
            units_batch_avx512(u + b, count - b < UNITS_BATCH ? count - b : UNITS_BATCH, dec, payload, len, tab_off, Tc,
                               tmp);
        return 1;
    }
    /* AVX2 alone: only where every batch's reads stay inside the payload (else the scalar chains) */
    if (len < (1u << 31) - 16 && pca_simd_avx2() && !pca_simd_avx512()) {
        for (uint32_t b = 0; b < count; b += UNITS8_BATCH)
            if (!units_inside(u + b, count - b < UNITS8_BATCH ? count - b : UNITS8_BATCH, len)) return 0;
        for (uint32_t b = 0; b < count; b += UNITS8_BATCH)
            units_batch_avx2(u + b, count - b < UNITS8_BATCH ? count - b : UNITS8_BATCH, dec, payload, tab_off, Tc, tmp,
                             tmp + (size_t)64 * 4096);
        return 1;
    }
#endif
    (void)u; (void)count; (void)dec; (void)payload; (void)len; (void)tab_off; (void)Tc; (void)tmp;
    return 0;
}

int pca_rans_enc_units(pca_unit_enc *u, uint32_t count, const pca_enc_table *tb, const uint8_t *tabs, uint32_t nl,
                       uint32_t Tc, uint16_t *words, uint8_t *tmp) {
#ifdef PCA_RANS_AVX2
    if (pca_simd_avx2()) {
        /* per (table, symbol): f | cum << 16 and floor((2^32 - 1) / f); per live component its
         * table's first entry */
        uint32_t fc[PCA_NTAB * PCA_NSYM], rcp[PCA_NTAB * PCA_NSYM];
        for (int t = 0; t < PCA_NTAB; t++)
            for (int j = 0; j < PCA_NSYM; j++) {
                fc[t * PCA_NSYM + j] = tb[t].f[j] | tb[t].cum[j] << 16;
                rcp[t * PCA_NSYM + j] = tb[t].rcp[j];
            }
        int32_t *tab16 = (int32_t *)(tmp + (size_t)64 * 4096);
        for (uint32_t j = 0; j < nl; j++) tab16[j] = (int32_t)tabs[j] * PCA_NSYM;
        if (pca_simd_avx512())
            for (uint32_t b = 0; b < count; b += UNITS_BATCH)
                units_ebatch_avx512(u + b, count - b < UNITS_BATCH ? count - b : UNITS_BATCH, fc, rcp, tab16, tabs, Tc,
                                    words, tmp);
        else /* AVX2 alone: 8 a vector */
            for (uint32_t b = 0; b < count; b += UNITS8_BATCH)
                units_ebatch_avx2(u + b, count - b < UNITS8_BATCH ? count - b : UNITS8_BATCH, fc, rcp, tab16, tabs,
                                  Tc, words, tmp);
        return 1;
    }
#endif
    (void)u; (void)count; (void)tb; (void)tabs; (void)nl; (void)Tc; (void)words; (void)tmp;
    return 0;
}

static int row_fits(uint32_t N, const pca_rans_row *r) {
    return N % 8 == 0 && r->Tc >= N && r->count && r->wp <= r->nwords;
}

int pca_rans_dec_rows2(uint32_t N, const uint32_t *dec, pca_rans_row *a, pca_rans_row *b) {
#ifdef PCA_RANS_AVX2
    if (N <= 32 && row_fits(N, a) && row_fits(N, b) && pca_simd_avx512()) {
        dec_rows2_avx512(N, dec, a, b);
        return 1;
    }
    if (N <= 32 && row_fits(N, a) && row_fits(N, b) && pca_simd_avx2()) {
        pthread_once(&g_perm_once, perm_init);
        dec_rows2_avx2(N, dec, a, b);
        return 1;
    }
#endif
    (void)N; (void)dec; (void)a; (void)b;
    return 0;
}

size_t pca_rans_dec_row(uint32_t *x, uint32_t N, const uint32_t *dec, const uint8_t *tabs, uint32_t Tc, size_t count,
                        const uint16_t *words, uint32_t *wp, uint32_t nwords, uint8_t *sym) {
    pca_rans_row in = {x, tabs, Tc, count, words, *wp, nwords, sym, 0};
    if (N > 64 || !row_fits(N, &in)) return 0;
#ifdef PCA_RANS_AVX2
    if (pca_simd_avx512()) {
        dec_row_avx512(N, dec, &in);
        *wp = in.wp;
        return in.done;
    }
    if (pca_simd_avx2()) {
        pthread_once(&g_perm_once, perm_init);
        dec_row_avx2(N, dec, &in);
        *wp = in.wp;
        return in.done;
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
/* 32-bit sums, 8 tables a vector, two symbols a vpmaddwd: the caller passes cost16 only when
 * every count fits int16 and no sum can reach 2^31 (see pca_choose_shift) */
__attribute__((target("avx2"))) static void choose_madd_avx2(const uint64_t h[PCA_NSYM], int s, uint64_t Tc,
                                                            const int16_t *cost16, uint64_t *best, uint8_t *side) {
    const __m256i fixed = _mm256_set1_epi32((int)(256u * ((uint32_t)s * (uint32_t)Tc + 16u * (uint32_t)h[PCA_NSYM - 1])));
    __m256i c0 = fixed, c1 = fixed, c2 = fixed, c3 = fixed;
    for (int i = 0; i < PCA_NSYM / 2; i++) {
        if (!(h[2 * i] | h[2 * i + 1])) continue;
        const __m256i n = _mm256_set1_epi32((int)((uint32_t)h[2 * i] | (uint32_t)h[2 * i + 1] << 16));
        const __m256i *ct = (const __m256i *)(cost16 + (size_t)i * PCA_NTAB * 2);
        c0 = _mm256_add_epi32(c0, _mm256_madd_epi16(n, _mm256_loadu_si256(ct)));
        c1 = _mm256_add_epi32(c1, _mm256_madd_epi16(n, _mm256_loadu_si256(ct + 1)));
        c2 = _mm256_add_epi32(c2, _mm256_madd_epi16(n, _mm256_loadu_si256(ct + 2)));
        c3 = _mm256_add_epi32(c3, _mm256_madd_epi16(n, _mm256_loadu_si256(ct + 3)));
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

#ifdef PCA_RANS_AVX2
/* the thresholds v in 1..63 at which the choice reads P[v] (symbols j << s and escapes 15 << s at
 * shifts 0..2; multiples of 8 at shifts 3..6 when every magnitude is below 64) */
static const uint8_t g_prefix_at[31] = {1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16,
                                        18, 20, 22, 24, 26, 28, 30, 32, 36, 40, 44, 48, 52, 56, 60};

/* 32 tokens a step: |q| to m and its maximum, and as saturated bytes; then each threshold's
 * count over 64 bytes at a time by one compare to a mask and one popcount */
__attribute__((target(PCA_RANS_AVX512))) static void choose_counts_avx512(const int16_t *q, uint32_t Tc, uint16_t *m,
                                                                        uint32_t P[65], uint32_t *maxm) {
    uint8_t b[1024] __attribute__((aligned(64)));
    __m512i mx = _mm512_setzero_si512();
    for (uint32_t t = 0; t < Tc; t += 32) {
        const __mmask32 k = Tc - t >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << (Tc - t)) - 1u);
        const __m512i a = _mm512_abs_epi16(_mm512_maskz_loadu_epi16(k, q + t)); /* |q| <= 32767 */
        _mm512_mask_storeu_epi16(m + t, k, a);
        mx = _mm512_max_epu16(mx, a);
        _mm256_store_si256((__m256i *)(b + t), _mm512_cvtusepi16_epi8(a));
    }
    uint16_t m32[32];
    _mm512_storeu_si512((void *)m32, mx);
    uint32_t mm = 0;
    for (int i = 0; i < 32; i++) mm = m32[i] > mm ? m32[i] : mm;
    *maxm = mm;
    if (mm == 0) return;
    const uint32_t nr = (Tc + 63) / 64;
    __m512i B[16];
    __mmask64 K[16];
    for (uint32_t r = 0; r < nr; r++) {
        const uint32_t left = Tc - 64 * r;
        K[r] = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
        B[r] = _mm512_maskz_loadu_epi8(K[r], (const void *)(b + 64 * r)); /* no byte past Tc is read */
    }
    P[0] = 0;
    for (int i = 0; i < 31; i++) {
        const __m512i v = _mm512_set1_epi8((char)g_prefix_at[i]);
        uint32_t c = 0;
        for (uint32_t r = 0; r < nr; r++) c += (uint32_t)__builtin_popcountll(_mm512_mask_cmplt_epu8_mask(K[r], B[r], v));
        P[g_prefix_at[i]] = c;
    }
    P[64] = Tc;
}
#endif

int pca_choose_counts(const int16_t *q, uint32_t Tc, uint16_t *m, uint32_t P[65], uint32_t *maxm) {
#ifdef PCA_RANS_AVX2
    if (Tc <= 1024 && pca_simd_avx512()) {
        choose_counts_avx512(q, Tc, m, P, maxm);
        return 1;
    }
#endif
    return 0;
}

void pca_choose_shift(const uint64_t h[PCA_NSYM], int s, uint64_t Tc, const uint64_t (*cost_t)[PCA_NTAB],
                      const int16_t *cost16, uint64_t *best, uint8_t *side) {
#ifdef PCA_RANS_AVX2
    if (cost16 && pca_simd_avx2()) {
        choose_madd_avx2(h, s, Tc, cost16, best, side);
        return;
    }
#endif
    choose_u64(h, s, Tc, cost_t, best, side);
}

/* ------------------------------------------------------------------------ */
/* the decoder's raw parts                                                   */

/* up to 57 bits at bit position at, LSB first; zero bits past the stream's len bytes */
static inline uint64_t peek_bits(const uint8_t *p, size_t len, uint64_t at) {
    const size_t byte = (size_t)(at >> 3);
    uint64_t v = 0;
    if (byte + 8 <= len) memcpy(&v, p + byte, 8);
    else
        for (size_t i = 0; byte + i < len && i < 8; i++) v |= (uint64_t)p[byte + i] << (8 * i);
    return v >> (at & 7u);
}

static void raw_portable(pca_raw_in *r, int sh, const uint8_t *sym, const uint32_t *esc, uint32_t t, uint32_t n,
                         int16_t *q, uint32_t *l1, uint32_t *last, uint32_t k1, uint32_t *big) {
    const uint32_t mask = (1u << sh) - 1u;
    uint32_t bg = 0;
    for (; t < n; t++) {
        uint32_t mt = sym[t] + (esc ? esc[t] : 0u);
        if (sh) {
            mt = mt << sh | ((uint32_t)peek_bits(r->lo, r->lo_len, r->lo_at) & mask);
            r->lo_at += (uint64_t)sh;
        }
        const uint32_t nz = mt != 0, neg = (uint32_t)peek_bits(r->sign, r->sign_len, r->sign_at) & nz;
        r->sign_at += nz;
        bg |= mt > 32767u;
        q[t] = (int16_t)(int32_t)((mt ^ (0u - neg)) + neg);
        l1[t] += mt;
        if (last) last[t] = nz ? k1 : last[t];
    }
    *big |= bg;
}

#ifdef PCA_RANS_AVX2
static int32_t g_prefix[256][8]; /* the number of set bits of m below bit j */
static pthread_once_t g_prefix_once = PTHREAD_ONCE_INIT;

static void prefix_init(void) {
    for (int m = 0; m < 256; m++)
        for (int j = 0, k = 0; j < 8; j++) {
            g_prefix[m][j] = k;
            k += (m >> j) & 1;
        }
}

/* 8 tokens a step: their 8 sh-bit low fields are one 48-bit read (split by per-lane shifts of
 * 64-bit lanes); the signs one 8-bit read, token j taking bit (nonzero tokens before j). Runs
 * while both reads stay inside their streams; returns the tokens done. */
__attribute__((target("avx2"))) static uint32_t raw_avx2(pca_raw_in *r, int sh, const uint8_t *sym,
                                                        const uint32_t *esc, uint32_t n, int16_t *q, uint32_t *l1,
                                                        uint32_t *last, uint32_t k1, uint32_t *big) {
    const __m256i sh_lo = _mm256_setr_epi64x(0, sh, 2 * sh, 3 * sh), sh_hi = _mm256_add_epi64(sh_lo, _mm256_set1_epi64x(4 * sh));
    const __m256i lmask = _mm256_set1_epi32((1 << sh) - 1), K1 = _mm256_set1_epi32((int)k1), one = _mm256_set1_epi32(1);
    const __m256i lim = _mm256_set1_epi32(32767), zero = _mm256_setzero_si256();
    const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m128i shc = _mm_cvtsi32_si128(sh);
    __m256i bg = zero;
    uint64_t lo_at = r->lo_at, sign_at = r->sign_at;
    uint32_t t = 0;
    /* a component without low bits reads none: its tokens need no room in the lo stream (the
     * trailing components of a row are mostly such, and come after the stream's last byte) */
    const size_t lo_room = sh ? 8u : 0u;
    for (; t + 8 <= n && (sh == 0 || (lo_at >> 3) + lo_room <= r->lo_len) && (sign_at >> 3) + 2 <= r->sign_len; t += 8) {
        __m256i M = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sym + t)));
        if (esc) M = _mm256_add_epi32(M, _mm256_loadu_si256((const __m256i *)(esc + t)));
        if (sh) {
            uint64_t v;
            memcpy(&v, r->lo + (lo_at >> 3), 8);
            const __m256i V = _mm256_set1_epi64x((long long)(v >> (lo_at & 7u)));
            const __m256i a = _mm256_srlv_epi64(V, sh_lo), b = _mm256_srlv_epi64(V, sh_hi);
            /* low 32 bits of the 8 64-bit lanes, in token order */
            const __m256i ab = _mm256_permutevar8x32_epi32(_mm256_blend_epi32(a, _mm256_slli_epi64(b, 32), 0xAA), even);
            M = _mm256_or_si256(_mm256_sll_epi32(M, shc), _mm256_and_si256(ab, lmask));
            lo_at += 8u * (uint64_t)sh;
        }
        const __m256i zm = _mm256_cmpeq_epi32(M, zero);
        const unsigned nzm = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(zm)) ^ 0xFFu;
        uint16_t sv;
        memcpy(&sv, r->sign + (sign_at >> 3), 2);
        const __m256i S = _mm256_set1_epi32((int)((uint32_t)sv >> (sign_at & 7u)));
        const __m256i neg = _mm256_andnot_si256(zm, _mm256_and_si256(
            _mm256_srlv_epi32(S, _mm256_loadu_si256((const __m256i *)g_prefix[nzm])), one));
        sign_at += (uint64_t)__builtin_popcount(nzm);
        bg = _mm256_or_si256(bg, _mm256_cmpgt_epi32(M, lim)); /* signed compare: m < 2^31 */
        const __m256i Q = _mm256_sub_epi32(_mm256_xor_si256(M, _mm256_sub_epi32(zero, neg)), _mm256_sub_epi32(zero, neg));
        const __m256i Q16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(Q, Q), 0x08); /* bad values are refused anyway */
        _mm_storeu_si128((__m128i *)(q + t), _mm256_castsi256_si128(Q16));
        _mm256_storeu_si256((__m256i *)(l1 + t), _mm256_add_epi32(_mm256_loadu_si256((const __m256i *)(l1 + t)), M));
        if (last) {
            const __m256i L = _mm256_loadu_si256((const __m256i *)(last + t));
            _mm256_storeu_si256((__m256i *)(last + t), _mm256_blendv_epi8(K1, L, zm));
        }
    }
    r->lo_at = lo_at;
    r->sign_at = sign_at;
    *big |= (uint32_t)!_mm256_testz_si256(bg, bg);
    return t;
}
#endif

#ifdef PCA_RANS_AVX2
/* For sh 1..6 and the first field's bit b = lo_at & 7: lane j's field starts at bit b + j sh of a
 * 16-byte read; idx picks its two bytes (vpshufb, each 128-bit lane holding the same 16 bytes) and
 * cnt is the shift that brings the field down. */
static uint8_t g_raw_idx[7][8][64] __attribute__((aligned(64)));
static uint32_t g_raw_cnt[7][8][16] __attribute__((aligned(64)));
static pthread_once_t g_raw_once = PTHREAD_ONCE_INIT;

static void raw_tables_init(void) {
    for (int sh = 1; sh <= 6; sh++)
        for (int b = 0; b < 8; b++)
            for (int j = 0; j < 16; j++) {
                const int at = b + j * sh;
                uint8_t *idx = g_raw_idx[sh][b] + 4 * j;
                idx[0] = (uint8_t)(at >> 3);
                idx[1] = (uint8_t)((at >> 3) + 1);
                idx[2] = idx[3] = 0x80;
                g_raw_cnt[sh][b][j] = (uint32_t)(at & 7);
            }
}

/* raw_avx2 for 16 tokens a step: the 16 low fields from one 16-byte read (two bytes a lane by
 * vpshufb, then a per-lane shift), the signs from one 4-byte read (lane j's bit j, spread to the
 * nonzero lanes by one expand: token j takes bit (nonzero tokens before j)). Runs while both
 * reads stay inside their streams; returns the tokens done. */
__attribute__((target(PCA_RANS_AVX512))) static uint32_t raw_avx512(pca_raw_in *r, int sh, const uint8_t *sym,
                                                                  const uint32_t *esc, uint32_t n, int16_t *q,
                                                                  uint32_t *l1, uint32_t *last, uint32_t k1,
                                                                  uint32_t *big) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i lmask = _mm512_set1_epi32((1 << sh) - 1), K1 = _mm512_set1_epi32((int)k1);
    const __m512i one = _mm512_set1_epi32(1), lim = _mm512_set1_epi32(32767);
    __mmask16 bg = 0;
    uint64_t lo_at = r->lo_at, sign_at = r->sign_at;
    uint32_t t = 0;
    const size_t lo_room = sh ? 16u : 0u; /* a component without low bits reads none */
    for (; t + 16 <= n && (sh == 0 || (lo_at >> 3) + lo_room <= r->lo_len) && (sign_at >> 3) + 4 <= r->sign_len;
         t += 16) {
        __m512i M = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sym + t)));
        if (esc) M = _mm512_add_epi32(M, _mm512_loadu_si512((const void *)(esc + t)));
        if (sh) {
            const unsigned b = (unsigned)(lo_at & 7u);
            const __m512i V = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(r->lo + (lo_at >> 3))));
            const __m512i W = _mm512_shuffle_epi8(V, _mm512_load_si512((const void *)g_raw_idx[sh][b]));
            const __m512i L = _mm512_and_si512(_mm512_srlv_epi32(W, _mm512_load_si512((const void *)g_raw_cnt[sh][b])),
                                               lmask);
            M = _mm512_or_si512(_mm512_slli_epi32(M, (unsigned)sh), L);
            lo_at += 16u * (uint64_t)sh;
        }
        const __mmask16 nz = _mm512_test_epi32_mask(M, M);
        uint32_t sv;
        memcpy(&sv, r->sign + (sign_at >> 3), 4);
        const __m512i bits = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)(sv >> (sign_at & 7u))), lane), one);
        const __m512i neg = _mm512_maskz_expand_epi32(nz, bits);
        sign_at += (uint64_t)__builtin_popcount((unsigned)nz);
        bg |= _mm512_cmpgt_epi32_mask(M, lim); /* signed compare: m < 2^31 */
        const __m512i Q = _mm512_sub_epi32(_mm512_xor_si512(M, _mm512_sub_epi32(_mm512_setzero_si512(), neg)),
                                           _mm512_sub_epi32(_mm512_setzero_si512(), neg));
        _mm256_storeu_si256((__m256i *)(q + t), _mm512_cvtsepi32_epi16(Q)); /* bad values are refused anyway */
        _mm512_storeu_si512((void *)(l1 + t), _mm512_add_epi32(_mm512_loadu_si512((const void *)(l1 + t)), M));
        if (last) _mm512_mask_storeu_epi32((void *)(last + t), nz, K1);
    }
    r->lo_at = lo_at;
    r->sign_at = sign_at;
    *big |= (uint32_t)(bg != 0);
    return t;
}
#endif

void pca_raw_component(pca_raw_in *r, int sh, const uint8_t *sym, const uint32_t *esc, uint32_t n, int16_t *q,
                       uint32_t *l1, uint32_t *last, uint32_t k1, uint32_t *big) {
    uint32_t t = 0;
#ifdef PCA_RANS_AVX2
    if (pca_simd_avx512()) {
        pthread_once(&g_raw_once, raw_tables_init);
        t = raw_avx512(r, sh, sym, esc, n, q, l1, last, k1, big);
    }
    if (pca_simd_avx2()) {
        pthread_once(&g_prefix_once, prefix_init);
        t += raw_avx2(r, sh, sym + t, esc ? esc + t : NULL, n - t, q + t, l1 + t, last ? last + t : NULL, k1, big);
    }
#endif
    raw_portable(r, sh, sym, esc, t, n, q, l1, last, k1, big);
}

#ifdef PCA_RANS_AVX2
__attribute__((target("avx2,popcnt"))) static uint32_t count_escapes_avx2(const uint8_t *sym, uint32_t n, uint32_t *t) {
    uint32_t c = 0, i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(sym + i));
        c += (uint32_t)__builtin_popcount((unsigned)_mm256_movemask_epi8(_mm256_cmpeq_epi8(v, _mm256_set1_epi8(15))));
    }
    *t = i;
    return c;
}
#endif

uint32_t pca_count_escapes(const uint8_t *sym, uint32_t n) {
    uint32_t c = 0, t = 0;
#ifdef PCA_RANS_AVX2
    if (pca_simd_avx2()) c = count_escapes_avx2(sym, n, &t);
#endif
    for (; t < n; t++) c += sym[t] == 15u;
    return c;
}

#ifdef PCA_RANS_AVX2
__attribute__((target("avx2"))) static uint32_t interleave_avx2(const int16_t *a, const int16_t *b, uint32_t n,
                                                               int16_t *out) {
    uint32_t t = 0;
    for (; t + 16 <= n; t += 16) { /* unpack works within 128-bit halves: lows of both halves, then highs */
        const __m256i x = _mm256_loadu_si256((const __m256i *)(a + t)), y = _mm256_loadu_si256((const __m256i *)(b + t));
        const __m256i lo = _mm256_unpacklo_epi16(x, y), hi = _mm256_unpackhi_epi16(x, y);
        _mm256_storeu_si256((__m256i *)(out + 2 * (size_t)t), _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_storeu_si256((__m256i *)(out + 2 * (size_t)t + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
    }
    return t;
}
#endif

void pca_interleave(const int16_t *a, const int16_t *b, uint32_t n, int16_t *out) {
    uint32_t t = 0;
#ifdef PCA_RANS_AVX2
    if (pca_simd_avx2()) t = interleave_avx2(a, b, n, out);
#endif
    for (; t < n; t++) {
        out[2 * (size_t)t] = a[t];
        out[2 * (size_t)t + 1] = b[t];
    }
}

/* ------------------------------------------------------------------------ */
/* the AVX2 rANS encoder                                                     */
#ifdef PCA_RANS_AVX2
static int32_t g_rpack[256][8]; /* the lanes set in m, ascending, at the top of 8 positions */
static pthread_once_t g_rpack_once = PTHREAD_ONCE_INIT;

static void rpack_init(void) {
    for (int m = 0; m < 256; m++) {
        int p = 8 - __builtin_popcount((unsigned)m);
        for (int j = 0; j < 8; j++) g_rpack[m][j] = 0;
        for (int lane = 0; lane < 8; lane++)
            if ((m >> lane) & 1) g_rpack[m][p++] = lane;
    }
}

typedef struct { __m256i flo, fhi, clo, chi, rlo, rhi; } enc8_tab;

/* a 16-entry table by two in-register permutations (symbol bit 3 picks the half) */
__attribute__((target("avx2"))) static inline __m256i lut16(__m256i lo, __m256i hi, __m256i s, __m256i upper) {
    return _mm256_blendv_epi8(_mm256_permutevar8x32_epi32(lo, s), _mm256_permutevar8x32_epi32(hi, s), upper);
}

/* One group of 8 lanes: emit (x >= f << 20: its low 16 bits, then x >> 16), then
 * x = (x / f) << 12 + x % f + cum; x / f as the high half of x * floor((2^32 - 1) / f), at most
 * one below the quotient, corrected once. The same states and words as the portable loop. */
__attribute__((target("avx2"))) static inline __m256i enc8(__m256i X, const enc8_tab *t, const uint8_t *sym,
                                                         uint16_t *words, size_t *wp) {
    const __m256i s = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sym)), upper = _mm256_cmpgt_epi32(s, _mm256_set1_epi32(7));
    const __m256i f = lut16(t->flo, t->fhi, s, upper), cum = lut16(t->clo, t->chi, s, upper);
    const __m256i R = lut16(t->rlo, t->rhi, s, upper);
    const __m256i bound = _mm256_slli_epi32(f, 20);
    const __m256i emit = _mm256_cmpeq_epi32(_mm256_max_epu32(X, bound), X);
    const int m = _mm256_movemask_ps(_mm256_castsi256_ps(emit));
    if (m) {
        const __m256i w = _mm256_and_si256(_mm256_permutevar8x32_epi32(X, _mm256_loadu_si256((const __m256i *)g_rpack[m])),
                                           _mm256_set1_epi32(0xFFFF));
        const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(w, w), 0x08);
        _mm_storeu_si128((__m128i *)(words + *wp - 8), _mm256_castsi256_si128(p));
        *wp -= (size_t)__builtin_popcount((unsigned)m);
        X = _mm256_blendv_epi8(X, _mm256_srli_epi32(X, 16), emit);
    }
    const __m256i even = _mm256_mul_epu32(X, R);
    const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(X, 32), _mm256_srli_epi64(R, 32));
    __m256i d = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
    __m256i rem = _mm256_sub_epi32(X, _mm256_mullo_epi32(d, f));
    const __m256i over = _mm256_cmpgt_epi32(rem, _mm256_sub_epi32(f, _mm256_set1_epi32(1))); /* rem < 2f < 2^13 */
    d = _mm256_sub_epi32(d, over);
    rem = _mm256_sub_epi32(rem, _mm256_and_si256(f, over));
    return _mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(d, 12), rem), cum);
}

__attribute__((target("avx2"))) static size_t enc_steps_avx2(uint32_t *x, uint32_t N, const pca_enc_table *tb,
                                                            const uint8_t *sym, uint16_t *words, size_t *wp,
                                                            size_t steps) {
    enc8_tab t;
    t.flo = _mm256_loadu_si256((const __m256i *)tb->f);
    t.fhi = _mm256_loadu_si256((const __m256i *)(tb->f + 8));
    t.clo = _mm256_loadu_si256((const __m256i *)tb->cum);
    t.chi = _mm256_loadu_si256((const __m256i *)(tb->cum + 8));
    t.rlo = _mm256_loadu_si256((const __m256i *)tb->rcp);
    t.rhi = _mm256_loadu_si256((const __m256i *)(tb->rcp + 8));
    size_t p = *wp;
    if (N == 16) {
        __m256i a = _mm256_loadu_si256((const __m256i *)x), b = _mm256_loadu_si256((const __m256i *)(x + 8));
        for (size_t s = 0; s < steps; s++, sym -= 16) {
            b = enc8(b, &t, sym + 8, words, &p);
            a = enc8(a, &t, sym, words, &p);
        }
        _mm256_storeu_si256((__m256i *)x, a);
        _mm256_storeu_si256((__m256i *)(x + 8), b);
    } else {
        for (size_t s = 0; s < steps; s++, sym -= N)
            for (uint32_t g = N; g > 0; g -= 8) {
                const __m256i X = _mm256_loadu_si256((const __m256i *)(x + g - 8));
                _mm256_storeu_si256((__m256i *)(x + g - 8), enc8(X, &t, sym + g - 8, words, &p));
            }
    }
    *wp = p;
    return steps;
}
#endif

#ifdef PCA_RANS_AVX2
typedef struct { __m512i f, cum, rcp; } enc16_tab;

/* enc8 on 16 lanes with AVX-512: each 16-entry table one vpermd; the emitted words (lanes
 * ascending, below *wp) by one compress and one masked store. */
__attribute__((target(PCA_RANS_AVX512), always_inline)) static inline __m512i enc16(__m512i X, const enc16_tab *t,
                                                                                   const uint8_t *sym,
                                                                                   uint16_t *words, size_t *wp) {
    const __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sym));
    const __m512i f = _mm512_permutexvar_epi32(s, t->f), cum = _mm512_permutexvar_epi32(s, t->cum);
    const __m512i R = _mm512_permutexvar_epi32(s, t->rcp);
    const __mmask16 emit = _mm512_cmpge_epu32_mask(X, _mm512_slli_epi32(f, 20));
    if (emit) {
        const unsigned n = (unsigned)__builtin_popcount((unsigned)emit);
        const __m256i w = _mm256_maskz_compress_epi16(emit, _mm512_cvtepi32_epi16(X));
        _mm256_mask_storeu_epi16(words + *wp - n, (__mmask16)((1u << n) - 1u), w);
        *wp -= n;
        X = _mm512_mask_srli_epi32(X, emit, X, 16);
    }
    const __m512i even = _mm512_mul_epu32(X, R);
    const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(X, 32), _mm512_srli_epi64(R, 32));
    __m512i d = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
    __m512i rem = _mm512_sub_epi32(X, _mm512_mullo_epi32(d, f));
    const __mmask16 over = _mm512_cmpge_epu32_mask(rem, f); /* rem < 2f < 2^13 */
    d = _mm512_mask_add_epi32(d, over, d, _mm512_set1_epi32(1));
    rem = _mm512_mask_sub_epi32(rem, over, rem, f);
    return _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(d, 12), rem), cum);
}

/* N a multiple of 16 up to 64: the states of NG registers held from step to step */
__attribute__((target(PCA_RANS_AVX512), always_inline)) static inline void enc_regs512(
    uint32_t *x, const int NG, const enc16_tab *t, const uint8_t *sym, uint16_t *words, size_t *p, size_t steps) {
    __m512i X[4];
    for (int g = 0; g < NG; g++) X[g] = _mm512_loadu_si512((const void *)(x + 16 * g));
    for (size_t s = 0; s < steps; s++, sym -= 16 * NG)
        for (int g = NG - 1; g >= 0; g--) X[g] = enc16(X[g], t, sym + 16 * g, words, p);
    for (int g = 0; g < NG; g++) _mm512_storeu_si512((void *)(x + 16 * g), X[g]);
}

__attribute__((target(PCA_RANS_AVX512))) static size_t enc_steps_avx512(uint32_t *x, uint32_t N,
                                                                       const pca_enc_table *tb, const uint8_t *sym,
                                                                       uint16_t *words, size_t *wp, size_t steps) {
    enc16_tab t;
    t.f = _mm512_loadu_si512((const void *)tb->f);
    t.cum = _mm512_loadu_si512((const void *)tb->cum);
    t.rcp = _mm512_loadu_si512((const void *)tb->rcp);
    size_t p = *wp;
    switch (N / 16) {
    case 1: enc_regs512(x, 1, &t, sym, words, &p, steps); break;
    case 2: enc_regs512(x, 2, &t, sym, words, &p, steps); break;
    case 3: enc_regs512(x, 3, &t, sym, words, &p, steps); break;
    default: enc_regs512(x, 4, &t, sym, words, &p, steps); break;
    }
    *wp = p;
    return steps;
}
#endif

size_t pca_rans_enc_steps(uint32_t *x, uint32_t N, const pca_enc_table *tb, const uint8_t *sym, uint16_t *words,
                          size_t *wp, size_t steps) {
#ifdef PCA_RANS_AVX2
    if (N % 16 == 0 && N <= 64 && pca_simd_avx512()) return enc_steps_avx512(x, N, tb, sym, words, wp, steps);
    if (N % 8 == 0 && pca_simd_avx2()) {
        pthread_once(&g_rpack_once, rpack_init);
        return enc_steps_avx2(x, N, tb, sym, words, wp, steps);
    }
#endif
    return 0;
}

/* ------------------------------------------------------------------------ */
/* the encoder's raw parts                                                   */

/* OR v (at most 57 - (at & 7) bits) in at bit position at of a zeroed buffer */
static inline void put_bits(uint8_t *p, uint64_t at, uint64_t v) {
    uint64_t w;
    memcpy(&w, p + (at >> 3), 8);
    w |= v << (at & 7u);
    memcpy(p + (at >> 3), &w, 8);
}

static void raw_encode_portable(pca_raw_out *o, int sh, const int16_t *q, uint32_t t, uint32_t n, uint8_t *sym) {
    const uint32_t mask = (1u << sh) - 1u;
    for (; t < n; t++) {
        const uint32_t m = (uint32_t)(q[t] < 0 ? -q[t] : q[t]), hi = m >> sh;
        if (sh) put_bits(o->lo, o->lo_at, m & mask);
        o->lo_at += (uint64_t)sh;
        if (m) put_bits(o->sign, o->sign_at++, q[t] < 0);
        sym[t] = (uint8_t)(hi < 15u ? hi : 15u);
        if (hi >= 15u) o->esc[o->nesc++] = (uint16_t)(hi - 15u);
    }
}

#ifdef PCA_RANS_AVX2
/* 8 tokens a step: the 8 low fields merged into one 8 sh-bit number by per-lane shifts of 64-bit
 * lanes, the signs of the nonzero ones into one popcount-bit number (token j's sign to bit
 * (nonzero tokens before j)), each one write. Escapes (rare) by the portable loop. */
__attribute__((target("avx2"))) static uint32_t raw_encode_avx2(pca_raw_out *o, int sh, const int16_t *q,
                                                               uint32_t n, uint8_t *sym) {
    const __m256i sh_lo = _mm256_setr_epi64x(0, sh, 2 * sh, 3 * sh), sh_hi = _mm256_add_epi64(sh_lo, _mm256_set1_epi64x(4 * sh));
    const __m256i lmask = _mm256_set1_epi32((1 << sh) - 1), fifteen = _mm256_set1_epi32(15), one = _mm256_set1_epi32(1);
    const __m128i shc = _mm_cvtsi32_si128(sh);
    uint32_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const __m256i Q = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(q + t)));
        const __m256i M = _mm256_abs_epi32(Q), hi = _mm256_srl_epi32(M, shc);
        if (!_mm256_testz_si256(_mm256_cmpgt_epi32(hi, _mm256_set1_epi32(14)), _mm256_set1_epi32(-1))) {
            raw_encode_portable(o, sh, q, t, t + 8, sym); /* an escape among them */
            continue;
        }
        const __m256i S = _mm256_min_epi32(hi, fifteen);
        const __m256i sb = _mm256_shuffle_epi8(S, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                    -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                    -1, -1, -1, -1));
        _mm_storel_epi64((__m128i *)(sym + t), _mm_unpacklo_epi32(_mm256_castsi256_si128(sb), _mm256_extracti128_si256(sb, 1)));
        if (sh) {
            const __m256i L = _mm256_and_si256(M, lmask);
            const __m256i a = _mm256_sllv_epi64(_mm256_cvtepu32_epi64(_mm256_castsi256_si128(L)), sh_lo);
            const __m256i b = _mm256_sllv_epi64(_mm256_cvtepu32_epi64(_mm256_extracti128_si256(L, 1)), sh_hi);
            __m256i v = _mm256_or_si256(a, b);
            v = _mm256_or_si256(v, _mm256_permute4x64_epi64(v, 0x4E));
            v = _mm256_or_si256(v, _mm256_shuffle_epi32(v, 0x4E));
            put_bits(o->lo, o->lo_at, (uint64_t)_mm256_extract_epi64(v, 0));
            o->lo_at += 8u * (uint64_t)sh;
        }
        const __m256i zm = _mm256_cmpeq_epi32(M, _mm256_setzero_si256());
        const unsigned nzm = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(zm)) ^ 0xFFu;
        if (nzm) {
            const __m256i neg = _mm256_srli_epi32(Q, 31); /* 1 where q < 0 (then m != 0) */
            __m256i b = _mm256_sllv_epi32(_mm256_and_si256(neg, one), _mm256_loadu_si256((const __m256i *)g_prefix[nzm]));
            b = _mm256_or_si256(b, _mm256_permute2x128_si256(b, b, 1));
            b = _mm256_or_si256(b, _mm256_shuffle_epi32(b, 0x4E));
            b = _mm256_or_si256(b, _mm256_shuffle_epi32(b, 0xB1));
            put_bits(o->sign, o->sign_at, (uint32_t)_mm256_cvtsi256_si32(b));
            o->sign_at += (uint64_t)__builtin_popcount(nzm);
        }
    }
    return t;
}
#endif

/* 16 tokens a step, the last step masked: the symbols by one narrowing store; the low fields as
 * bytes (one narrowing), 8 of them packed into 8 sh bits by one pext; the signs of the nonzero
 * tokens by one pext of the negative tokens' mask under the nonzero ones'. Escapes (rare) by the
 * portable loop. */
__attribute__((target(PCA_RANS_AVX512))) static void raw_encode_avx512(pca_raw_out *o, int sh, const int16_t *q,
                                                                      uint32_t n, uint8_t *sym) {
    const __m512i lmask = _mm512_set1_epi32((1 << sh) - 1), fourteen = _mm512_set1_epi32(14);
    const __m128i shc = _mm_cvtsi32_si128(sh);
    const uint64_t fields = 0x0101010101010101ull * (uint64_t)((1u << sh) - 1u); /* sh low bits of each byte */
    for (uint32_t t = 0; t < n; t += 16) {
        const uint32_t r = n - t < 16 ? n - t : 16;
        const __mmask16 k = (__mmask16)(r == 16 ? 0xFFFFu : (1u << r) - 1u);
        const __m512i Q = _mm512_cvtepi16_epi32(_mm256_maskz_loadu_epi16(k, q + t));
        const __m512i M = _mm512_abs_epi32(Q), hi = _mm512_srl_epi32(M, shc);
        if (_mm512_cmpgt_epi32_mask(hi, fourteen)) {
            raw_encode_portable(o, sh, q, t, t + r, sym); /* an escape among them */
            continue;
        }
        _mm512_mask_cvtepi32_storeu_epi8(sym + t, k, hi);
        if (sh) { /* the masked-off tokens' fields are zeros; a second write only when it holds tokens */
            const __m128i L = _mm512_cvtepi32_epi8(_mm512_and_si512(M, lmask));
            put_bits(o->lo, o->lo_at, _pext_u64((uint64_t)_mm_cvtsi128_si64(L), fields));
            if (r > 8) put_bits(o->lo, o->lo_at + 8u * (uint64_t)sh, _pext_u64((uint64_t)_mm_extract_epi64(L, 1), fields));
            o->lo_at += (uint64_t)r * (uint64_t)sh;
        }
        const __mmask16 nz = _mm512_test_epi32_mask(M, M);
        if (nz) {
            const __mmask16 neg = _mm512_cmplt_epi32_mask(Q, _mm512_setzero_si512()); /* q < 0: m != 0 */
            put_bits(o->sign, o->sign_at, _pext_u32(neg, nz));
            o->sign_at += (uint64_t)__builtin_popcount(nz);
        }
    }
}

void pca_raw_encode(pca_raw_out *o, int sh, const int16_t *q, uint32_t n, uint8_t *sym) {
    uint32_t t = 0;
#ifdef PCA_RANS_AVX2
    if (pca_simd_avx512()) {
        raw_encode_avx512(o, sh, q, n, sym);
        return;
    }
    if (pca_simd_avx2()) {
        pthread_once(&g_prefix_once, prefix_init);
        t = raw_encode_avx2(o, sh, q, n, sym);
    }
#endif
    raw_encode_portable(o, sh, q, t, n, sym);
}
