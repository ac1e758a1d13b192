/* The integer transform of the pca coder (both directions are one int16 x int16 -> int32 product
 * of a token block with a pair-interleaved matrix), with an AVX2 path chosen at run time, and the
 * f32 -> f16 rounding numpy does. Integer sums are exact, so the paths give identical results. */
#include "pca_kernels.h"

#include <pthread.h>
#include <stdlib.h>
#include <strings.h>

#include "pca_cpu.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PCA_HAVE_AVX2 1
#include <immintrin.h>
#endif

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_avx2 = 0, g_avx512 = 0, g_gather = 1;

/* KVTOOL_PCA_SIMD: 0 (or n/f) the portable loops only; "avx2" no AVX-512; else the best the CPU has.
 * KVTOOL_PCA_GATHER: 1 or 0 overrides the choice between gathers and scalar loads in version 2's
 * unit decoder (by default scalar loads on AMD CPUs, where they measured faster: bench/RESULTS.md §44) */
static void init_simd(void) {
#ifdef PCA_HAVE_AVX2
    const char *env = getenv("KVTOOL_PCA_SIMD");
    int off = env && (env[0] == '0' || env[0] == 'n' || env[0] == 'N' || env[0] == 'f' || env[0] == 'F');
    int cap2 = env && strcasecmp(env, "avx2") == 0;
    __builtin_cpu_init();
    g_avx2 = !off && __builtin_cpu_supports("avx2");
    g_avx512 = g_avx2 && !cap2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
               __builtin_cpu_supports("avx512vbmi2") && /* the rANS loops' expand and compress */
               __builtin_cpu_supports("bmi2");           /* the raw parts' pext (every such CPU has it) */
    const char *gather = getenv("KVTOOL_PCA_GATHER");
    g_gather = gather && gather[0] ? gather[0] == '1' : !__builtin_cpu_is("amd");
#endif
}

int pca_simd_avx2(void) {
    pthread_once(&g_once, init_simd);
    return g_avx2;
}

int pca_simd_avx512(void) {
    pthread_once(&g_once, init_simd);
    return g_avx512;
}

int pca_units_gather(void) {
    pthread_once(&g_once, init_simd);
    return g_gather;
}

/* Portable: the same sums, one token at a time (the compiler vectorises the j loop). */
static void matmul_portable(const int32_t *xp, size_t ps, const int16_t *m2, size_t stride, size_t width,
                            const uint32_t *pairs, size_t tokens, int32_t *Y, size_t ys) {
    for (size_t t = 0; t < tokens; t++) {
        int32_t *y = Y + t * ys;
        memset(y, 0, width * sizeof(int32_t));
        const uint32_t P = pairs[t / PCA_TB];
        for (uint32_t p = 0; p < P; p++) {
            int16_t x2[2];
            memcpy(x2, xp + (size_t)p * ps + t, 4);
            const int32_t x0 = x2[0], x1 = x2[1];
            if (!x0 && !x1) continue;
            const int16_t *m = m2 + (size_t)p * stride * 2;
            for (size_t j = 0; j < width; j++) y[j] += x0 * m[2 * j] + x1 * m[2 * j + 1];
        }
    }
}

#ifdef PCA_HAVE_AVX2
/* One block: 4 tokens x NV*8 columns (NV 1..3) in up to 12 accumulators; per pair of rows of M:
 * NV loads of m2 (8 columns x 2 each), 4 broadcasts of a token's two int16 as one int32, 4 NV
 * vpmaddwd (x0*m[2j] + x1*m[2j+1], exact: each product < 2^30 and the caller bounds every partial
 * sum) and as many adds. NV is a constant at every call, so the loops unroll. */
__attribute__((target("avx2"), always_inline)) static inline void block_avx2(const int32_t *x, size_t ps,
                                                                             const int16_t *m, size_t stride,
                                                                             uint32_t P, int32_t *y, size_t ys,
                                                                             const int NV) {
    __m256i a[4][3];
    for (int i = 0; i < 4; i++)
        for (int v = 0; v < NV; v++) a[i][v] = _mm256_setzero_si256();
    for (uint32_t p = 0; p < P; p++, m += stride * 2, x += ps) {
        __m256i b[3];
        for (int v = 0; v < NV; v++) b[v] = _mm256_loadu_si256((const __m256i *)(m + 16 * v));
        for (int i = 0; i < 4; i++) {
            const __m256i s = _mm256_set1_epi32(x[i]);
            for (int v = 0; v < NV; v++) a[i][v] = _mm256_add_epi32(a[i][v], _mm256_madd_epi16(s, b[v]));
        }
    }
    for (int i = 0; i < 4; i++, y += ys)
        for (int v = 0; v < NV; v++) _mm256_storeu_si256((__m256i *)(y + 8 * v), a[i][v]);
}

__attribute__((target("avx2"))) static void matmul_avx2(const int32_t *xp, size_t ps, const int16_t *m2,
                                                        size_t stride, size_t width, const uint32_t *pairs,
                                                        size_t tokens, int32_t *Y, size_t ys) {
    for (size_t t0 = 0; t0 < tokens; t0 += PCA_TB) {
        const uint32_t P = pairs[t0 / PCA_TB];
        const int32_t *x = xp + t0;
        int32_t *y = Y + t0 * ys;
        size_t j0 = 0;
        for (; j0 + 24 <= width; j0 += 24) block_avx2(x, ps, m2 + j0 * 2, stride, P, y + j0, ys, 3);
        if (width - j0 == 16) block_avx2(x, ps, m2 + j0 * 2, stride, P, y + j0, ys, 2);
        else if (width - j0 == 8) block_avx2(x, ps, m2 + j0 * 2, stride, P, y + j0, ys, 1);
    }
}
#endif

#ifdef PCA_HAVE_AVX2
#define PCA_AVX512 "avx512f,avx512bw,avx512vl,avx512vnni"
/* The same block with AVX-512 VNNI: 4 tokens x NV*16 columns (NV 1..4) in up to 16 zmm
 * accumulators, one vpdpwssd (x0*m[2j] + x1*m[2j+1] added to the accumulator, wrapping like
 * vpaddd) per token and 16 columns; the last vector's columns under mask `last` (8 or 16). */
__attribute__((target(PCA_AVX512), always_inline)) static inline void block_avx512(const int32_t *x, size_t ps,
                                                                                   const int16_t *m, size_t stride,
                                                                                   uint32_t P, int32_t *y, size_t ys,
                                                                                   const int NV, __mmask16 last) {
    __m512i a[4][4];
    for (int i = 0; i < 4; i++)
        for (int v = 0; v < NV; v++) a[i][v] = _mm512_setzero_si512();
    for (uint32_t p = 0; p < P; p++, m += stride * 2, x += ps) {
        __m512i b[4];
        for (int v = 0; v < NV - 1; v++) b[v] = _mm512_loadu_si512((const void *)(m + 32 * v));
        b[NV - 1] = _mm512_maskz_loadu_epi32(last, (const void *)(m + 32 * (NV - 1)));
        for (int i = 0; i < 4; i++) {
            const __m512i s = _mm512_set1_epi32(x[i]);
            for (int v = 0; v < NV; v++) a[i][v] = _mm512_dpwssd_epi32(a[i][v], s, b[v]);
        }
    }
    for (int i = 0; i < 4; i++, y += ys) {
        for (int v = 0; v < NV - 1; v++) _mm512_storeu_si512((void *)(y + 16 * v), a[i][v]);
        _mm512_mask_storeu_epi32((void *)(y + 16 * (NV - 1)), last, a[i][NV - 1]);
    }
}

__attribute__((target(PCA_AVX512))) static void matmul_avx512(const int32_t *xp, size_t ps, const int16_t *m2,
                                                             size_t stride, size_t width, const uint32_t *pairs,
                                                             size_t tokens, int32_t *Y, size_t ys) {
    const size_t rest = width % 64, nv = (rest + 15) / 16;
    const __mmask16 last = rest % 16 ? 0x00FF : 0xFFFF; /* width is a multiple of 8 */
    for (size_t t0 = 0; t0 < tokens; t0 += PCA_TB) {
        const uint32_t P = pairs[t0 / PCA_TB];
        const int32_t *x = xp + t0;
        int32_t *y = Y + t0 * ys;
        size_t j0 = 0;
        for (; j0 + 64 <= width; j0 += 64) block_avx512(x, ps, m2 + j0 * 2, stride, P, y + j0, ys, 4, 0xFFFF);
        switch (nv) {
        case 4: block_avx512(x, ps, m2 + j0 * 2, stride, P, y + j0, ys, 4, last); break; /* 56 columns */
        case 3: block_avx512(x, ps, m2 + j0 * 2, stride, P, y + j0, ys, 3, last); break;
        case 2: block_avx512(x, ps, m2 + j0 * 2, stride, P, y + j0, ys, 2, last); break;
        case 1: block_avx512(x, ps, m2 + j0 * 2, stride, P, y + j0, ys, 1, last); break;
        default: break;
        }
    }
}
#endif

void pca_matmul(const int32_t *xp, size_t ps, const int16_t *m2, size_t stride, size_t width, const uint32_t *pairs,
                size_t tokens, int32_t *Y, size_t ys) {
#ifdef PCA_HAVE_AVX2
    if (pca_simd_avx512()) {
        matmul_avx512(xp, ps, m2, stride, width, pairs, tokens, Y, ys);
        return;
    }
    if (pca_simd_avx2()) {
        matmul_avx2(xp, ps, m2, stride, width, pairs, tokens, Y, ys);
        return;
    }
#endif
    matmul_portable(xp, ps, m2, stride, width, pairs, tokens, Y, ys);
}

/* ------------------------------------------------------------------------ */
/* the writer's per-token steps                                              */


static int32_t forward_portable(const uint8_t *src, int dtype, uint32_t C, uint32_t D, const float *cs,
                                const float *sn, const float *mean, const float *w, int32_t *U, int64_t *sumsq) {
    const uint32_t H = D / 2;
    float x[4096];
    for (uint32_t c = 0; c < C; c++) x[c] = pca_load_value(src, dtype, c);
    if (cs)
        for (uint32_t b = 0; b < C; b += D)
            for (uint32_t j = 0; j < H; j++) {
                const float a = x[b + j], v = x[b + j + H];
                const float ac = a * cs[j], vs = v * sn[j], vc = v * cs[j], as = a * sn[j];
                x[b + j] = ac + vs;
                x[b + j + H] = vc - as;
            }
    for (uint32_t c = 0; c < C; c++) {
        const float d = x[c] - mean[c];
        const float u = d * w[c];
        double v = (double)u * 256.0;
        v = v > 8388607.0 ? 8388607.0 : v < -8388607.0 ? -8388607.0 : v; /* clamp, then round: the same */
        U[c] = (int32_t)pca_rne(v);
    }
    int64_t ss = 0;
    int32_t mx = 0;
    for (uint32_t c = 0; c < C; c++) {
        const int32_t a = U[c] < 0 ? -U[c] : U[c];
        mx = a > mx ? a : mx;
        ss += (int64_t)a * a;
    }
    *sumsq = ss;
    return mx;
}

static void quantize_portable(const int32_t *y, uint32_t n, double r, int16_t *q, uint32_t *l1) {
    for (uint32_t i = 0; i < n; i++) {
        double v = (double)y[i] * r;
        v = v > 32767.0 ? 32767.0 : v < -32767.0 ? -32767.0 : v;
        const int32_t k = (int32_t)pca_rne(v);
        q[i] = (int16_t)k;
        l1[i] += (uint32_t)(k < 0 ? -k : k);
    }
}

#ifdef PCA_HAVE_AVX2
/* 8 channels at a time. f32 u * 2^8 is exact (a power of two; an overflow to infinity clamps as
 * the f64 product would), so clamping and rounding in f32 give the f64 result; rounding by
 * vroundps (nearest even), not by the MXCSR mode. Each f32 operation as the portable loop's. */
__attribute__((target("avx2"))) static int32_t forward_avx2(const uint8_t *src, int dtype, uint32_t C, uint32_t D,
                                                            const float *cs, const float *sn, const float *mean,
                                                            const float *w, int32_t *U, int64_t *sumsq) {
    const uint32_t H = D / 2;
    float x[4096] __attribute__((aligned(32)));
    for (uint32_t c = 0; c < C; c += 8) {
        __m256 v;
        if (dtype == PCA_DTYPE_F32) v = _mm256_loadu_ps((const float *)src + c);
        else if (dtype == PCA_DTYPE_BF16)
            v = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 2 * (size_t)c))), 16));
        else { /* f16: the portable widening (F16C is a feature of its own) */
            for (uint32_t i = 0; i < 8; i++) x[c + i] = pca_load_value(src, dtype, c + i);
            continue;
        }
        _mm256_store_ps(x + c, v);
    }
    if (cs)
        for (uint32_t b = 0; b < C; b += D)
            for (uint32_t j = 0; j < H; j += 8) {
                const __m256 a = _mm256_load_ps(x + b + j), v = _mm256_load_ps(x + b + j + H);
                const __m256 c8 = _mm256_loadu_ps(cs + j), s8 = _mm256_loadu_ps(sn + j);
                _mm256_store_ps(x + b + j, _mm256_add_ps(_mm256_mul_ps(a, c8), _mm256_mul_ps(v, s8)));
                _mm256_store_ps(x + b + j + H, _mm256_sub_ps(_mm256_mul_ps(v, c8), _mm256_mul_ps(a, s8)));
            }
    const __m256 lim = _mm256_set1_ps(8388607.0f), nlim = _mm256_set1_ps(-8388607.0f), q8 = _mm256_set1_ps(256.0f);
    __m256i mx = _mm256_setzero_si256(), ss = mx;
    for (uint32_t c = 0; c < C; c += 8) {
        const __m256 u = _mm256_mul_ps(_mm256_sub_ps(_mm256_load_ps(x + c), _mm256_loadu_ps(mean + c)), _mm256_loadu_ps(w + c));
        const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(u, q8), nlim), lim);
        const __m256i k = _mm256_cvttps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm256_storeu_si256((__m256i *)(U + c), k);
        const __m256i a = _mm256_abs_epi32(k); /* < 2^23: its square < 2^46, 64-bit sums */
        mx = _mm256_max_epi32(mx, a);
        ss = _mm256_add_epi64(ss, _mm256_add_epi64(_mm256_mul_epu32(a, a), _mm256_mul_epu32(_mm256_srli_epi64(a, 32),
                                                                                          _mm256_srli_epi64(a, 32))));
    }
    int32_t m8[8];
    int64_t s4[4];
    _mm256_storeu_si256((__m256i *)m8, mx);
    _mm256_storeu_si256((__m256i *)s4, ss);
    int32_t m = 0;
    for (int i = 0; i < 8; i++) m = m8[i] > m ? m8[i] : m;
    *sumsq = s4[0] + s4[1] + s4[2] + s4[3];
    return m;
}

/* 4 tokens at a time in f64 (the product must be rounded in f64) */
__attribute__((target("avx2"))) static uint32_t quantize_avx2(const int32_t *y, uint32_t n, double r, int16_t *q,
                                                             uint32_t *l1) {
    const __m256d R = _mm256_set1_pd(r), lim = _mm256_set1_pd(32767.0), nlim = _mm256_set1_pd(-32767.0);
    uint32_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const __m256d v = _mm256_mul_pd(_mm256_cvtepi32_pd(_mm_loadu_si128((const __m128i *)(y + i))), R);
        const __m256d c = _mm256_min_pd(_mm256_max_pd(v, nlim), lim);
        const __m128i k = _mm256_cvttpd_epi32(_mm256_round_pd(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm_storel_epi64((__m128i *)(q + i), _mm_packs_epi32(k, k));
        _mm_storeu_si128((__m128i *)(l1 + i), _mm_add_epi32(_mm_loadu_si128((const __m128i *)(l1 + i)), _mm_abs_epi32(k)));
    }
    return i;
}
#endif

int32_t pca_forward_token(const uint8_t *src, int dtype, uint32_t C, uint32_t D, const float *cs, const float *sn,
                          const float *mean, const float *w, int32_t *U, int64_t *sumsq) {
#ifdef PCA_HAVE_AVX2
    if (C % 8 == 0 && (D / 2) % 8 == 0 && pca_simd_avx2()) return forward_avx2(src, dtype, C, D, cs, sn, mean, w, U, sumsq);
#endif
    return forward_portable(src, dtype, C, D, cs, sn, mean, w, U, sumsq);
}

void pca_quantize(const int32_t *y, uint32_t n, double r, int16_t *q, uint32_t *l1) {
    uint32_t i = 0;
#ifdef PCA_HAVE_AVX2
    if (pca_simd_avx2()) i = quantize_avx2(y, n, r, q, l1);
#endif
    quantize_portable(y + i, n - i, r, q + i, l1 + i);
}

static void exact_portable(const int32_t *U, const int16_t *basis, uint32_t C, int64_t *acc) {
    for (uint32_t k = 0; k < C; k++) acc[k] = 0;
    for (uint32_t c = 0; c < C; c++) {
        const int64_t u = U[c];
        const int16_t *b = basis + (size_t)c * C;
        for (uint32_t k = 0; k < C; k++) acc[k] += u * b[k];
    }
}

#ifdef PCA_HAVE_AVX2
/* 8 columns at a time: vpmuldq on the even and the odd int32 lanes (exact 64-bit products) */
__attribute__((target("avx2"))) static void exact_avx2(const int32_t *U, const int16_t *basis, uint32_t C,
                                                      int64_t *acc) {
    for (uint32_t k0 = 0; k0 < C; k0 += 8) {
        __m256i ev = _mm256_setzero_si256(), od = ev;
        const int16_t *b = basis + k0;
        for (uint32_t c = 0; c < C; c++, b += C) {
            const __m256i u = _mm256_set1_epi32(U[c]);
            const __m256i B = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)b));
            ev = _mm256_add_epi64(ev, _mm256_mul_epi32(u, B));
            od = _mm256_add_epi64(od, _mm256_mul_epi32(u, _mm256_srli_epi64(B, 32)));
        }
        int64_t e[4], o[4];
        _mm256_storeu_si256((__m256i *)e, ev);
        _mm256_storeu_si256((__m256i *)o, od);
        for (int i = 0; i < 4; i++) {
            acc[k0 + 2 * i] = e[i];
            acc[k0 + 2 * i + 1] = o[i];
        }
    }
}
#endif

void pca_exact_token(const int32_t *U, const int16_t *basis, uint32_t C, int64_t *acc) {
#ifdef PCA_HAVE_AVX2
    if (C % 8 == 0 && pca_simd_avx2()) {
        exact_avx2(U, basis, C, acc);
        return;
    }
#endif
    exact_portable(U, basis, C, acc);
}

/* ------------------------------------------------------------------------ */
/* the reader's per-token step                                               */
static void inverse_portable(const int32_t *a, uint32_t C, uint32_t D, const float *h, const float *mean,
                             const float *cs, const float *sn, int dtype, uint8_t *dst) {
    const uint32_t H = D / 2;
    float x[4096];
    for (uint32_t c = 0; c < C; c++) {
        const float p = (float)a[c] * h[c];
        x[c] = p + mean[c];
    }
    if (cs)
        for (uint32_t b = 0; b < C; b += D)
            for (uint32_t j = 0; j < H; j++) {
                const float u = x[b + j], v = x[b + j + H];
                const float uc = u * cs[j], vs = v * sn[j], vc = v * cs[j], us = u * sn[j];
                x[b + j] = uc - vs;
                x[b + j + H] = vc + us;
            }
    if (dtype == PCA_DTYPE_F32) memcpy(dst, x, C * 4u);
    else if (dtype == PCA_DTYPE_BF16)
        for (uint32_t c = 0; c < C; c++) { const uint16_t b = pca_f32_to_bf16(x[c]); memcpy(dst + 2 * c, &b, 2); }
    else
        for (uint32_t c = 0; c < C; c++) { const uint16_t b = pca_f32_to_f16(x[c]); memcpy(dst + 2 * c, &b, 2); }
}

#ifdef PCA_HAVE_AVX2
/* 8 channels at a time, each f32 operation as the portable loop's; bf16 rounding in integers
 * (the same wrap-around), f16 by the portable rounding */
/* 8 floats rounded to bf16 as pca_f32_to_bf16 does: (bits + 0x7FFF + lsb) >> 16, wrapping */
__attribute__((target("avx2"))) static inline __m128i bf16x8(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                                         _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))), 16);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08)); /* r < 2^16: exact */
}

__attribute__((target("avx2"))) static void inverse_avx2(const int32_t *a, uint32_t C, uint32_t D, const float *h,
                                                        const float *mean, const float *cs, const float *sn,
                                                        int dtype, uint8_t *dst) {
    const uint32_t H = D / 2;
    if (dtype == PCA_DTYPE_BF16) { /* the common case in one pass, no float row in between */
        for (uint32_t b = 0; b < C; b += D)
            for (uint32_t j = 0; j < H; j += 8) {
                const uint32_t c = b + j, d = b + j + H;
                __m256 u = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(a + c))),
                                                       _mm256_loadu_ps(h + c)), _mm256_loadu_ps(mean + c));
                __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(a + d))),
                                                       _mm256_loadu_ps(h + d)), _mm256_loadu_ps(mean + d));
                if (cs) {
                    const __m256 c8 = _mm256_loadu_ps(cs + j), s8 = _mm256_loadu_ps(sn + j);
                    const __m256 u2 = _mm256_sub_ps(_mm256_mul_ps(u, c8), _mm256_mul_ps(v, s8));
                    v = _mm256_add_ps(_mm256_mul_ps(v, c8), _mm256_mul_ps(u, s8));
                    u = u2;
                }
                _mm_storeu_si128((__m128i *)(dst + 2 * (size_t)c), bf16x8(u));
                _mm_storeu_si128((__m128i *)(dst + 2 * (size_t)d), bf16x8(v));
            }
        return;
    }
    float x[4096] __attribute__((aligned(32)));
    for (uint32_t c = 0; c < C; c += 8) {
        const __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(a + c))), _mm256_loadu_ps(h + c));
        _mm256_store_ps(x + c, _mm256_add_ps(p, _mm256_loadu_ps(mean + c)));
    }
    if (cs)
        for (uint32_t b = 0; b < C; b += D)
            for (uint32_t j = 0; j < H; j += 8) {
                const __m256 u = _mm256_load_ps(x + b + j), v = _mm256_load_ps(x + b + j + H);
                const __m256 c8 = _mm256_loadu_ps(cs + j), s8 = _mm256_loadu_ps(sn + j);
                _mm256_store_ps(x + b + j, _mm256_sub_ps(_mm256_mul_ps(u, c8), _mm256_mul_ps(v, s8)));
                _mm256_store_ps(x + b + j + H, _mm256_add_ps(_mm256_mul_ps(v, c8), _mm256_mul_ps(u, s8)));
            }
    if (dtype == PCA_DTYPE_F32) memcpy(dst, x, C * 4u);
    else if (dtype == PCA_DTYPE_BF16) {
        const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
        for (uint32_t c = 0; c < C; c += 8) {
            const __m256i u = _mm256_castps_si256(_mm256_load_ps(x + c));
            const __m256i r = _mm256_srli_epi32(
                _mm256_add_epi32(_mm256_add_epi32(u, bias), _mm256_and_si256(_mm256_srli_epi32(u, 16), one)), 16);
            const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08); /* r < 2^16: exact */
            _mm_storeu_si128((__m128i *)(dst + 2 * (size_t)c), _mm256_castsi256_si128(p));
        }
    } else
        for (uint32_t c = 0; c < C; c++) { const uint16_t b = pca_f32_to_f16(x[c]); memcpy(dst + 2 * c, &b, 2); }
}
#endif

void pca_inverse_token(const int32_t *acc, uint32_t C, uint32_t D, const float *h, const float *mean,
                       const float *cs, const float *sn, int dtype, uint8_t *dst) {
#ifdef PCA_HAVE_AVX2
    if (C % 8 == 0 && (D / 2) % 8 == 0 && pca_simd_avx2()) {
        inverse_avx2(acc, C, D, h, mean, cs, sn, dtype, dst);
        return;
    }
#endif
    inverse_portable(acc, C, D, h, mean, cs, sn, dtype, dst);
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
