/*
 * CacheGen CPU coder: quantize + rANS-encode a [2L, T, C] chunk, and decode it,
 * one layer section per task, layers spread over pthreads. The bytes depend
 * only on the input (never on the thread count): layer sections are produced
 * independently and concatenated in layer order. Bitstream:
 * format-spec/cachegen.md.
 */
#include "cachegen_cpu.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cachegen_stream.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvtool's CacheGen coder assumes a little-endian host"
#endif


static size_t cg_esize(int dtype) { return dtype == CG_DTYPE_F32 ? 4u : 2u; }
static int cg_wscale(int dtype) { return dtype == CG_DTYPE_F32 ? 32 : 16; }

static void put_u32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static uint32_t get_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint16_t get_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

static size_t header_size(uint32_t layers) {
    return CG_HEADER_FIXED + (((size_t)layers + 3u) & ~(size_t)3u) + 4u * (size_t)layers;
}

/* ------------------------------------------------------------------------ */
/* run-time SIMD dispatch                                                    */
/* The AVX2 paths (x86-64, chosen at run time when the CPU has AVX2 and F16C)  */
/* compute exactly what the portable code computes: same bytes, same values.  */
/* KVTOOL_CACHEGEN_SIMD=0 (or n/f...) forces the portable code; the tests run */
/* both and compare.                                                          */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CG_HAVE_AVX2_PATH 1
#include <immintrin.h>

static int32_t g_perm[256][8];   /* decoder: word i of a block goes to the i-th lane needing one */
static pthread_once_t g_simd_once = PTHREAD_ONCE_INIT;
static int g_use_avx2 = 0;

static void init_simd(void) {
    for (int m = 0; m < 256; m++) {
        int k = 0;
        for (int lane = 0; lane < 8; lane++) {
            g_perm[m][lane] = (m >> lane) & 1 ? k : 0;
            k += (m >> lane) & 1;
        }
    }
    const char *env = getenv("KVTOOL_CACHEGEN_SIMD");
    int off = env && (env[0] == '0' || env[0] == 'n' || env[0] == 'N' || env[0] == 'f' || env[0] == 'F');
    __builtin_cpu_init();
    g_use_avx2 = !off && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}
#define CG_INIT_SIMD() pthread_once(&g_simd_once, init_simd)
#else
#define CG_INIT_SIMD() ((void)0)
#endif

/* ------------------------------------------------------------------------ */
/* bit writer (LSB-first)                                                    */
typedef struct {
    uint8_t *p;
    size_t cap;     /* bytes; at least 8 past the last byte any field reaches */
    uint64_t pos;   /* bits written */
} bitwriter;

/* the low n (0..32) bits of v, with one 8-byte read-modify-write (the buffer
 * starts zeroed and has 8 bytes of slack: see encode_layer's sidecap) */
static void bw_put(bitwriter *bw, uint64_t v, int n) {
    uint8_t *p = bw->p + (bw->pos >> 3);
    uint64_t cur;
    memcpy(&cur, p, 8);
    cur |= (v & ((1ull << n) - 1u)) << (bw->pos & 7u);
    memcpy(p, &cur, 8);
    bw->pos += (uint64_t)n;
}

/* The k-th smallest (0-based) of v[0..n), all < 2^w: a radix select, one
 * counting pass per byte from the top, O(n) whatever the values. */
static uint32_t select_kth(const uint32_t *v, size_t n, size_t k, int w) {
    uint32_t prefix = 0, pmask = 0;
    for (int shift = (w - 1) / 8 * 8; shift >= 0; shift -= 8) {
        size_t cnt[256] = {0};
        for (size_t i = 0; i < n; i++)
            if ((v[i] & pmask) == prefix) cnt[(v[i] >> shift) & 255u]++;
        uint32_t b = 0;
        while (k >= cnt[b]) k -= cnt[b++];
        prefix |= b << shift;
        pmask |= 255u << shift;
    }
    return prefix;
}

/* The k in 0..min(w,31) of the fewest bits for these values (smallest on
 * ties). z: scratch of n entries. */
static int rice_best_k(const uint32_t *v, size_t n, uint32_t base, int w, uint32_t *z) {
    const int kmax = w < 31 ? w : 31;
    int bestk = 0;
    uint64_t best = UINT64_MAX;
    if (w >= 32) {   /* zigzag values need 33 bits: the generic cost */
        for (int k = 0; k <= kmax; k++) {
            uint64_t c = 0;
            for (size_t i = 0; i < n; i++) c += cg_rice_cost(v[i], base, k, w);
            if (c < best) { best = c; bestk = k; }
        }
        return bestk;
    }
    /* w <= 16: zigzag values < 2^17 and sums < 2^24 * 48 fit 32 bits; the
     * inner loop vectorises */
    for (size_t i = 0; i < n; i++) z[i] = v[i] >= base ? 2u * (v[i] - base) : 2u * (base - v[i]) - 1u;
    for (int k = 0; k <= kmax; k++) {
        const uint32_t esc = CG_RICE_ESCAPE + (uint32_t)w, kk = (uint32_t)k + 1u;
        uint32_t c = 0;
        for (size_t i = 0; i < n; i++) {
            const uint32_t q = z[i] >> k;
            c += q < CG_RICE_ESCAPE ? q + kk : esc;
        }
        if (c < best) { best = c; bestk = k; }
    }
    return bestk;
}

/* Rice block: base (w bits, lower median), k (5 bits, minimal cost, smallest
 * on ties), then one code per value. */
static int rice_block_put(bitwriter *bw, const uint32_t *v, size_t n, int w) {
    uint32_t *z = (uint32_t *)malloc(n * sizeof(uint32_t));
    if (!z) return CG_ERR_NOMEM;
    const uint32_t base = select_kth(v, n, (n - 1) / 2, w);
    const int bestk = rice_best_k(v, n, base, w, z);
    free(z);
    bw_put(bw, base, w);
    bw_put(bw, (uint64_t)bestk, CG_W_K);
    for (size_t i = 0; i < n; i++) {
        uint64_t zz = v[i] >= base ? 2u * (uint64_t)(v[i] - base) : 2u * (uint64_t)(base - v[i]) - 1u;
        uint64_t q = zz >> bestk;
        if (q < CG_RICE_ESCAPE) {
            bw_put(bw, (1ull << q) - 1u, (int)q + 1);   /* q ones, a zero */
            bw_put(bw, zz, bestk);
        } else {
            bw_put(bw, (1ull << CG_RICE_ESCAPE) - 1u, CG_RICE_ESCAPE);
            bw_put(bw, v[i], w);
        }
    }
    return CG_OK;
}

/* ------------------------------------------------------------------------ */
/* encoder                                                                   */
typedef struct {
    uint8_t *buf;
    size_t len;
    int rc;
} layer_out;

static float bits_to_f32(uint32_t b, int dtype) {
    if (dtype == CG_DTYPE_F32) return cg_f32_from_bits(b);
    if (dtype == CG_DTYPE_BF16) return cg_bf16_to_f32((uint16_t)b);
    return cg_f16_to_f32((uint16_t)b);
}

/* bit pattern of the largest |x| of a row; 1 if the row holds a NaN or infinity */
static int row_absmax(const uint8_t *row, int dtype, uint32_t C, uint32_t *maxbits) {
    uint32_t m = 0;
    if (dtype == CG_DTYPE_F32) {
        const uint32_t *r = (const uint32_t *)row;
        for (uint32_t c = 0; c < C; c++) { uint32_t a = r[c] & 0x7FFFFFFFu; m = a > m ? a : m; }
        *maxbits = m;
        return m >= 0x7F800000u;
    }
    const uint16_t *r = (const uint16_t *)row;
    for (uint32_t c = 0; c < C; c++) { uint32_t a = r[c] & 0x7FFFu; m = a > m ? a : m; }
    *maxbits = m;
    return dtype == CG_DTYPE_BF16 ? m >= 0x7F80u : m >= 0x7C00u;
}

/* Quantizes channels [c0, C) of one row (scalar): symbols into qr, per-channel
 * sums of q and q^2 into s1/s2. */
static void quantize_tail(const uint8_t *row, int dtype, uint32_t c0, uint32_t C, float pre, float factor, int M,
                          uint8_t *qr, uint32_t *s1, uint32_t *s2) {
    for (uint32_t c = c0; c < C; c++) {
        float x;
        if (dtype == CG_DTYPE_F32) x = cg_f32_from_bits(((const uint32_t *)row)[c]);
        else if (dtype == CG_DTYPE_BF16) x = cg_bf16_to_f32(((const uint16_t *)row)[c]);
        else x = cg_f16_to_f32(((const uint16_t *)row)[c]);
        const int s = cg_quantize(x, pre, factor, M);
        qr[c] = (uint8_t)s;
        s1[c] += (uint32_t)s;
        s2[c] += (uint32_t)(s * s);
    }
}

#ifdef CG_HAVE_AVX2_PATH
/* row_absmax, 16 (8 for fp32) values per step */
__attribute__((target("avx2"))) static int row_absmax_avx2(const uint8_t *row, int dtype, uint32_t C,
                                                           uint32_t *maxbits) {
    uint32_t m = 0, c = 0;
    if (dtype == CG_DTYPE_F32) {
        const __m256i abs = _mm256_set1_epi32(0x7FFFFFFF);
        __m256i acc = _mm256_setzero_si256();
        for (; c + 8 <= C; c += 8)
            acc = _mm256_max_epu32(acc, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(row + 4u * c)), abs));
        uint32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, acc);
        for (int k = 0; k < 8; k++) m = lanes[k] > m ? lanes[k] : m;
    } else {
        const __m256i abs = _mm256_set1_epi16(0x7FFF);
        __m256i acc = _mm256_setzero_si256();
        for (; c + 16 <= C; c += 16)
            acc = _mm256_max_epu16(acc, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(row + 2u * c)), abs));
        uint16_t lanes[16];
        _mm256_storeu_si256((__m256i *)lanes, acc);
        for (int k = 0; k < 16; k++) m = lanes[k] > m ? lanes[k] : m;
    }
    uint32_t tail;
    if (c < C) {
        row_absmax(row + cg_esize(dtype) * c, dtype, C - c, &tail);
        m = tail > m ? tail : m;
    }
    *maxbits = m;
    if (dtype == CG_DTYPE_F32) return m >= 0x7F800000u;
    return dtype == CG_DTYPE_BF16 ? m >= 0x7F80u : m >= 0x7C00u;
}

/* The symbols of one row, 8 channels per step: the same fp32 operations as
 * cg_quantize (two multiplies, an add, round-to-nearest-even, clamp), and the
 * per-channel sums of q and q^2. Returns the first channel left to the scalar
 * tail. */
__attribute__((target("avx2,f16c"))) static uint32_t quantize_row_avx2(
    const uint8_t *row, int dtype, uint32_t C, float pre, float factor, int M, uint8_t *qr, uint32_t *s1,
    uint32_t *s2) {
    const __m256 vpre = _mm256_set1_ps(pre), vfac = _mm256_set1_ps(factor), vm = _mm256_set1_ps((float)M);
    const __m256i lo = _mm256_setzero_si256(), hi = _mm256_set1_epi32(2 * M);
    const __m128i pack8 = _mm_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    uint32_t c = 0;
    for (; c + 8 <= C; c += 8) {
        __m256 x;
        if (dtype == CG_DTYPE_BF16)
            x = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2u * c))), 16));
        else if (dtype == CG_DTYPE_F16)
            x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2u * c)));
        else
            x = _mm256_loadu_ps((const float *)(row + 4u * c));
        __m256 y = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(x, vpre), vfac), vm);
        __m256i q = _mm256_cvtps_epi32(y);   /* rounds as rintf: the current mode, nearest-even */
        q = _mm256_min_epi32(_mm256_max_epi32(q, lo), hi);
        __m256i a1 = _mm256_add_epi32(_mm256_loadu_si256((const __m256i *)(s1 + c)), q);
        __m256i a2 = _mm256_add_epi32(_mm256_loadu_si256((const __m256i *)(s2 + c)), _mm256_mullo_epi32(q, q));
        _mm256_storeu_si256((__m256i *)(s1 + c), a1);
        _mm256_storeu_si256((__m256i *)(s2 + c), a2);
        const __m128i b0 = _mm_shuffle_epi8(_mm256_castsi256_si128(q), pack8);
        const __m128i b1 = _mm_shuffle_epi8(_mm256_extracti128_si256(q, 1), pack8);
        const uint64_t bytes = (uint64_t)(uint32_t)_mm_cvtsi128_si32(b0) | (uint64_t)(uint32_t)_mm_cvtsi128_si32(b1) << 32;
        memcpy(qr + c, &bytes, 8);
    }
    return c;
}
#endif

/* Step 1 of a layer: per-token scales (bit patterns), symbols q [T, C] and the
 * per-channel sums of q and q^2 (S: 2 per channel). Per-channel sums are
 * gathered in 32 bits (a token adds at most 254^2 < 2^16) and flushed to 64
 * bits every 2^15 tokens. Returns CG_ERR_NONFINITE on a NaN or infinity. */
static int quantize_layer(const uint8_t *src, int dtype, uint32_t T, uint32_t C, int M, uint32_t *scales,
                          uint8_t *q, uint64_t *S, uint32_t *s1, uint32_t *s2) {
    const size_t es = cg_esize(dtype);
    memset(s1, 0, (size_t)C * sizeof(uint32_t));
    memset(s2, 0, (size_t)C * sizeof(uint32_t));
    for (uint32_t t = 0; t < T; t++) {
        const uint8_t *r = src + (size_t)t * C * es;
        uint8_t *qr = q + (size_t)t * C;
        uint32_t mb, c0 = 0;
        int bad;
#ifdef CG_HAVE_AVX2_PATH
        if (g_use_avx2) bad = row_absmax_avx2(r, dtype, C, &mb);
        else
#endif
            bad = row_absmax(r, dtype, C, &mb);
        if (bad) return CG_ERR_NONFINITE;
        scales[t] = mb;
        const float maxf = bits_to_f32(mb, dtype);
        const float factor = cg_quant_factor(M, maxf);
        const float pre = cg_quant_prescale(maxf);
#ifdef CG_HAVE_AVX2_PATH
        if (g_use_avx2) c0 = quantize_row_avx2(r, dtype, C, pre, factor, M, qr, s1, s2);
#endif
        quantize_tail(r, dtype, c0, C, pre, factor, M, qr, s1, s2);
        if ((t & 0x7FFFu) == 0x7FFFu || t == T - 1u) {
            for (uint32_t c = 0; c < C; c++) {
                S[2u * c] += s1[c];
                S[2u * c + 1u] += s2[c];
            }
            memset(s1, 0, (size_t)C * sizeof(uint32_t));
            memset(s2, 0, (size_t)C * sizeof(uint32_t));
        }
    }
    return CG_OK;
}

/* One symbol's encoder entry: x -> x + start + floor(x / freq) * (2^P - freq)
 * (= cg_enc_put), after emitting a word when x >= xmax (= cg_enc_must_emit).
 * floor(x / freq) = mulhi64(x, rcp), rcp = floor(2^64 / freq) + 1: with
 * 2^64 = a*freq + r, x*rcp / 2^64 = x/freq + x*(freq - r) / (freq*2^64), and
 * that extra term is < 2^-32 < 1/freq, too small to reach the next integer
 * for every x < 2^32 (the encoder's states) and freq < 2^16. freq = 1 (whose
 * rcp would need 65 bits) has rcp = 0 and takes q = x. */
typedef struct {
    uint64_t rcp;
    uint32_t xmax;     /* freq << (32 - P) */
    uint16_t start;    /* cum[s] */
    uint16_t cmpl;     /* 2^P - freq */
} enc_sym;

static void enc_syms_build(enc_sym *es, const uint16_t *cum, int nsym, int P) {
    for (int s = 0; s < nsym; s++) {
        const uint32_t f = (uint32_t)cum[s + 1] - cum[s];
        /* floor((2^64-1)/f) + 1: floor(2^64/f) + 1, or exactly 2^64/f when f is a power of two (also exact) */
        es[s].rcp = f > 1u ? UINT64_MAX / f + 1u : 0u;
        es[s].xmax = f << (32 - P);
        es[s].start = cum[s];
        es[s].cmpl = (uint16_t)((1u << P) - f);
    }
}

/* Step 4 of a layer: rANS over the interleaved lanes, in the reverse of the
 * decoding order. Words go down from wend; returns the first word written.
 * Branch-free: a word slot is written on every step and kept when x moves. */
static uint16_t *rans_encode_layer(const uint8_t *q, uint32_t T, uint32_t C, int N, int P, const enc_sym *tab,
                                   uint32_t stride, uint32_t *x, uint16_t *wend) {
    uint16_t *wp = wend;
    for (int j = 0; j < N; j++) x[j] = CG_RANS_L;
    const int jlast = (int)((C - 1u) % (uint32_t)N);
    for (int64_t t = (int64_t)T - 1; t >= 0; t--) {
        const uint8_t *qr = q + (size_t)t * C;
        int j = jlast;
        for (int64_t c = (int64_t)C - 1; c >= 0; c--) {
            const enc_sym *e = tab + (size_t)c * stride + qr[c];
            uint32_t xx = x[j];
            const uint32_t emit = xx >= e->xmax;
            wp[-1] = (uint16_t)xx;
            wp -= emit;
            xx = emit ? xx >> 16 : xx;
#ifdef __SIZEOF_INT128__
            uint32_t qd = (uint32_t)(((unsigned __int128)xx * e->rcp) >> 64);
            qd = e->rcp ? qd : xx;
#else
            const uint32_t qd = xx / (e->xmax >> (32 - P));
#endif
            x[j] = xx + e->start + qd * e->cmpl;
            j = j == 0 ? N - 1 : j - 1;
        }
    }
    return wp;
}

#ifdef CG_HAVE_AVX2_PATH
/* pshufb control: the 16-bit words of the lanes set in mask m, in lane order,
 * moved to the top of 8 words (the rest don't matter: free space below wp). */
static uint8_t g_wpack[256][16];
static pthread_once_t g_wpack_once = PTHREAD_ONCE_INIT;
static void init_wpack(void) {
    for (int m = 0; m < 256; m++) {
        const int cnt = __builtin_popcount((unsigned)m);
        int o = 8 - cnt;
        memset(g_wpack[m], 0x80, 16);
        for (int lane = 0; lane < 8; lane++)
            if ((m >> lane) & 1) { g_wpack[m][2 * o] = (uint8_t)(2 * lane); g_wpack[m][2 * o + 1] = (uint8_t)(2 * lane + 1); o++; }
    }
}

/* rans_encode_layer with 8 lanes per step. sc: per (channel, symbol)
 * start | (2^P - freq) << 16. x / freq in double precision: x < 2^32 and
 * freq < 2^16, so x/freq is either an integer (exact) or at least 1/freq >
 * 2^-16 below the next one, far more than the rounding error (< 2^-20): the
 * truncated quotient is floor(x / freq). Lanes of a group past its last
 * multiple of 8 take the scalar step. Same words, same order, same states. */
__attribute__((target("avx2"))) static uint16_t *rans_encode_layer_avx2(
    const uint8_t *q, uint32_t T, uint32_t C, int N, int P, const uint32_t *sc, uint32_t stride, uint32_t *x,
    uint16_t *wend) {
    uint16_t *wp = wend;
    for (int j = 0; j < N; j++) x[j] = CG_RANS_L;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i rowoff = _mm256_mullo_epi32(lane, _mm256_set1_epi32((int)stride));
    const __m256i ffff = _mm256_set1_epi32(0xFFFF), sign = _mm256_set1_epi32((int)0x80000000u);
    const __m256i probone = _mm256_set1_epi32(1 << P);
    const __m128i sh = _mm_cvtsi32_si128(32 - P);
    const __m256d two31 = _mm256_set1_pd(2147483648.0);
    const uint32_t first_g = C % (uint32_t)N ? C % (uint32_t)N : (uint32_t)N;
    for (int64_t t = (int64_t)T - 1; t >= 0; t--) {
        const uint8_t *qr = q + (size_t)t * C;
        uint32_t c0 = C - first_g, g = first_g;   /* groups from the last one down */
        for (;;) {
            const uint32_t g8 = g & ~7u;
            for (uint32_t j = g; j-- > g8;) {     /* scalar tail lanes, last first */
                const uint32_t c = c0 + j, e = sc[(size_t)c * stride + qr[c]];
                const uint32_t f = (1u << P) - (e >> 16);
                uint32_t xx = x[j];
                const uint32_t emit = xx >= (f << (32 - P));
                wp[-1] = (uint16_t)xx;
                wp -= emit;
                xx = emit ? xx >> 16 : xx;
                x[j] = xx + (e & 0xFFFFu) + (xx / f) * (e >> 16);
            }
            for (uint32_t j = g8; j >= 8;) {
                j -= 8;
                const uint32_t c = c0 + j;
                __m256i X = _mm256_loadu_si256((const __m256i *)(x + j));
                uint64_t qb;
                memcpy(&qb, qr + c, 8);
                const __m256i idx = _mm256_add_epi32(
                    _mm256_add_epi32(rowoff, _mm256_set1_epi32((int)(c * stride))),
                    _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)qb)));
                const __m256i e = _mm256_i32gather_epi32((const int *)sc, idx, 4);
                const __m256i cmpl = _mm256_srli_epi32(e, 16);
                const __m256i f = _mm256_sub_epi32(probone, cmpl);
                const __m256i xmax = _mm256_sll_epi32(f, sh);
                /* emit: x >= xmax (unsigned) */
                const __m256i emit = _mm256_cmpeq_epi32(_mm256_max_epu32(X, xmax), X);
                const int m = _mm256_movemask_ps(_mm256_castsi256_ps(emit));
                const __m256i lo = _mm256_and_si256(X, ffff);
                const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
                _mm_storeu_si128((__m128i *)(wp - 8), _mm_shuffle_epi8(w16, _mm_loadu_si128((const __m128i *)g_wpack[m])));
                wp -= __builtin_popcount((unsigned)m);
                X = _mm256_blendv_epi8(X, _mm256_srli_epi32(X, 16), emit);
                /* quotient x / f, 4 lanes at a time in double */
                const __m256i xs = _mm256_xor_si256(X, sign);   /* x - 2^31 as signed */
                const __m256d x0 = _mm256_add_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(xs)), two31);
                const __m256d x1 = _mm256_add_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(xs, 1)), two31);
                const __m256d f0 = _mm256_cvtepi32_pd(_mm256_castsi256_si128(f));
                const __m256d f1 = _mm256_cvtepi32_pd(_mm256_extracti128_si256(f, 1));
                const __m256i qd = _mm256_set_m128i(_mm256_cvttpd_epi32(_mm256_div_pd(x1, f1)),
                                                    _mm256_cvttpd_epi32(_mm256_div_pd(x0, f0)));
                X = _mm256_add_epi32(_mm256_add_epi32(X, _mm256_and_si256(e, ffff)), _mm256_mullo_epi32(qd, cmpl));
                _mm256_storeu_si256((__m256i *)(x + j), X);
            }
            if (c0 == 0) break;
            c0 -= (uint32_t)N;
            g = (uint32_t)N;
        }
    }
    return wp;
}
#endif

static void encode_layer(const uint8_t *src, int dtype, uint32_t T, uint32_t C, int M,
                         int P, int N, layer_out *lo) {
    const int nsym = 2 * M + 1;
    const size_t TC = (size_t)T * C;
    uint32_t stride = 1;   /* encoder table row: nsym entries, padded to a power of two */
    while (stride < (uint32_t)nsym) stride <<= 1;
    uint8_t *q = (uint8_t *)malloc(TC);
    uint32_t *scales = (uint32_t *)malloc((size_t)T * sizeof(uint32_t));
    uint64_t *S = (uint64_t *)calloc((size_t)C * 2u, sizeof(uint64_t));
    uint32_t *part = (uint32_t *)malloc((size_t)C * 2u * sizeof(uint32_t));
    uint32_t *mq = (uint32_t *)malloc((size_t)C * sizeof(uint32_t));
    uint32_t *sq = (uint32_t *)malloc((size_t)C * sizeof(uint32_t));
    uint16_t *cum = (uint16_t *)malloc((size_t)(nsym + 1) * sizeof(uint16_t));
#ifdef CG_HAVE_AVX2_PATH
    const int simd = g_use_avx2;
#else
    const int simd = 0;
#endif
    /* the portable rANS loop reads enc_sym entries, the AVX2 one start | cmpl words */
    void *tab = malloc((size_t)C * stride * (simd ? sizeof(uint32_t) : sizeof(enc_sym)));
    uint16_t *words = (uint16_t *)malloc((TC + 16u) * sizeof(uint16_t)); /* + slack below the last word */
    size_t sidecap = ((size_t)T * 48u + (size_t)C * 47u + 256u) / 8u + 16u;
    uint8_t *side = (uint8_t *)calloc(sidecap, 1);
    lo->buf = NULL;
    lo->len = 0;
    lo->rc = CG_ERR_NOMEM;
    if (!q || !scales || !S || !part || !mq || !sq || !cum || !tab || !words || !side) goto done;

    /* 1. quantize, per-channel sums */
    if (quantize_layer(src, dtype, T, C, M, scales, q, S, part, part + C) != CG_OK) {
        lo->rc = CG_ERR_NONFINITE;
        goto done;
    }
    /* 2. per-stream parameters and encoder tables */
    for (uint32_t c = 0; c < C; c++) {
        mq[c] = cg_estimate_mu(T, S[2u * c], nsym);
        sq[c] = cg_estimate_sigma(T, S[2u * c], S[2u * c + 1u]);
        cg_build_cum(nsym, mq[c], sq[c], P, cum);
        if (simd) {
            uint32_t *row = (uint32_t *)tab + (size_t)c * stride;
            for (int s = 0; s < nsym; s++) row[s] = cum[s] | ((1u << P) - ((uint32_t)cum[s + 1] - cum[s])) << 16;
        } else {
            enc_syms_build((enc_sym *)tab + (size_t)c * stride, cum, nsym, P);
        }
    }
    /* 3. side information */
    bitwriter bw = {side, sidecap, 0};
    int rc;
    if ((rc = rice_block_put(&bw, scales, T, cg_wscale(dtype))) != CG_OK ||
        (rc = rice_block_put(&bw, mq, C, CG_W_MU)) != CG_OK ||
        (rc = rice_block_put(&bw, sq, C, CG_W_SIGMA)) != CG_OK) {
        lo->rc = rc;
        goto done;
    }
    size_t side_bytes = (size_t)((bw.pos + 31u) / 32u) * 4u;

    /* 4. rANS, interleaved lanes, reverse order of decoding */
    {
        uint32_t x[CG_LANES_MAX];
        uint16_t *wend = words + TC + 16u, *wp;
#ifdef CG_HAVE_AVX2_PATH
        if (simd) {
            pthread_once(&g_wpack_once, init_wpack);
            wp = rans_encode_layer_avx2(q, T, C, N, P, (const uint32_t *)tab, stride, x, wend);
        } else
#endif
            wp = rans_encode_layer(q, T, C, N, P, (const enc_sym *)tab, stride, x, wend);
        size_t nwords = (size_t)(wend - wp);
        size_t body = side_bytes + 4u * (size_t)N + 2u * nwords;
        size_t total = (body + 3u) & ~(size_t)3u;
        uint8_t *out = (uint8_t *)calloc(total, 1);
        if (!out) goto done;
        memcpy(out, side, side_bytes);
        for (int jj = 0; jj < N; jj++) put_u32(out + side_bytes + 4u * (size_t)jj, x[jj]);
        memcpy(out + side_bytes + 4u * (size_t)N, wp, 2u * nwords);
        lo->buf = out;
        lo->len = total;
        lo->rc = CG_OK;
    }
done:
    free(q); free(scales); free(S); free(part); free(mq); free(sq); free(cum); free(tab); free(words); free(side);
}

/* ------------------------------------------------------------------------ */
/* decoder                                                                   */
static int scale_ok(uint32_t b, int dtype) {
    if (dtype == CG_DTYPE_F32) return (b & 0x80000000u) == 0 && (b & 0x7F800000u) != 0x7F800000u;
    if (dtype == CG_DTYPE_BF16) return (b & 0x8000u) == 0 && (b & 0x7F80u) != 0x7F80u;
    return (b & 0x8000u) == 0 && (b & 0x7C00u) != 0x7C00u;
}

static int rice_block_get(cg_bitreader *br, uint32_t *v, size_t n, int w, uint32_t vmax) {
    uint32_t base = cg_br_bits(br, w);
    int k = (int)cg_br_bits(br, CG_W_K);
    if (br->err || k > w) return 0;
    for (size_t i = 0; i < n; i++) {
        v[i] = cg_rice_get(br, base, k, w);
        if (br->err || v[i] > vmax) return 0;
    }
    return 1;
}

#define FAIL(msg) do { snprintf(err, errlen, "%s", msg); rc = CG_ERR_CORRUPT; goto done; } while (0)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

/* ------------------------------------------------------------------------ */
/* symbol search tables                                                      */
/* Each stream (channel) has its cum table padded to S = 2^k >= nsym + 1
 * entries (entries past nsym hold 2^P), and a bucket table of 2^B 64-bit
 * entries over the 2^P slots, B = 6 (B = 7 for P = 15), so that a bucket spans
 * W = 2^(P-B) <= 256 slots. Bucket b's entry is
 *     sym | (rel - 1) << 8 | cum[sym] << 16 | cum[sym+1] << 32 | cum[sym+2] << 48
 * sym: the symbol holding the bucket's first slot b*W; rel = min(cum[sym+1] -
 * b*W, W): where the first boundary inside the bucket lies (W: there is none).
 * sym + ((slot & (W-1)) >= rel) is then the symbol of any slot of a bucket
 * holding at most one boundary, and the entry holds its cum pair (bits 16..47
 * or 32..63): one load, one compare, no search. Buckets with several
 * boundaries (the thin tails, ~1% of the symbols of real KV) are finished by
 * stepping up the cum row. */
typedef struct {
    uint32_t S;      /* cum row stride */
    int bbits;       /* B */
    uint16_t *cum;   /* C rows of S entries */
    uint64_t *bkt;   /* C rows of 2^B entries */
} dec_tables;

static int dec_bucket_bits(int P) { return P > 14 ? P - 8 : 6; }

/* 0 on out of memory; free with dec_tables_free */
static int dec_tables_alloc(dec_tables *tb, uint32_t C, int nsym, int P) {
    tb->S = 2;
    while (tb->S < (uint32_t)nsym + 1u) tb->S <<= 1;
    tb->bbits = dec_bucket_bits(P);
    /* +16 entries: pair, 8-byte and 32-byte loads at a row's last entries */
    tb->cum = (uint16_t *)malloc(((size_t)C * tb->S + 16u) * sizeof(uint16_t));
    tb->bkt = (uint64_t *)malloc(((size_t)C << tb->bbits) * sizeof(uint64_t));
    return tb->cum && tb->bkt;
}

static void dec_tables_free(dec_tables *tb) { free(tb->cum); free(tb->bkt); }

#ifdef CG_HAVE_AVX2_PATH
/* dec_tables_build's bucket entries, 4 per step (nb a multiple of 16): the same values; the running
 * maximum of `last` in-register, 16 buckets at a time */
__attribute__((target("avx2"))) static void dec_buckets_avx2(const uint16_t *cm, const uint8_t *last, uint32_t nb,
                                                             uint32_t W, uint64_t *bk) {
    const __m256i ffff = _mm256_set1_epi64x(0xFFFF), wv = _mm256_set1_epi64x(W), one = _mm256_set1_epi64x(1);
    const __m256i step = _mm256_set1_epi64x(4 * (long long)W);
    const __m128i b15 = _mm_set1_epi8(15);
    __m256i lo = _mm256_setr_epi64x(0, W, 2 * (long long)W, 3 * (long long)W);
    __m128i carry = _mm_setzero_si128();
    for (uint32_t b = 0; b < nb; b += 16) {
        __m128i m = _mm_loadu_si128((const __m128i *)(last + b));
        m = _mm_max_epu8(m, _mm_slli_si128(m, 1));
        m = _mm_max_epu8(m, _mm_slli_si128(m, 2));
        m = _mm_max_epu8(m, _mm_slli_si128(m, 4));
        m = _mm_max_epu8(m, _mm_slli_si128(m, 8));
        m = _mm_max_epu8(m, carry);
        carry = _mm_shuffle_epi8(m, b15);
        for (int i = 0; i < 4; i++, m = _mm_srli_si128(m, 4)) {
            const __m128i si = _mm_cvtepu8_epi32(m);
            const __m256i q = _mm256_i32gather_epi64((const long long *)cm, si, 2);   /* cum[s..s+3] */
            const __m256i end = _mm256_and_si256(_mm256_srli_epi64(q, 16), ffff);
            const __m256i rel = _mm256_min_epu32(_mm256_sub_epi64(end, lo), wv);
            const __m256i e = _mm256_or_si256(_mm256_or_si256(_mm256_slli_epi64(q, 16), _mm256_cvtepu32_epi64(si)),
                                              _mm256_slli_epi64(_mm256_sub_epi64(rel, one), 8));
            _mm256_storeu_si256((__m256i *)(bk + b + 4 * i), e);
            lo = _mm256_add_epi64(lo, step);
        }
    }
}
#endif

static void dec_tables_build(const dec_tables *tb, uint32_t C, int nsym, int P, const uint32_t *mq,
                             const uint32_t *sq) {
    const uint32_t nb = 1u << tb->bbits, W = 1u << (P - tb->bbits);
    for (uint32_t c = 0; c < C; c++) {
        uint16_t *cm = tb->cum + (size_t)c * tb->S;
        cg_build_cum(nsym, mq[c], sq[c], P, cm);
        for (uint32_t k = (uint32_t)nsym + 1u; k < tb->S; k++) cm[k] = (uint16_t)(1u << P);
    }
    memset(tb->cum + (size_t)C * tb->S, 0, 16u * sizeof(uint16_t));
    for (uint32_t c = 0; c < C; c++) {
        const uint16_t *cm = tb->cum + (size_t)c * tb->S;
        uint64_t *bk = tb->bkt + ((size_t)c << tb->bbits);
        /* the symbol of slot b*W is #{s >= 1: cum[s] <= b*W} = the largest s with ceil(cum[s]/W) <= b
         * (cum increases): the last s of each ceil(cum[s]/W), then a running maximum; no
         * data-dependent branch, no read-modify-write chain */
        uint8_t last[(1u << 7) + 1u] = {0};
        for (int k = 1; k < nsym; k++) last[((uint32_t)cm[k] + W - 1u) >> (P - tb->bbits)] = (uint8_t)k;
        uint32_t s = 0, b = 0;
#ifdef CG_HAVE_AVX2_PATH
        if (g_use_avx2) {
            b = nb;
            dec_buckets_avx2(cm, last, nb, W, bk);
        }
#endif
        for (; b < nb; b++) {
            s = last[b] > s ? last[b] : s;
            uint64_t q;   /* cum[s..s+3] (past the row, read but never used, when s is the last symbol) */
            memcpy(&q, cm + s, 8);
            const uint32_t end = (uint32_t)(q >> 16) & 0xFFFFu;
            const uint32_t rel = end - b * W < W ? end - b * W : W;
            bk[b] = q << 16 | s | (rel - 1u) << 8;
        }
    }
}

/* The symbol of `slot` in a stream (cm, bk: its rows); *pair = cum[s] | cum[s+1] << 16. */
static inline uint32_t dec_find(const uint16_t *cm, const uint64_t *bk, uint32_t slot, int bshift,
                                uint32_t wmask, uint32_t *pair) {
    const uint64_t e = bk[slot >> bshift];
    const uint32_t past = (slot & wmask) > ((uint32_t)e >> 8 & 0xFFu);
    uint32_t s = ((uint32_t)e & 0xFFu) + past;
    uint32_t pr = (uint32_t)(e >> (16u + 16u * past));
    while (UNLIKELY((pr >> 16) <= slot)) pr = get_u32((const uint8_t *)(cm + ++s));
    *pair = pr;
    return s;
}

/* Value of symbol s in a token of scale `scale`, stored in the KV dtype. */
static inline void dec_store(uint8_t *orow, uint32_t c, int dtype, const float *unit, uint32_t s, float scale) {
    const float v = cg_dequant(unit[s], scale);
    if (dtype == CG_DTYPE_BF16) ((uint16_t *)orow)[c] = cg_f32_to_bf16(v);
    else if (dtype == CG_DTYPE_F16) ((uint16_t *)orow)[c] = cg_f32_to_f16(v);
    else ((uint32_t *)orow)[c] = cg_bits_from_f32(v);
}

/* ------------------------------------------------------------------------ */
/* portable row decoder                                                      */
/* Decodes one token row of C symbols. FAST: at least 2*C word bytes remain, so
 * word reads need no bounds check (a symbol reads at most one word) and take no
 * branch. Values come from `vals`, the row's value of each symbol (es bytes
 * each). Returns 0 if the words run out. */
static inline __attribute__((always_inline)) int decode_row_generic(
    const dec_tables *tb, uint32_t *x, int N, uint32_t C, int P, int fast, size_t es, const void *vals,
    uint8_t *orow, const uint8_t **wpp, const uint8_t *wend) {
    const uint32_t mask = (1u << P) - 1u;
    const int bshift = P - tb->bbits;
    const uint32_t wmask = (1u << bshift) - 1u;
    const uint16_t *cm = tb->cum;
    const uint64_t *bk = tb->bkt;
    const uint8_t *wp = *wpp;
    uint32_t c = 0;
    while (c < C) {
        const uint32_t g = C - c < (uint32_t)N ? C - c : (uint32_t)N;
        for (uint32_t j = 0; j < g; j++, c++, cm += tb->S, bk += (size_t)1 << tb->bbits) {
            uint32_t xx = x[j], pr;
            const uint32_t slot = xx & mask;
            const uint32_t s = dec_find(cm, bk, slot, bshift, wmask, &pr);
            const uint32_t st = pr & 0xFFFFu;
            xx = ((pr >> 16) - st) * (xx >> P) + slot - st;
            if (fast) {
                const uint32_t t2 = (xx << 16) | get_u16(wp);
                const uint32_t need = xx < CG_RANS_L;
                xx ^= (xx ^ t2) & (0u - need);
                wp += need << 1;
            } else if (xx < CG_RANS_L) {
                if (wend - wp < 2) { *wpp = wp; return 0; }
                xx = cg_dec_push_word(xx, get_u16(wp));
                wp += 2;
            }
            x[j] = xx;
            if (es == 2) ((uint16_t *)orow)[c] = ((const uint16_t *)vals)[s];
            else ((uint32_t *)orow)[c] = ((const uint32_t *)vals)[s];
        }
    }
    *wpp = wp;
    return 1;
}

/* the default precision gets constant shifts; any other takes the generic one */
static int decode_row_scalar(const dec_tables *tb, uint32_t *x, int N, uint32_t C, int P, int fast, size_t es,
                             const void *vals, uint8_t *orow, const uint8_t **wpp, const uint8_t *wend) {
#define ROW(PP, F, E) decode_row_generic(tb, x, N, C, PP, F, E, vals, orow, wpp, wend)
    if (P == 14) {
        if (fast) return es == 2 ? ROW(14, 1, 2) : ROW(14, 1, 4);
        return es == 2 ? ROW(14, 0, 2) : ROW(14, 0, 4);
    }
    if (fast) return es == 2 ? ROW(P, 1, 2) : ROW(P, 1, 4);
    return es == 2 ? ROW(P, 0, 2) : ROW(P, 0, 4);
#undef ROW
}

/* ------------------------------------------------------------------------ */
/* AVX2 row decoder: 8 lanes per step. The 8 bucket entries are fetched by   */
/* scalar loads (cheaper than a 64-bit gather on Zen), turned into symbols   */
/* and cum pairs in-register. Symbols go to a row buffer; their values,      */
/* fp32 (s - M) / M * scale rounded to the KV dtype in-register (F16C's      */
/* vcvtps2ph for float16: IEEE round-to-nearest-even, subnormals included,   */
/* as cg_f32_to_f16), are computed once the row's states are done, off the   */
/* states' dependency chain. The shared word pointer advances by a prefix    */
/* count of the lanes that need a word (a permutation table indexed by the   */
/* 8-bit need mask). Same arithmetic, same bytes consumed, same output as    */
/* the portable loop.                                                         */
#ifdef CG_HAVE_AVX2_PATH

/* Loop-invariant vectors of a row's decode. */
typedef struct {
    __m256i mask, wmask, bkoff, ff, ffff, one;
    __m128i pcount, bcount;
} dec8_consts;

/* One step of eight lanes: returns the new states, writes the symbols to sp. */
__attribute__((target("avx2"))) static inline __m256i dec8_step(const dec8_consts *k, __m256i X,
                                                                const uint64_t *bkj, const uint16_t *cmr,
                                                                size_t S, uint32_t *sp, const uint8_t **wpp) {
    const __m256i slot = _mm256_and_si256(X, k->mask);
    const __m256i bi = _mm256_add_epi32(k->bkoff, _mm256_srl_epi32(slot, k->bcount));
    uint32_t ix[8] __attribute__((aligned(32)));
    _mm256_store_si256((__m256i *)ix, bi);
#define LQ(i) _mm_loadl_epi64((const __m128i *)(bkj + ix[i]))
    const __m128i q01 = _mm_unpacklo_epi64(LQ(0), LQ(1)), q23 = _mm_unpacklo_epi64(LQ(2), LQ(3));
    const __m128i q45 = _mm_unpacklo_epi64(LQ(4), LQ(5)), q67 = _mm_unpacklo_epi64(LQ(6), LQ(7));
#undef LQ
    const __m256 E0 = _mm256_castsi256_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(q01), q45, 1));
    const __m256 E1 = _mm256_castsi256_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(q23), q67, 1));
    const __m256i e = _mm256_castps_si256(_mm256_shuffle_ps(E0, E1, 0x88));   /* sym | rel-1 | cum[sym] */
    const __m256i h = _mm256_castps_si256(_mm256_shuffle_ps(E0, E1, 0xDD));   /* cum[sym+1] | cum[sym+2] */
    const __m256i past = _mm256_cmpgt_epi32(_mm256_and_si256(slot, k->wmask),
                                            _mm256_and_si256(_mm256_srli_epi32(e, 8), k->ff));
    __m256i s = _mm256_sub_epi32(_mm256_and_si256(e, k->ff), past);
    __m256i pr = _mm256_blendv_epi8(_mm256_or_si256(_mm256_srli_epi32(e, 16), _mm256_slli_epi32(h, 16)), h, past);
    const __m256i slot1 = _mm256_add_epi32(slot, k->one);
    __m256i more = _mm256_cmpgt_epi32(slot1, _mm256_srli_epi32(pr, 16));   /* cum[s+1] <= slot */
    if (UNLIKELY(!_mm256_testz_si256(more, more))) {
        /* buckets with several boundaries: each such lane searches its cum row, 16 entries a step,
         * for the first entry past the slot (cum[nsym] = 2^P ends every row) */
        uint32_t sv[8] __attribute__((aligned(32))), pv[8] __attribute__((aligned(32)));
        uint32_t lv[8] __attribute__((aligned(32)));
        _mm256_store_si256((__m256i *)sv, s);
        _mm256_store_si256((__m256i *)pv, pr);
        _mm256_store_si256((__m256i *)lv, slot);
        unsigned mm = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(more));
        do {
            const int l = __builtin_ctz(mm);
            const uint16_t *row = cmr + (size_t)l * S;
            const __m256i sl = _mm256_set1_epi16((short)lv[l]);
            uint32_t kk = sv[l] + 2u;   /* cum[s+1] <= slot: the symbol is past s */
            for (;;) {
                const __m256i a = _mm256_loadu_si256((const __m256i *)(row + kk));
                const unsigned le = (unsigned)_mm256_movemask_epi8(_mm256_cmpeq_epi16(_mm256_min_epu16(a, sl), a));
                if (le != 0xFFFFFFFFu) { kk += (unsigned)__builtin_ctz(~le) >> 1; break; }
                kk += 16u;
            }
            sv[l] = kk - 1u;
            pv[l] = get_u32((const uint8_t *)(row + kk - 1u));
            mm &= mm - 1u;
        } while (mm);
        s = _mm256_load_si256((const __m256i *)sv);
        pr = _mm256_load_si256((const __m256i *)pv);
    }
    _mm256_storeu_si256((__m256i *)sp, s);
    /* state update and renormalisation (reads the words at *wpp) */
    const __m256i st = _mm256_and_si256(pr, k->ffff);
    const __m256i fr = _mm256_sub_epi32(_mm256_srli_epi32(pr, 16), st);
    X = _mm256_add_epi32(_mm256_mullo_epi32(fr, _mm256_srl_epi32(X, k->pcount)), _mm256_sub_epi32(slot, st));
    const __m256i need = _mm256_cmpeq_epi32(_mm256_srli_epi32(X, 16), _mm256_setzero_si256());
    const int m = _mm256_movemask_ps(_mm256_castsi256_ps(need));
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)*wpp));
    w = _mm256_permutevar8x32_epi32(w, _mm256_loadu_si256((const __m256i *)g_perm[m]));
    *wpp += 2 * __builtin_popcount((unsigned)m);
    return _mm256_blendv_epi8(X, _mm256_or_si256(_mm256_slli_epi32(X, 16), w), need);
}

/* One token row (FAST mode only: at least 2*C word bytes remain): lanes in
 * blocks of 8 through dec8_step, lanes past the last multiple of 8 of a group
 * through the scalar step; then the row's values from the symbols in sbuf. */
__attribute__((target("avx2,f16c"))) static void decode_row_avx2(
    const dec_tables *tb, uint32_t *x, int N, uint32_t C, int P, int M, int dtype, const float *unit,
    float scale, uint8_t *orow, const uint8_t **wpp, uint32_t *sbuf) {
    const int bbits = tb->bbits, bshift = P - bbits;
    const uint32_t mask = (1u << P) - 1u, wmask = (1u << bshift) - 1u;
    dec8_consts k;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    k.mask = _mm256_set1_epi32((int)mask);
    k.wmask = _mm256_set1_epi32((int)wmask);
    k.pcount = _mm_cvtsi32_si128(P);
    k.bcount = _mm_cvtsi32_si128(bshift);
    k.bkoff = _mm256_sll_epi32(lane, _mm_cvtsi32_si128(bbits));
    k.ff = _mm256_set1_epi32(0xFF);
    k.ffff = _mm256_set1_epi32(0xFFFF);
    k.one = _mm256_set1_epi32(1);
    const uint8_t *wp = *wpp;
    for (uint32_t c = 0; c < C;) {
        const uint32_t g = C - c < (uint32_t)N ? C - c : (uint32_t)N;
        const uint32_t g8 = g & ~7u;
        uint32_t j = 0;
        for (; j < g8; j += 8) {
            const __m256i X = _mm256_loadu_si256((const __m256i *)(x + j));
            _mm256_storeu_si256((__m256i *)(x + j),
                                dec8_step(&k, X, tb->bkt + ((size_t)(c + j) << bbits),
                                          tb->cum + (size_t)(c + j) * tb->S, tb->S, sbuf + c + j, &wp));
        }
        for (; j < g; j++) {
            uint32_t xx = x[j], pr;
            const uint32_t slot = xx & mask;
            const uint32_t s = dec_find(tb->cum + (size_t)(c + j) * tb->S, tb->bkt + ((size_t)(c + j) << bbits),
                                        slot, bshift, wmask, &pr);
            const uint32_t st = pr & 0xFFFFu;
            xx = ((pr >> 16) - st) * (xx >> P) + slot - st;
            if (xx < CG_RANS_L) { xx = (xx << 16) | get_u16(wp); wp += 2; }
            x[j] = xx;
            sbuf[c + j] = s;
        }
        c += g;
    }
    *wpp = wp;
    /* value = fp32(fp32((s - M) / M) * scale), in the KV dtype */
    const __m256i mi = _mm256_set1_epi32(M), bias = _mm256_set1_epi32(0x7FFF);
    const __m256 mf = _mm256_set1_ps((float)M), sc = _mm256_set1_ps(scale);
    uint32_t c = 0;
    for (; c + 8 <= C; c += 8) {
        const __m256i s = _mm256_loadu_si256((const __m256i *)(sbuf + c));
        const __m256 v = _mm256_mul_ps(_mm256_div_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(s, mi)), mf), sc);
        if (dtype == CG_DTYPE_BF16) {
            __m256i u = _mm256_castps_si256(v);
            u = _mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), k.one)));
            u = _mm256_srli_epi32(u, 16);
            _mm_storeu_si128((__m128i *)(orow + 2 * c),
                             _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
        } else if (dtype == CG_DTYPE_F16) {
            _mm_storeu_si128((__m128i *)(orow + 2 * c), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        } else {
            _mm256_storeu_ps((float *)(orow + 4 * c), v);
        }
    }
    for (; c < C; c++) dec_store(orow, c, dtype, unit, sbuf[c], scale);
}
#endif

static int decode_layer(const uint8_t *sec, size_t seclen, int dtype, uint32_t T, uint32_t C,
                        int M, int P, int N, uint8_t *dst, char *err, size_t errlen) {
    const int nsym = 2 * M + 1;
    int rc = CG_ERR_NOMEM;
    dec_tables tb;
    uint32_t *scales = (uint32_t *)malloc((size_t)T * sizeof(uint32_t));
    uint32_t *mq = (uint32_t *)malloc((size_t)C * sizeof(uint32_t));
    uint32_t *sq = (uint32_t *)malloc((size_t)C * sizeof(uint32_t));
    uint32_t *sbuf = (uint32_t *)malloc((size_t)C * sizeof(uint32_t));
    const int tables_ok = dec_tables_alloc(&tb, C, nsym, P);
    snprintf(err, errlen, "out of memory");
    if (!scales || !mq || !sq || !sbuf || !tables_ok) goto done;

    cg_bitreader br = {sec, (uint64_t)seclen * 8u, 0, 0};
    const int ws = cg_wscale(dtype);
    if (!rice_block_get(&br, scales, T, ws, ws == 32 ? 0xFFFFFFFFu : 0xFFFFu)) FAIL("scale block is corrupt");
    for (uint32_t t = 0; t < T; t++)
        if (!scale_ok(scales[t], dtype)) FAIL("a scale is negative, infinite or NaN");
    if (!rice_block_get(&br, mq, C, CG_W_MU, 4u * (uint32_t)(nsym - 1))) FAIL("mean block is corrupt");
    if (!rice_block_get(&br, sq, C, CG_W_SIGMA, CG_NSIGMA - 1)) FAIL("sigma block is corrupt");
    {
        uint64_t padded = (br.pos + 31u) & ~(uint64_t)31u;
        if (padded > br.nbits) FAIL("side information overruns its section");
        uint32_t pad = cg_br_bits(&br, (int)(padded - br.pos));
        if (br.err || pad != 0) FAIL("nonzero padding after side information");
    }
    size_t side_bytes = (size_t)(br.pos / 8u);
    if (seclen - side_bytes < 4u * (size_t)N) FAIL("section too short for its rANS states");

    uint32_t x[CG_LANES_MAX];
    for (int j = 0; j < N; j++) {
        x[j] = get_u32(sec + side_bytes + 4u * (size_t)j);
        if (x[j] < CG_RANS_L) FAIL("rANS state below its lower bound");
    }
    const uint8_t *w0 = sec + side_bytes + 4u * (size_t)N;
    const uint8_t *wp = w0, *wend = sec + seclen;

    dec_tables_build(&tb, C, nsym, P, mq, sq);

    float unit[CG_NSYM_MAX];
    for (int s = 0; s < nsym; s++) unit[s] = cg_dequant_unit(s, M);
    const size_t es = cg_esize(dtype);
    uint16_t v16[CG_NSYM_MAX + 1];
    uint32_t v32[CG_NSYM_MAX + 1];
    for (uint32_t t = 0; t < T; t++) {
        const float scale = bits_to_f32(scales[t], dtype);
        const int fast = (size_t)(wend - wp) >= 2u * (size_t)C;
        uint8_t *orow = dst + (size_t)t * C * es;
#ifdef CG_HAVE_AVX2_PATH
        if (fast && g_use_avx2 && N >= 8) {
            decode_row_avx2(&tb, x, N, C, P, M, dtype, unit, scale, orow, &wp, sbuf);
            continue;
        }
#endif
        /* the row's value of each symbol */
        for (int s = 0; s < nsym; s++) {
            const float v = cg_dequant(unit[s], scale);
            if (dtype == CG_DTYPE_F32) v32[s] = cg_bits_from_f32(v);
            else v16[s] = dtype == CG_DTYPE_BF16 ? cg_f32_to_bf16(v) : cg_f32_to_f16(v);
        }
        if (!decode_row_scalar(&tb, x, N, C, P, fast, es, es == 2 ? (const void *)v16 : (const void *)v32, orow,
                               &wp, wend))
            FAIL("rANS stream ends early");
    }
    for (int j = 0; j < N; j++)
        if (x[j] != CG_RANS_L) FAIL("rANS stream does not end in its initial state");
    {
        size_t used = (size_t)(wp - w0);
        size_t want_pad = (used & 2u) ? 2u : 0u;
        if ((size_t)(wend - wp) != want_pad) FAIL("rANS stream has trailing bytes");
        for (size_t i = 0; i < want_pad; i++)
            if (wp[i] != 0) FAIL("nonzero section padding");
    }
    rc = CG_OK;
done:
    free(scales); free(mq); free(sq); free(sbuf);
    dec_tables_free(&tb);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* threads                                                                    */
typedef struct {
    const cg_chunk *ck;
    const uint8_t *src;      /* encode input / decode payload */
    uint8_t *dst;            /* decode output */
    layer_out *outs;         /* encode */
    const size_t *offs;      /* decode: section offsets */
    const size_t *lens;      /* decode: section lengths */
    int P, N;
    int next;                /* next layer to take (atomic) */
    int failed;              /* first failure (atomic flag) */
    int fail_rc;
    uint32_t fail_layer;
    char fail_msg[160];
    pthread_mutex_t mu;
} job;

static int take(job *jb) { return __atomic_fetch_add(&jb->next, 1, __ATOMIC_RELAXED); }

static void *encode_worker(void *arg) {
    job *jb = (job *)arg;
    const cg_chunk *ck = jb->ck;
    const size_t es = cg_esize(ck->dtype);
    const size_t lstride = (size_t)ck->tokens * ck->channels * es;
    for (int l; (l = take(jb)) < (int)ck->layers;) {
        if (__atomic_load_n(&jb->failed, __ATOMIC_RELAXED)) break;
        encode_layer(jb->src + (size_t)l * lstride, ck->dtype, ck->tokens, ck->channels,
                     cg_half_range(ck->bins[l]), jb->P, jb->N, &jb->outs[l]);
        if (jb->outs[l].rc != CG_OK) __atomic_store_n(&jb->failed, 1, __ATOMIC_RELAXED);
    }
    return NULL;
}

static void *decode_worker(void *arg) {
    job *jb = (job *)arg;
    const cg_chunk *ck = jb->ck;
    const size_t es = cg_esize(ck->dtype);
    const size_t lstride = (size_t)ck->tokens * ck->channels * es;
    char msg[128];
    for (int l; (l = take(jb)) < (int)ck->layers;) {
        if (__atomic_load_n(&jb->failed, __ATOMIC_RELAXED)) break;
        int rc = decode_layer(jb->src + jb->offs[l], jb->lens[l], ck->dtype, ck->tokens, ck->channels,
                              cg_half_range(ck->bins[l]), jb->P, jb->N, jb->dst + (size_t)l * lstride,
                              msg, sizeof msg);
        if (rc != CG_OK) {
            pthread_mutex_lock(&jb->mu);
            if (!jb->failed || (uint32_t)l < jb->fail_layer) {
                jb->fail_rc = rc;
                jb->fail_layer = (uint32_t)l;
                snprintf(jb->fail_msg, sizeof jb->fail_msg, "layer %d: %s", l, msg);
            }
            __atomic_store_n(&jb->failed, 1, __ATOMIC_RELAXED);
            pthread_mutex_unlock(&jb->mu);
        }
    }
    return NULL;
}

static void run_threads(job *jb, int threads, void *(*fn)(void *)) {
    if (threads < 1) threads = 1;
    if (threads > (int)jb->ck->layers) threads = (int)jb->ck->layers;
    if (threads > 256) threads = 256;
    pthread_t tid[256];
    int started = 0;
    for (int i = 1; i < threads; i++) {
        if (pthread_create(&tid[started], NULL, fn, jb) != 0) break;
        started++;
    }
    fn(jb);
    for (int i = 0; i < started; i++) pthread_join(tid[i], NULL);
}

static int check_chunk(const cg_chunk *ck, char *err, size_t errlen) {
    if (ck->dtype < CG_DTYPE_BF16 || ck->dtype > CG_DTYPE_F32) { snprintf(err, errlen, "bad dtype code"); return 0; }
    if (ck->layers < 1 || ck->tokens < 1 || ck->channels < 1 || ck->layers > 65535u) {
        snprintf(err, errlen, "bad chunk shape"); return 0;
    }
    if (ck->tokens >= CG_MAX_TOKENS || (uint64_t)ck->tokens * ck->channels > (1ull << 30)) {
        snprintf(err, errlen, "chunk too large for one CacheGen section (tokens < 2^24, tokens*channels <= 2^30)");
        return 0;
    }
    for (uint32_t l = 0; l < ck->layers; l++)
        if (ck->bins[l] < CG_BINS_MIN || ck->bins[l] > CG_BINS_MAX) { snprintf(err, errlen, "bins out of range"); return 0; }
    return 1;
}

int cg_encode_chunk(const void *kv, const cg_chunk *ck, int threads, uint8_t **out, size_t *out_len,
                    char *err, size_t errlen) {
    *out = NULL;
    *out_len = 0;
    CG_INIT_SIMD();
    if (!check_chunk(ck, err, errlen)) return CG_ERR_PARAM;
    if (ck->prob_bits < CG_PROB_BITS_MIN || ck->prob_bits > CG_PROB_BITS_MAX || ck->lanes < 1 ||
        ck->lanes > CG_LANES_MAX) {
        snprintf(err, errlen, "prob_bits or lanes out of range");
        return CG_ERR_PARAM;
    }
    const int N = ck->lanes < (int)ck->channels ? ck->lanes : (int)ck->channels;
    job jb;
    memset(&jb, 0, sizeof jb);
    jb.ck = ck;
    jb.src = (const uint8_t *)kv;
    jb.P = ck->prob_bits;
    jb.N = N;
    jb.outs = (layer_out *)calloc(ck->layers, sizeof(layer_out));
    if (!jb.outs) { snprintf(err, errlen, "out of memory"); return CG_ERR_NOMEM; }
    for (uint32_t l = 0; l < ck->layers; l++) jb.outs[l].rc = -1; /* not run */
    pthread_mutex_init(&jb.mu, NULL);
    run_threads(&jb, threads, encode_worker);
    pthread_mutex_destroy(&jb.mu);

    int rc = CG_OK;
    size_t total = header_size(ck->layers);
    for (uint32_t l = 0; l < ck->layers; l++) {
        if (jb.outs[l].rc == CG_ERR_NONFINITE) { rc = CG_ERR_NONFINITE; break; }
    }
    if (rc == CG_OK)
        for (uint32_t l = 0; l < ck->layers; l++)
            if (jb.outs[l].rc != CG_OK) { rc = CG_ERR_NOMEM; break; }
    if (rc == CG_OK) {
        for (uint32_t l = 0; l < ck->layers; l++) {
            if (jb.outs[l].len > 0xFFFFFFFFu) { rc = CG_ERR_PARAM; break; }
            total += jb.outs[l].len;
        }
    }
    uint8_t *buf = rc == CG_OK ? (uint8_t *)calloc(total, 1) : NULL;
    if (rc == CG_OK && !buf) rc = CG_ERR_NOMEM;
    if (rc == CG_OK) {
        buf[0] = CG_MAGIC0;
        buf[1] = CG_MAGIC1;
        buf[2] = CG_FORMAT_VERSION;
        buf[3] = (uint8_t)ck->dtype;
        buf[4] = (uint8_t)ck->prob_bits;
        buf[5] = (uint8_t)N;
        put_u32(buf + 8, ck->layers);
        put_u32(buf + 12, ck->tokens);
        put_u32(buf + 16, ck->channels);
        for (uint32_t l = 0; l < ck->layers; l++) buf[CG_HEADER_FIXED + l] = (uint8_t)cg_half_range(ck->bins[l]);
        size_t dir = CG_HEADER_FIXED + (((size_t)ck->layers + 3u) & ~(size_t)3u);
        size_t pos = header_size(ck->layers);
        for (uint32_t l = 0; l < ck->layers; l++) {
            put_u32(buf + dir + 4u * l, (uint32_t)jb.outs[l].len);
            memcpy(buf + pos, jb.outs[l].buf, jb.outs[l].len);
            pos += jb.outs[l].len;
        }
        *out = buf;
        *out_len = total;
    }
    if (rc == CG_ERR_NONFINITE) snprintf(err, errlen, "input holds NaN or infinity");
    else if (rc == CG_ERR_NOMEM) snprintf(err, errlen, "out of memory");
    else if (rc == CG_ERR_PARAM) snprintf(err, errlen, "layer section over 4 GiB");
    for (uint32_t l = 0; l < ck->layers; l++) free(jb.outs[l].buf);
    free(jb.outs);
    return rc;
}

int cg_decode_chunk(const uint8_t *p, size_t len, cg_chunk *ck, void *out, int threads, char *err,
                    size_t errlen) {
    CG_INIT_SIMD();
    if (!check_chunk(ck, err, errlen)) return CG_ERR_PARAM;
    if (len < CG_HEADER_FIXED) { snprintf(err, errlen, "payload shorter than its header"); return CG_ERR_CORRUPT; }
    if (p[0] != CG_MAGIC0 || p[1] != CG_MAGIC1) { snprintf(err, errlen, "bad magic"); return CG_ERR_CORRUPT; }
    if (p[2] != CG_FORMAT_VERSION) { snprintf(err, errlen, "unknown bitstream version %u", p[2]); return CG_ERR_CORRUPT; }
    if (p[3] != (uint8_t)ck->dtype) { snprintf(err, errlen, "payload dtype differs from the declared dtype"); return CG_ERR_CORRUPT; }
    int P = p[4], N = p[5];
    if (P < CG_PROB_BITS_MIN || P > CG_PROB_BITS_MAX) { snprintf(err, errlen, "prob_bits out of range"); return CG_ERR_CORRUPT; }
    if (N < 1 || N > CG_LANES_MAX || (uint32_t)N > ck->channels) { snprintf(err, errlen, "lane count out of range"); return CG_ERR_CORRUPT; }
    if (p[6] != 0 || p[7] != 0) { snprintf(err, errlen, "reserved header bytes are nonzero"); return CG_ERR_CORRUPT; }
    if (get_u32(p + 8) != ck->layers || get_u32(p + 12) != ck->tokens || get_u32(p + 16) != ck->channels) {
        snprintf(err, errlen, "payload shape differs from the declared shape");
        return CG_ERR_CORRUPT;
    }
    size_t hs = header_size(ck->layers);
    if (len < hs) { snprintf(err, errlen, "payload shorter than its header"); return CG_ERR_CORRUPT; }
    for (uint32_t l = 0; l < ck->layers; l++)
        if (p[CG_HEADER_FIXED + l] != (uint8_t)cg_half_range(ck->bins[l])) {
            snprintf(err, errlen, "layer %u: payload bins differ from the codec parameters", l);
            return CG_ERR_CORRUPT;
        }
    for (size_t i = CG_HEADER_FIXED + ck->layers; i < CG_HEADER_FIXED + ((ck->layers + 3u) & ~3u); i++)
        if (p[i] != 0) { snprintf(err, errlen, "nonzero header padding"); return CG_ERR_CORRUPT; }
    size_t *offs = (size_t *)malloc(2u * ck->layers * sizeof(size_t));
    if (!offs) { snprintf(err, errlen, "out of memory"); return CG_ERR_NOMEM; }
    size_t *lens = offs + ck->layers;
    size_t dir = CG_HEADER_FIXED + (((size_t)ck->layers + 3u) & ~(size_t)3u);
    uint64_t pos = hs;
    for (uint32_t l = 0; l < ck->layers; l++) {
        uint32_t sl = get_u32(p + dir + 4u * l);
        if (sl < 4u || (sl & 3u)) { free(offs); snprintf(err, errlen, "layer %u: bad section length", l); return CG_ERR_CORRUPT; }
        offs[l] = (size_t)pos;
        lens[l] = sl;
        pos += sl;
        if (pos > len) { free(offs); snprintf(err, errlen, "layer %u: section runs past the payload", l); return CG_ERR_CORRUPT; }
    }
    if (pos != len) { free(offs); snprintf(err, errlen, "payload has trailing bytes"); return CG_ERR_CORRUPT; }
    ck->prob_bits = P;
    ck->lanes = N;
    job jb;
    memset(&jb, 0, sizeof jb);
    jb.ck = ck;
    jb.src = p;
    jb.dst = (uint8_t *)out;
    jb.offs = offs;
    jb.lens = lens;
    jb.P = P;
    jb.N = N;
    pthread_mutex_init(&jb.mu, NULL);
    run_threads(&jb, threads, decode_worker);
    pthread_mutex_destroy(&jb.mu);
    free(offs);
    if (jb.failed) {
        snprintf(err, errlen, "%s", jb.fail_msg);
        return jb.fail_rc;
    }
    return CG_OK;
}
