/* The arithmetic kernels of the pca CPU coder: the integer transform and the float conversions. */
#ifndef KVTOOL_PCA_KERNELS_H
#define KVTOOL_PCA_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "pca_cpu.h" /* PCA_DTYPE_* */

#define PCA_TB 4   /* tokens per block of the transform */
#define PCA_JB 24  /* columns per block of the transform (m2's width is a multiple of it) */

/* Y[t][j] = sum over i < 2*pairs[t / PCA_TB] of X[t][i] * M[i][j], for t < tokens (a multiple of
 * PCA_TB) and j < width (a multiple of 8). X comes pair-major, X[t][2p] and X[t][2p+1] the low
 * and high int16 of xp[p * ps + t] (so a coder writing one component walks memory in order); M
 * comes as m2[i/2][j][2], stride columns from one pair of rows to the next (a block of a wider
 * matrix: its columns j0.. at m2 + 2 j0). int32 throughout: the caller guarantees every partial
 * sum fits (decode: sum|q| <= 2^16; encode: the sumsq bound), so any order of summation gives
 * the same result. */
void pca_matmul(const int32_t *xp, size_t ps, const int16_t *m2, size_t stride, size_t width, const uint32_t *pairs,
                size_t tokens, int32_t *Y, size_t ys);

/* 1 when the AVX2 path is in use (x86-64 with AVX2 and KVTOOL_PCA_SIMD not 0). */
int pca_simd_avx2(void);

/* 1 when the AVX-512 paths are in use too (AVX-512 F, BW, VL, VNNI and VBMI2: Ice Lake, Zen 4 and
 * later; KVTOOL_PCA_SIMD neither 0 nor "avx2") */
int pca_simd_avx512(void);
/* 1: version 2's unit decoder reads the table entries and words by gathers; 0: by scalar loads
 * (where every read of a batch stays inside the payload) */
int pca_units_gather(void);

static inline float pca_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t pca_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* bf16 rounding as reference.to_dtype writes it: (bits + 0x7FFF + lsb) >> 16, wrapping in 32 bits
 * (numpy's uint64 sum keeps the same low 32 bits), NaN and infinity included */
static inline uint16_t pca_f32_to_bf16(float f) {
    uint32_t u = pca_bits(f);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float pca_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    if (exp == 0x1Fu) return pca_f32(sign | 0x7F800000u | (man << 13));
    if (exp == 0) { /* zero or subnormal: man * 2^-24, exact */
        float v = (float)man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    return pca_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

/* round to nearest even of |d| <= 2^51: adding 1.5 * 2^52 leaves no fraction bits (the FPU
 * rounds to nearest even), and subtracting it back is exact. Needs no SSE4.1 roundsd. */
static inline double pca_rne(double d) {
    const double magic = 6755399441055744.0;
    return (d + magic) - magic;
}

/* value c of a stored row (bf16, fp16 or fp32 bits, little-endian) as float32 */
static inline float pca_load_value(const uint8_t *row, int dtype, size_t c) {
    if (dtype == PCA_DTYPE_F32) { float f; memcpy(&f, row + 4 * c, 4); return f; }
    uint16_t h;
    memcpy(&h, row + 2 * c, 2);
    return dtype == PCA_DTYPE_BF16 ? pca_f32((uint32_t)h << 16) : pca_f16_to_f32(h);
}


/* The writer's first step for one token (format-spec/pca.md §5.1): x = its C values of dtype at
 * src as f32; for K (cs, sn not NULL: the token's RoPE row, D/2 each) turned back per head;
 * U[c] = clamp(round(f64((x[c] - mean[c]) * w[c]) * 2^8), +-(2^23 - 1)). Returns max |U[c]|, and
 * sum U[c]^2 in *sumsq (< 2^58: exact in int64). */
int32_t pca_forward_token(const uint8_t *src, int dtype, uint32_t C, uint32_t D, const float *cs, const float *sn,
                          const float *mean, const float *w, int32_t *U, int64_t *sumsq);

/* q[i] = clamp(round(f64(y[i]) * r), +-32767) and l1[i] += |q[i]|, for i < n */
void pca_quantize(const int32_t *y, uint32_t n, double r, int16_t *q, uint32_t *l1);

/* The exact transform of one token whose U is too large for the int16 path: acc[k] = sum_c U[c]
 * basis[c][k] for k < C, in int64 (|acc| < 2^23 2^15 4096 = 2^50: exact in any order) */
void pca_exact_token(const int32_t *U, const int16_t *basis, uint32_t C, int64_t *acc);

/* The reader's last step for one token (§5.2): x[c] = f32(acc[c]) * h[c] + mean[c] (multiply,
 * then add); for K (cs, sn not NULL) turned forward per head; rounded to dtype at dst. */
void pca_inverse_token(const int32_t *acc, uint32_t C, uint32_t D, const float *h, const float *mean,
                       const float *cs, const float *sn, int dtype, uint8_t *dst);

#endif
