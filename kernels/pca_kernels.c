/* The integer transform of the pca coder (both directions are one int16 x int16 -> int32 product
 * of a token block with a pair-interleaved matrix), with an AVX2 path chosen at run time, and the
 * f32 -> f16 rounding numpy does. Integer sums are exact, so the paths give identical results. */
#include "pca_kernels.h"

#include <pthread.h>
#include <stdlib.h>

#include "pca_cpu.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PCA_HAVE_AVX2 1
#include <immintrin.h>
#endif

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_avx2 = 0;

static void init_simd(void) {
#ifdef PCA_HAVE_AVX2
    const char *env = getenv("KVTOOL_PCA_SIMD");
    int off = env && (env[0] == '0' || env[0] == 'n' || env[0] == 'N' || env[0] == 'f' || env[0] == 'F');
    __builtin_cpu_init();
    g_avx2 = !off && __builtin_cpu_supports("avx2");
#endif
}

int pca_simd_avx2(void) {
    pthread_once(&g_once, init_simd);
    return g_avx2;
}

/* Portable: the same sums, one token at a time (the compiler vectorises the j loop). */
static void matmul_portable(const int32_t *xp, size_t ps, const int16_t *m2, size_t cols, const uint32_t *pairs,
                            size_t tokens, int32_t *Y, size_t ys) {
    for (size_t t = 0; t < tokens; t++) {
        int32_t *y = Y + t * ys;
        memset(y, 0, cols * sizeof(int32_t));
        const uint32_t P = pairs[t / PCA_TB];
        for (uint32_t p = 0; p < P; p++) {
            int16_t x2[2];
            memcpy(x2, xp + (size_t)p * ps + t, 4);
            const int32_t x0 = x2[0], x1 = x2[1];
            if (!x0 && !x1) continue;
            const int16_t *m = m2 + (size_t)p * cols * 2;
            for (size_t j = 0; j < cols; j++) y[j] += x0 * m[2 * j] + x1 * m[2 * j + 1];
        }
    }
}

#ifdef PCA_HAVE_AVX2
/* 4 tokens x 24 columns in 12 accumulators; per pair of rows of M: 3 loads of m2 (8 columns x 2
 * each), 4 broadcasts of a token's two int16 as one int32, 12 vpmaddwd (x0*m[2j] + x1*m[2j+1],
 * exact: each product < 2^30 and the caller bounds every partial sum), 12 adds. */
__attribute__((target("avx2"))) static void matmul_avx2(const int32_t *xp, size_t ps, const int16_t *m2,
                                                        size_t cols, const uint32_t *pairs, size_t tokens,
                                                        int32_t *Y, size_t ys) {
    for (size_t t0 = 0; t0 < tokens; t0 += PCA_TB) {
        const uint32_t P = pairs[t0 / PCA_TB];
        for (size_t j0 = 0; j0 < cols; j0 += PCA_JB) {
            __m256i a00 = _mm256_setzero_si256(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
            __m256i a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
            const int16_t *m = m2 + j0 * 2;
            const int32_t *x = xp + t0;
            for (uint32_t p = 0; p < P; p++, m += cols * 2, x += ps) {
                const __m256i b0 = _mm256_loadu_si256((const __m256i *)m);
                const __m256i b1 = _mm256_loadu_si256((const __m256i *)(m + 16));
                const __m256i b2 = _mm256_loadu_si256((const __m256i *)(m + 32));
                __m256i s;
                s = _mm256_set1_epi32(x[0]);
                a00 = _mm256_add_epi32(a00, _mm256_madd_epi16(s, b0));
                a01 = _mm256_add_epi32(a01, _mm256_madd_epi16(s, b1));
                a02 = _mm256_add_epi32(a02, _mm256_madd_epi16(s, b2));
                s = _mm256_set1_epi32(x[1]);
                a10 = _mm256_add_epi32(a10, _mm256_madd_epi16(s, b0));
                a11 = _mm256_add_epi32(a11, _mm256_madd_epi16(s, b1));
                a12 = _mm256_add_epi32(a12, _mm256_madd_epi16(s, b2));
                s = _mm256_set1_epi32(x[2]);
                a20 = _mm256_add_epi32(a20, _mm256_madd_epi16(s, b0));
                a21 = _mm256_add_epi32(a21, _mm256_madd_epi16(s, b1));
                a22 = _mm256_add_epi32(a22, _mm256_madd_epi16(s, b2));
                s = _mm256_set1_epi32(x[3]);
                a30 = _mm256_add_epi32(a30, _mm256_madd_epi16(s, b0));
                a31 = _mm256_add_epi32(a31, _mm256_madd_epi16(s, b1));
                a32 = _mm256_add_epi32(a32, _mm256_madd_epi16(s, b2));
            }
            int32_t *y = Y + t0 * ys + j0;
            _mm256_storeu_si256((__m256i *)y, a00);
            _mm256_storeu_si256((__m256i *)(y + 8), a01);
            _mm256_storeu_si256((__m256i *)(y + 16), a02);
            y += ys;
            _mm256_storeu_si256((__m256i *)y, a10);
            _mm256_storeu_si256((__m256i *)(y + 8), a11);
            _mm256_storeu_si256((__m256i *)(y + 16), a12);
            y += ys;
            _mm256_storeu_si256((__m256i *)y, a20);
            _mm256_storeu_si256((__m256i *)(y + 8), a21);
            _mm256_storeu_si256((__m256i *)(y + 16), a22);
            y += ys;
            _mm256_storeu_si256((__m256i *)y, a30);
            _mm256_storeu_si256((__m256i *)(y + 8), a31);
            _mm256_storeu_si256((__m256i *)(y + 16), a32);
        }
    }
}
#endif

void pca_matmul(const int32_t *xp, size_t ps, const int16_t *m2, size_t cols, const uint32_t *pairs,
                size_t tokens, int32_t *Y, size_t ys) {
#ifdef PCA_HAVE_AVX2
    if (pca_simd_avx2()) {
        matmul_avx2(xp, ps, m2, cols, pairs, tokens, Y, ys);
        return;
    }
#endif
    matmul_portable(xp, ps, m2, cols, pairs, tokens, Y, ys);
}

/* numpy's float -> half (npy_floatbits_to_halfbits): round to nearest even; overflow to infinity;
 * a NaN keeps the top of its payload (never becoming infinity). */
uint16_t pca_f32_to_f16(float f) {
    const uint32_t u = pca_bits(f);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a >= 0x7F800000u) {
        if (a == 0x7F800000u) return (uint16_t)(sign | 0x7C00u);
        uint16_t r = (uint16_t)(0x7C00u + ((a & 0x7FFFFFu) >> 13));
        return (uint16_t)(sign | (r == 0x7C00u ? 0x7C01u : r));
    }
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* rounds to >= 2^16: infinity */
    if (a < 0x38800000u) {                                    /* below 2^-14: subnormal or zero */
        const int e = (int)(a >> 23);
        if (e < 102) return sign; /* below 2^-25: rounds to zero */
        const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
        const int shift = 126 - e;
        uint32_t q = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    /* normal: rebias the exponent, round 23 -> 10 mantissa bits (a carry may reach the exponent) */
    uint32_t v = a - 0x38000000u;
    const uint32_t rem = v & 0x1FFFu;
    v >>= 13;
    if (rem > 0x1000u || (rem == 0x1000u && (v & 1u))) v++;
    return (uint16_t)(sign | v);
}
