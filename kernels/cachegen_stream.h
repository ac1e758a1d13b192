/*
 * CacheGen per-stream primitives shared by the CPU coder (cachegen_cpu.c) and a
 * future CUDA coder. Everything that decides the bytes of the bitstream lives
 * here: quantization, the parametric (discretised Gaussian) frequency tables,
 * the rANS encode/decode steps, the Rice side-info codes and the float
 * conversions. The bitstream is defined in format-spec/cachegen.md; this file
 * must stay in step with it and with the Python reference
 * (kvtool/codecs/cachegen/reference.py).
 *
 * Plain C99 with no libc dependence beyond <stdint.h>/<string.h>; compile with
 * -ffp-contract=off (no FMA contraction: quantization and dequantization are
 * defined as separately rounded fp32 operations). Under nvcc every function
 * becomes __host__ __device__ inline.
 */
#ifndef KVTOOL_CACHEGEN_STREAM_H
#define KVTOOL_CACHEGEN_STREAM_H

#include <stdint.h>
#include <string.h>
#if !defined(__CUDACC__) && !defined(__GNUC__)
#include <math.h>
#endif

#include "cachegen_tables.h"

#ifdef __CUDACC__
#define CG_FN __host__ __device__ __forceinline__
#else
#define CG_FN static inline
#endif

/* ---- format constants -------------------------------------------------- */
#define CG_FORMAT_VERSION 1u
#define CG_MAGIC0 0x43u /* 'C' */
#define CG_MAGIC1 0x47u /* 'G' */
#define CG_HEADER_FIXED 20u
#define CG_DTYPE_BF16 0
#define CG_DTYPE_F16 1
#define CG_DTYPE_F32 2
#define CG_RANS_L 65536u          /* lower bound of the 32-bit rANS state */
#define CG_PROB_BITS_MIN 10
#define CG_PROB_BITS_MAX 15
#define CG_LANES_MAX 64
#define CG_BINS_MIN 4
#define CG_BINS_MAX 256
#define CG_NSYM_MAX 255           /* 2*M+1 for bins 256 */
#define CG_MAX_TOKENS (1u << 24)  /* parameter estimation is exact below this */
#define CG_RICE_ESCAPE 16u        /* unary prefix length that announces a raw value */
#define CG_W_MU 10                /* bit width of a mean code */
#define CG_W_SIGMA 5              /* bit width of a sigma code */
#define CG_W_K 5                  /* bit width of a Rice parameter */

/* ---- fp32 arithmetic, each operation rounded on its own --------------------
 * The host build uses -ffp-contract=off; nvcc would otherwise fuse a*b+c into
 * an FMA, so device code spells the rounding out. */
#ifdef __CUDA_ARCH__
#define CG_FMUL(a, b) __fmul_rn((a), (b))
#define CG_FADD(a, b) __fadd_rn((a), (b))
#define CG_FDIV(a, b) __fdiv_rn((a), (b))
#else
#define CG_FMUL(a, b) ((a) * (b))
#define CG_FADD(a, b) ((a) + (b))
#define CG_FDIV(a, b) ((a) / (b))
#endif

/* ---- float conversions (bit-exact, round-to-nearest-even) --------------- */
CG_FN float cg_f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
CG_FN uint32_t cg_bits_from_f32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

CG_FN float cg_bf16_to_f32(uint16_t h) { return cg_f32_from_bits((uint32_t)h << 16); }

/* finite inputs only (dequantized values are always finite) */
CG_FN uint16_t cg_f32_to_bf16(float f) {
    uint32_t u = cg_bits_from_f32(f);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

CG_FN float cg_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t man = h & 0x3FFu;
    if (exp == 0x1Fu) return cg_f32_from_bits(sign | 0x7F800000u | (man << 13));
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24, exact in fp32 */
        float v = (float)man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    return cg_f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

/* finite inputs with |f| <= 65504 (dequantized values never exceed the scale) */
CG_FN uint16_t cg_f32_to_f16(float f) {
    uint32_t u = cg_bits_from_f32(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7FFFFFFFu;
    if (a >= 0x47800000u) return (uint16_t)(sign | 0x7C00u); /* overflow -> inf (unreachable) */
    if (a < 0x38800000u) {
        /* result is subnormal or zero: round a * 2^24 to an integer (RNE) */
        int e = (int)(a >> 23);            /* biased fp32 exponent, < 113 */
        if (e < 102) return sign;          /* < 2^-25: rounds to zero */
        uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
        int shift = 126 - e;               /* value = m * 2^(e-150); want m * 2^(e-150+24) */
        uint32_t q = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    /* normal: rebias exponent, round mantissa 23 -> 10 bits */
    uint32_t r = a - 0x38000000u; /* exponent rebias 127 -> 15 */
    r += 0xFFFu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (uint16_t)(r >> 13));
}

/* ---- quantization -------------------------------------------------------- */
/* M = bins/2 - 1; symbols are 0..2M. */
CG_FN int cg_half_range(int bins) { return bins / 2 - 1; }

/* Tokens whose scale is below 2^-100 (M / scale would overflow fp32) are
 * quantized as if multiplied by 2^64 (exact): x and scale both get this
 * pre-scale, which is 1 for every other token. */
CG_FN float cg_quant_prescale(float maxabs) { return maxabs < 7.888609052210118e-31f /* 2^-100 */ ? 1.8446744073709552e19f /* 2^64 */ : 1.0f; }

/* factor = M / (max * prescale) in fp32; 0 for an all-zero token */
CG_FN float cg_quant_factor(int M, float maxabs) {
    return maxabs > 0.0f ? CG_FDIV((float)M, CG_FMUL(maxabs, cg_quant_prescale(maxabs))) : 0.0f;
}

/* q = clamp(rne(fp32(fp32((x * prescale) * factor) + M)), 0, 2M) */
CG_FN int cg_quantize(float x, float prescale, float factor, int M) {
    float y = CG_FMUL(CG_FMUL(x, prescale), factor);
    y = CG_FADD(y, (float)M);
#if defined(__CUDACC__) || !defined(__GNUC__)
    float r = rintf(y);
#else
    float r = __builtin_rintf(y);
#endif
    int q = (int)r;
    if (q < 0) q = 0;
    if (q > 2 * M) q = 2 * M;
    return q;
}

/* dequantization unit for symbol q: fp32((q - M) / M); value = fp32(unit * scale) */
CG_FN float cg_dequant_unit(int q, int M) { return CG_FDIV((float)(q - M), (float)M); }
/* value before the cast to the KV dtype */
CG_FN float cg_dequant(float unit, float scale) { return CG_FMUL(unit, scale); }

/* ---- parametric frequency tables ----------------------------------------- */
/* Parameter estimation from the stream's symbol count N, sum S1 and sum of
 * squares S2 (exact integer arithmetic; N < 2^24). */
CG_FN uint32_t cg_estimate_mu(uint64_t N, uint64_t S1, int nsym) {
    uint64_t mq = (8u * S1 + N) / (2u * N);
    uint64_t hi = 4u * (uint64_t)(nsym - 1);
    return (uint32_t)(mq > hi ? hi : mq);
}

CG_FN uint32_t cg_estimate_sigma(uint64_t N, uint64_t S1, uint64_t S2) {
    uint64_t V = N * S2 - S1 * S1;  /* N^2 * variance, >= 0 */
    uint64_t N2 = N * N;
    uint64_t var16 = ((V / N2) << 16) + (((V % N2) << 16) / N2);
    uint64_t s2 = var16 + 5461u;     /* + floor(2^16 / 12) */
    uint32_t sq = 0;
    for (int j = 0; j < CG_NSIGMA - 1; j++) sq += (CG_TAB(CG_SIG2_THR)[j] <= s2) ? 1u : 0u;
    return sq;
}

/* The Gaussian part of cum[s]: for num = 4 * (edge - mean) = 4s - 2 - mq,
 * floor(Phi(num / (4 sigma)) * spread), spread = 2^P - nsym. It depends on s and
 * mq only through num, which lets a decoder share one table of these values
 * between all channels of a sigma code (kernels/cachegen_cuda.h, cgc_gtab_*). */
CG_FN uint32_t cg_cum_gauss(int32_t num, uint32_t sq, uint32_t spread) {
    const int32_t inv = (int32_t)CG_TAB(CG_INV4S)[sq];
    const int32_t zlim = CG_PHI_ZMAX * 65536;
    int32_t zf = num * inv;                  /* z in Q16 */
    if (zf < -zlim) zf = -zlim;
    if (zf > zlim - 1) zf = zlim - 1;
    uint32_t zi = (uint32_t)(zf + zlim);
    uint32_t idx = zi >> 11, frac = zi & 2047u;
    uint32_t lo = CG_TAB(CG_PHI)[idx], hi = CG_TAB(CG_PHI)[idx + 1];
    uint32_t ph = lo + (((hi - lo) * frac) >> 11);
    return (ph * spread) >> 16;
}

/* cumulative frequencies cum[0..nsym] (cum[0] = 0, cum[nsym] = 2^P, every
 * frequency >= 1) for mean code mq (mean = mq/4) and sigma code sq. */
CG_FN void cg_build_cum(int nsym, uint32_t mq, uint32_t sq, int prob_bits, uint16_t *cum) {
    const uint32_t spread = (1u << prob_bits) - (uint32_t)nsym;
    cum[0] = 0;
    for (int s = 1; s < nsym; s++) {
        int32_t num = 4 * s - 2 - (int32_t)mq;   /* 4 * (edge - mean), edge = s - 1/2 */
        cum[s] = (uint16_t)((uint32_t)s + cg_cum_gauss(num, sq, spread));
    }
    cum[nsym] = (uint16_t)(1u << prob_bits);
}

/* ---- rANS (32-bit state, 16-bit words) ----------------------------------- */
/* Encoder: before putting a symbol of frequency `freq`, a state x >= bound
 * must first emit its low 16 bits (one word at most). */
CG_FN int cg_enc_must_emit(uint32_t x, uint32_t freq, int prob_bits) {
    return (uint64_t)x >= ((uint64_t)freq << (32 - prob_bits));
}
CG_FN uint32_t cg_enc_put(uint32_t x, uint32_t start, uint32_t freq, int prob_bits) {
    return ((x / freq) << prob_bits) + (x % freq) + start;
}
/* Decoder: slot -> symbol s with cum[s] <= slot < cum[s+1]; then advance. */
CG_FN uint32_t cg_dec_slot(uint32_t x, int prob_bits) { return x & ((1u << prob_bits) - 1u); }
CG_FN uint32_t cg_dec_advance(uint32_t x, uint32_t start, uint32_t freq, int prob_bits) {
    return freq * (x >> prob_bits) + (x & ((1u << prob_bits) - 1u)) - start;
}
CG_FN int cg_dec_needs_word(uint32_t x) { return x < CG_RANS_L; }
CG_FN uint32_t cg_dec_push_word(uint32_t x, uint16_t w) { return (x << 16) | w; }

/* ---- LSB-first bit I/O and Rice codes (side information) ------------------ */
typedef struct {
    const uint8_t *p;
    uint64_t nbits;   /* bits available */
    uint64_t pos;     /* next bit */
    int err;
} cg_bitreader;

/* the n (1..32) bits at br->pos, LSB-first, without advancing; the caller has
 * checked pos + n <= nbits, so only bytes inside the buffer are read */
CG_FN uint32_t cg_br_peek(const cg_bitreader *br, int n) {
    const uint64_t first = br->pos >> 3, last = (br->pos + (uint64_t)n - 1u) >> 3;
    uint64_t acc = 0;
    for (uint64_t i = first; i <= last; i++) acc |= (uint64_t)br->p[i] << (8u * (i - first));
    acc >>= (br->pos & 7u);
    return (uint32_t)(n == 32 ? acc : acc & ((1ull << n) - 1u));
}

CG_FN uint32_t cg_br_bits(cg_bitreader *br, int n) {
    if (n == 0) return 0;
    if (br->pos + (uint64_t)n > br->nbits) { br->err = 1; return 0; }
    const uint32_t v = cg_br_peek(br, n);
    br->pos += (uint64_t)n;
    return v;
}

/* number of trailing one bits of v (v has a zero bit somewhere) */
CG_FN int cg_trailing_ones(uint32_t v) {
#if defined(__CUDA_ARCH__)
    return __ffs(~v) - 1;
#elif defined(__GNUC__)
    return __builtin_ctz(~v);
#else
    int n = 0;
    while (v & 1u) { v >>= 1; n++; }
    return n;
#endif
}

/* One Rice-coded value around `base` with parameter k; `w` is the field width
 * (raw escape). Returns the value; sets br->err on a read past the end. The
 * unary prefix (ones ended by a zero, or CG_RICE_ESCAPE ones) is read in one peek. */
CG_FN uint32_t cg_rice_get(cg_bitreader *br, uint32_t base, int k, int w) {
    const uint64_t left = br->nbits - br->pos;
    const int n = left < CG_RICE_ESCAPE ? (int)left : (int)CG_RICE_ESCAPE;
    const int ones = n ? cg_trailing_ones(cg_br_peek(br, n)) : 0;  /* peek < 2^16, so ~peek has a set bit */
    if (ones >= n) {
        if (n < (int)CG_RICE_ESCAPE) { br->err = 1; return 0; }  /* the stream ends inside the prefix */
        br->pos += CG_RICE_ESCAPE;
        return cg_br_bits(br, w);
    }
    const uint32_t q = (uint32_t)ones;
    br->pos += (uint64_t)ones + 1u;
    uint64_t z = ((uint64_t)q << k) | cg_br_bits(br, k);
    int64_t d = (z & 1u) ? -(int64_t)((z + 1u) >> 1) : (int64_t)(z >> 1);
    int64_t v = (int64_t)base + d;
    if (v < 0 || v >= ((int64_t)1 << w)) { br->err = 1; return 0; }
    return (uint32_t)v;
}

/* cost in bits of one value with the Rice parameter k */
CG_FN uint64_t cg_rice_cost(uint32_t v, uint32_t base, int k, int w) {
    uint64_t z = v >= base ? 2u * (uint64_t)(v - base) : 2u * (uint64_t)(base - v) - 1u;
    uint64_t q = z >> k;
    return q < CG_RICE_ESCAPE ? q + 1u + (uint64_t)k : (uint64_t)CG_RICE_ESCAPE + (uint64_t)w;
}

#endif /* KVTOOL_CACHEGEN_STREAM_H */
