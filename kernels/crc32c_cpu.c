/* CRC-32C while copying: see crc32c_cpu.h. */
#include "crc32c_cpu.h"

#include <pthread.h>
#include <string.h>

#if defined(__x86_64__) /* the 64-bit crc32 and movq intrinsics: x86-64 only */
#include <immintrin.h>
#define CRC32C_X86 1
#endif

#define POLY 0x82F63B78u /* reflected Castagnoli polynomial */

/* ---- the portable path: slicing-by-8 ------------------------------------------------------ */

static uint32_t table[8][256];

static void build_table(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int t = 1; t < 8; t++) table[t][n] = (table[t - 1][n] >> 8) ^ table[0][table[t - 1][n] & 0xFF];
}

static uint32_t soft_word(uint32_t s, uint64_t v) { /* 8 little-endian bytes */
    v ^= s;
    return table[7][v & 0xFF] ^ table[6][(v >> 8) & 0xFF] ^ table[5][(v >> 16) & 0xFF] ^
           table[4][(v >> 24) & 0xFF] ^ table[3][(v >> 32) & 0xFF] ^ table[2][(v >> 40) & 0xFF] ^
           table[1][(v >> 48) & 0xFF] ^ table[0][v >> 56];
}

static uint32_t soft_byte(uint32_t s, uint8_t b) { return (s >> 8) ^ table[0][(s ^ b) & 0xFF]; }

static uint32_t soft_copy(uint32_t s, uint8_t *dst, const uint8_t *src, size_t len) {
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t v;
        memcpy(&v, src + i, 8); /* one load: the value checked is the value stored */
        s = soft_word(s, v);
        if (dst) memcpy(dst + i, &v, 8);
    }
    for (; i < len; i++) {
        uint8_t b = src[i];
        s = soft_byte(s, b);
        if (dst) dst[i] = b;
    }
    return s;
}

/* ---- the hardware path: SSE4.2's crc32 instruction ----------------------------------------- */

#ifdef CRC32C_X86
/* Stores of a copy: plain, or non-temporal (movnti) when asked and `dst` allows it. A large
 * load writes far more than the caches hold; non-temporal stores skip reading each destination
 * line before overwriting it (a third of the memory traffic of a copy). */
#define STORE64(p, v, nt)                                                                         \
    do {                                                                                          \
        if (nt) _mm_stream_si64((long long *)(p), (long long)(v));                                \
        else memcpy((p), &(v), 8);                                                                \
    } while (0)

__attribute__((target("sse4.2"))) static uint32_t hard_copy(uint32_t s, uint8_t *dst, const uint8_t *src,
                                                             size_t len, int nt) {
    uint64_t c = s;
    size_t i = 0;
    nt = nt && dst && ((uintptr_t)dst & 7) == 0;
    for (; i + 32 <= len; i += 32) { /* four words per turn: the loads and stores overlap the crc chain */
        uint64_t a, b, d, e;
        memcpy(&a, src + i, 8);
        memcpy(&b, src + i + 8, 8);
        memcpy(&d, src + i + 16, 8);
        memcpy(&e, src + i + 24, 8);
        c = _mm_crc32_u64(c, a);
        c = _mm_crc32_u64(c, b);
        c = _mm_crc32_u64(c, d);
        c = _mm_crc32_u64(c, e);
        if (dst) {
            STORE64(dst + i, a, nt);
            STORE64(dst + i + 8, b, nt);
            STORE64(dst + i + 16, d, nt);
            STORE64(dst + i + 24, e, nt);
        }
    }
    for (; i + 8 <= len; i += 8) {
        uint64_t v;
        memcpy(&v, src + i, 8);
        c = _mm_crc32_u64(c, v);
        if (dst) STORE64(dst + i, v, nt);
    }
    uint32_t c32 = (uint32_t)c;
    for (; i < len; i++) {
        uint8_t b = src[i];
        c32 = _mm_crc32_u8(c32, b);
        if (dst) dst[i] = b;
    }
    return c32;
}

/* ---- the folding path: PCLMULQDQ --------------------------------------------------------- */
/* Four 128-bit lanes fold the message 64 bytes at a time (the carry-less-multiply method of
 * Gopal et al., "Fast CRC computation for generic polynomials using PCLMULQDQ", Intel 2009):
 * lane A, D bits before the next 16 bytes B, becomes A.lo * (x^(D+63) mod P) ^ A.hi *
 * (x^(D-1) mod P) ^ B, which keeps the residue mod P. Bit k of a lane (little-endian) is the
 * coefficient of x^(127-k); a reflected 32-bit constant shifted up by 32 multiplies in that
 * frame one degree short, hence D+63 and D-1 rather than D+64 and D. The four lanes are folded
 * into one at the end and its 16 bytes, run through the crc32 instruction from a zero register,
 * give the register after the whole message: the loads are 16 bytes wide and the 1-cycle-per-8-
 * bytes latency chain of the crc32 instruction is gone. The constants are computed at start-up
 * (x_pow below) and the result is tested against the table path on every length. */

static uint64_t fold_1024[2], fold_512[2], fold_128[2]; /* {x^(D+63), x^(D-1)} mod P, << 32 */

__attribute__((target("sse4.2,pclmul"))) static inline __m128i fold_lane(__m128i a, __m128i k) {
    return _mm_xor_si128(_mm_clmulepi64_si128(a, k, 0x00), _mm_clmulepi64_si128(a, k, 0x11));
}

#define FOLD_PREFETCH 512 /* bytes ahead: measured best of 256-2048 on the bench machine */

__attribute__((target("sse4.2,pclmul"))) static void fold_copy(crc32c_stream *f, uint8_t *dst, const uint8_t *src,
                                                                size_t len, int nt) {
    const __m128i k = _mm_loadu_si128((const __m128i *)fold_512);
    __m128i x0, x1, x2, x3;
    size_t i = 0;
    nt = nt && dst && ((uintptr_t)dst & 15) == 0;
    const int w = f->value_width;
    const __m128i vm = _mm_set1_epi32((int)f->value_mask), vl = _mm_set1_epi32((int)f->value_low);
    __m128i fl = _mm_loadu_si128((const __m128i *)f->flags);
#define FLAG128(y) (fl = _mm_or_si128(fl, w == 2 ? _mm_add_epi16(_mm_and_si128((y), vm), vl) \
                                                  : _mm_add_epi32(_mm_and_si128((y), vm), vl)))
    if (!f->folding) {
        x0 = _mm_loadu_si128((const __m128i *)src);
        x1 = _mm_loadu_si128((const __m128i *)(src + 16));
        x2 = _mm_loadu_si128((const __m128i *)(src + 32));
        x3 = _mm_loadu_si128((const __m128i *)(src + 48));
        if (w) FLAG128(x0), FLAG128(x1), FLAG128(x2), FLAG128(x3);
        if (dst) {
            _mm_storeu_si128((__m128i *)dst, x0);
            _mm_storeu_si128((__m128i *)(dst + 16), x1);
            _mm_storeu_si128((__m128i *)(dst + 32), x2);
            _mm_storeu_si128((__m128i *)(dst + 48), x3);
        }
        x0 = _mm_xor_si128(x0, _mm_cvtsi32_si128((int)f->state)); /* the register enters as data */
        f->folding = 1;
        i = 64;
    } else {
        x0 = _mm_loadu_si128((const __m128i *)f->lanes);
        x1 = _mm_loadu_si128((const __m128i *)(f->lanes + 2));
        x2 = _mm_loadu_si128((const __m128i *)(f->lanes + 4));
        x3 = _mm_loadu_si128((const __m128i *)(f->lanes + 6));
    }
    for (; i < len; i += 64) {
        __builtin_prefetch((const void *)((uintptr_t)src + i + FOLD_PREFETCH)); /* never faults, even past the end */
        __m128i y0 = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i y1 = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i y2 = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i y3 = _mm_loadu_si128((const __m128i *)(src + i + 48));
        if (w) FLAG128(y0), FLAG128(y1), FLAG128(y2), FLAG128(y3);
        if (nt) {
            _mm_stream_si128((__m128i *)(dst + i), y0);
            _mm_stream_si128((__m128i *)(dst + i + 16), y1);
            _mm_stream_si128((__m128i *)(dst + i + 32), y2);
            _mm_stream_si128((__m128i *)(dst + i + 48), y3);
        } else if (dst) {
            _mm_storeu_si128((__m128i *)(dst + i), y0);
            _mm_storeu_si128((__m128i *)(dst + i + 16), y1);
            _mm_storeu_si128((__m128i *)(dst + i + 32), y2);
            _mm_storeu_si128((__m128i *)(dst + i + 48), y3);
        }
        x0 = _mm_xor_si128(fold_lane(x0, k), y0);
        x1 = _mm_xor_si128(fold_lane(x1, k), y1);
        x2 = _mm_xor_si128(fold_lane(x2, k), y2);
        x3 = _mm_xor_si128(fold_lane(x3, k), y3);
    }
    _mm_storeu_si128((__m128i *)f->lanes, x0);
    _mm_storeu_si128((__m128i *)(f->lanes + 2), x1);
    _mm_storeu_si128((__m128i *)(f->lanes + 4), x2);
    _mm_storeu_si128((__m128i *)(f->lanes + 6), x3);
    _mm_storeu_si128((__m128i *)f->flags, fl);
#undef FLAG128
}

/* The same fold with VPCLMULQDQ on 256-bit registers: lanes A and B in one register, C and D in
 * another, so a 64-byte step takes 4 carry-less multiplies instead of 8 (the 128-bit ones issue
 * one every other cycle on some cores, which held the fold to ~16 GB/s per core, below a copy).
 * The lanes, constants and state are those of fold_copy, so the two mix freely in one stream. */
__attribute__((target("avx2,pclmul,vpclmulqdq"))) static void fold_copy_wide(crc32c_stream *f, uint8_t *dst,
                                                                              const uint8_t *src, size_t len, int nt) {
    if (!f->folding) { /* the first 64 bytes set the lanes up as fold_copy does */
        fold_copy(f, dst, src, 64, nt);
        src += 64, len -= 64;
        if (dst) dst += 64;
    }
    const __m256i k = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)fold_512));
    __m256i ab = _mm256_loadu_si256((const __m256i *)f->lanes), cd = _mm256_loadu_si256((const __m256i *)(f->lanes + 4));
    const int w = f->value_width;
    const __m256i vm = _mm256_set1_epi32((int)f->value_mask), vl = _mm256_set1_epi32((int)f->value_low);
    __m256i fl = _mm256_loadu_si256((const __m256i *)f->flags);
    /* non-temporal stores 16 bytes wide: 32-byte ones measured 2x slower (13 vs 26 GB/s, Zen 4) */
    int nt16 = nt && dst && ((uintptr_t)dst & 15) == 0;
#define WIDE_STEP(Y0, Y1, AT)                                                                             \
    do {                                                                                                  \
        if (w == 2)                                                                                       \
            fl = _mm256_or_si256(fl, _mm256_or_si256(_mm256_add_epi16(_mm256_and_si256(Y0, vm), vl),      \
                                                     _mm256_add_epi16(_mm256_and_si256(Y1, vm), vl)));    \
        else if (w == 4)                                                                                  \
            fl = _mm256_or_si256(fl, _mm256_or_si256(_mm256_add_epi32(_mm256_and_si256(Y0, vm), vl),      \
                                                     _mm256_add_epi32(_mm256_and_si256(Y1, vm), vl)));    \
        if (nt16) {                                                                                       \
            _mm_stream_si128((__m128i *)(dst + (AT)), _mm256_castsi256_si128(Y0));                        \
            _mm_stream_si128((__m128i *)(dst + (AT) + 16), _mm256_extracti128_si256(Y0, 1));              \
            _mm_stream_si128((__m128i *)(dst + (AT) + 32), _mm256_castsi256_si128(Y1));                   \
            _mm_stream_si128((__m128i *)(dst + (AT) + 48), _mm256_extracti128_si256(Y1, 1));              \
        } else if (dst) {                                                                                 \
            _mm256_storeu_si256((__m256i *)(dst + (AT)), Y0);                                             \
            _mm256_storeu_si256((__m256i *)(dst + (AT) + 32), Y1);                                        \
        }                                                                                                 \
    } while (0)
#define FOLD256(X, K) _mm256_xor_si256(_mm256_clmulepi64_epi128(X, K, 0x00), _mm256_clmulepi64_epi128(X, K, 0x11))
    size_t i = 0;
    if (len >= 256) {
        /* Eight lanes (four registers) over 128 bytes a step: the fold's chain of dependent
         * multiplies (~9 cycles a step on the bench host, whatever the step's width) then
         * carries twice the bytes, and the fold keeps up with a copy from memory on one core
         * (17 -> ~30 GB/s in L2, where the values check and stores ride on it). The first 64
         * bytes fold into the four lanes as below, the next 64 start the other four; at the
         * end, lanes 0-3 are carried 64 bytes on (the 512-bit fold) onto lanes 4-7: the four
         * lanes the stream keeps. */
        const __m256i k8 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)fold_1024));
        __m256i y0 = _mm256_loadu_si256((const __m256i *)src), y1 = _mm256_loadu_si256((const __m256i *)(src + 32));
        __m256i ef = _mm256_loadu_si256((const __m256i *)(src + 64)), gh = _mm256_loadu_si256((const __m256i *)(src + 96));
        WIDE_STEP(y0, y1, 0);
        WIDE_STEP(ef, gh, 64);
        ab = _mm256_xor_si256(FOLD256(ab, k), y0);
        cd = _mm256_xor_si256(FOLD256(cd, k), y1);
        for (i = 128; i + 128 <= len; i += 128) {
            __builtin_prefetch((const void *)((uintptr_t)src + i + FOLD_PREFETCH));
            __builtin_prefetch((const void *)((uintptr_t)src + i + 64 + FOLD_PREFETCH));
            __m256i z0 = _mm256_loadu_si256((const __m256i *)(src + i)), z1 = _mm256_loadu_si256((const __m256i *)(src + i + 32));
            __m256i z2 = _mm256_loadu_si256((const __m256i *)(src + i + 64)), z3 = _mm256_loadu_si256((const __m256i *)(src + i + 96));
            WIDE_STEP(z0, z1, i);
            WIDE_STEP(z2, z3, i + 64);
            ab = _mm256_xor_si256(FOLD256(ab, k8), z0);
            cd = _mm256_xor_si256(FOLD256(cd, k8), z1);
            ef = _mm256_xor_si256(FOLD256(ef, k8), z2);
            gh = _mm256_xor_si256(FOLD256(gh, k8), z3);
        }
        ab = _mm256_xor_si256(FOLD256(ab, k), ef);
        cd = _mm256_xor_si256(FOLD256(cd, k), gh);
    }
    for (; i < len; i += 64) {
        __builtin_prefetch((const void *)((uintptr_t)src + i + FOLD_PREFETCH)); /* never faults, even past the end */
        __m256i y0 = _mm256_loadu_si256((const __m256i *)(src + i)), y1 = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        WIDE_STEP(y0, y1, i);
        ab = _mm256_xor_si256(FOLD256(ab, k), y0);
        cd = _mm256_xor_si256(FOLD256(cd, k), y1);
    }
#undef WIDE_STEP
#undef FOLD256
    _mm256_storeu_si256((__m256i *)f->lanes, ab);
    _mm256_storeu_si256((__m256i *)(f->lanes + 4), cd);
    _mm256_storeu_si256((__m256i *)f->flags, fl);
}

__attribute__((target("sse4.2,pclmul"))) static uint32_t fold_end(const crc32c_stream *f) {
    const __m128i k = _mm_loadu_si128((const __m128i *)fold_128);
    __m128i x = _mm_loadu_si128((const __m128i *)f->lanes);
    for (int lane = 1; lane < 4; lane++)
        x = _mm_xor_si128(fold_lane(x, k), _mm_loadu_si128((const __m128i *)(f->lanes + 2 * lane)));
    uint64_t lo = (uint64_t)_mm_cvtsi128_si64(x), hi = (uint64_t)_mm_cvtsi128_si64(_mm_unpackhi_epi64(x, x));
    return (uint32_t)_mm_crc32_u64(_mm_crc32_u64(0, lo), hi);
}
#endif

/* ---- the stream: the best path for each piece ------------------------------------------------ */

static int level = -1; /* a CRC32C_ path (crc32c_cpu.h); -1: not chosen yet */

/* The level in effect, chosen on first use. Read atomically: tests change it while other
 * threads checksum (a stream copes with a change between pieces: a fold in progress ends). */
static int current_level(void) {
    int l = __atomic_load_n(&level, __ATOMIC_ACQUIRE);
    return l >= 0 ? l : crc32c_init(CRC32C_FOLD_WIDE);
}

void crc32c_stream_begin(crc32c_stream *f, crc32c_state s) {
    current_level();
    f->state = s;
    f->folding = 0;
    crc32c_stream_values(f, 0);
}

void crc32c_stream_values(crc32c_stream *f, int kind) {
    f->flags[0] = f->flags[1] = f->flags[2] = f->flags[3] = 0;
    f->value_width = kind == 1 || kind == 2 ? 2 : kind == 3 ? 4 : 0;
    /* the 16-bit mask and its lowest bit repeated in both halves of a 32-bit word (SIMD lanes) */
    uint32_t m = kind == 1 ? 0x7F80u : kind == 2 ? 0x7C00u : 0x7F800000u;
    uint32_t l = kind == 1 ? 0x0080u : kind == 2 ? 0x0400u : 0x00800000u;
    f->value_mask = f->value_width == 2 ? m | m << 16 : m;
    f->value_low = f->value_width == 2 ? l | l << 16 : l;
}

/* The scalar form, for pieces the folding loops do not take. */
static void flag_values(crc32c_stream *f, const uint8_t *src, size_t len) {
    uint64_t fl = 0;
    if (f->value_width == 2) {
        uint16_t m = (uint16_t)f->value_mask, l = (uint16_t)f->value_low, acc = 0;
        for (size_t i = 0; i + 2 <= len; i += 2) {
            uint16_t v;
            memcpy(&v, src + i, 2);
            acc |= (uint16_t)((v & m) + l);
        }
        fl = acc;
    } else if (f->value_width == 4) {
        uint32_t acc = 0;
        for (size_t i = 0; i + 4 <= len; i += 4) {
            uint32_t v;
            memcpy(&v, src + i, 4);
            acc |= (v & f->value_mask) + f->value_low;
        }
        fl = acc;
    }
    f->flags[0] |= fl;
}

int crc32c_stream_nonfinite(const crc32c_stream *f) {
    uint64_t top = f->value_width == 2 ? 0x8000800080008000ull : f->value_width == 4 ? 0x8000000080000000ull : 0;
    return ((f->flags[0] | f->flags[1] | f->flags[2] | f->flags[3]) & top) != 0;
}

void crc32c_stream_copy(crc32c_stream *f, void *dst, const void *src, size_t len, int nontemporal) {
    int lv = current_level();
#ifdef CRC32C_X86
    /* Pieces of whole 64-byte units fold, and the fold runs on across them (a scatter's rows of
     * 128 bytes and up); any other piece ends the fold and takes the crc32 instruction. */
    if (lv >= CRC32C_FOLD_WIDE && len && len % 64 == 0) {
        fold_copy_wide(f, (uint8_t *)dst, (const uint8_t *)src, len, nontemporal);
        return;
    }
    if (lv >= CRC32C_FOLD && len && len % 64 == 0) {
        fold_copy(f, (uint8_t *)dst, (const uint8_t *)src, len, nontemporal);
        return;
    }
    if (f->folding) f->state = fold_end(f), f->folding = 0;
    if (f->value_width) flag_values(f, (const uint8_t *)src, len);
    if (lv >= CRC32C_INSTRUCTION) {
        f->state = hard_copy(f->state, (uint8_t *)dst, (const uint8_t *)src, len, nontemporal);
        return;
    }
#else
    if (f->value_width) flag_values(f, (const uint8_t *)src, len);
#endif
    (void)lv, (void)nontemporal;
    f->state = soft_copy(f->state, (uint8_t *)dst, (const uint8_t *)src, len);
}

crc32c_state crc32c_stream_end(crc32c_stream *f) {
#ifdef CRC32C_X86
    if (f->folding) f->state = fold_end(f), f->folding = 0;
#endif
    return f->state;
}

#ifdef CRC32C_X86
#define HARD_GATHER(T, INSTR)                                                                     \
    for (size_t j = 0; j < len / sizeof(T); j++) {                                                \
        T v;                                                                                      \
        memcpy(&v, src + j * stride, sizeof(T));                                                  \
        c = INSTR(c, v);                                                                          \
    }

__attribute__((target("sse4.2"))) static uint32_t hard_gather(uint32_t c, const uint8_t *src, size_t stride,
                                                               size_t len, size_t elem) {
    if (elem == 2) { HARD_GATHER(uint16_t, _mm_crc32_u16); return c; }
    if (elem == 4) { HARD_GATHER(uint32_t, _mm_crc32_u32); return c; }
    for (size_t j = 0; j < len / elem; j++) c = hard_copy(c, NULL, src + j * stride, elem, 0);
    return c;
}
#endif

crc32c_state crc32c_update_strided(crc32c_state s, const void *src, size_t stride, size_t len, size_t elem) {
    int lv = current_level();
#ifdef CRC32C_X86
    if (lv >= CRC32C_INSTRUCTION) return hard_gather(s, (const uint8_t *)src, stride, len, elem);
#endif
    (void)lv;
    for (size_t j = 0; j < len / elem; j++) s = soft_copy(s, NULL, (const uint8_t *)src + j * stride, elem);
    return s;
}

static uint32_t x_pow_bits(uint64_t n);

static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

static void build_tables(void) { /* once, whichever thread comes first; the others wait */
    build_table();
#ifdef CRC32C_X86
    const uint64_t d[3] = {1024, 512, 128};
    uint64_t *k[3] = {fold_1024, fold_512, fold_128};
    for (int i = 0; i < 3; i++) {
        k[i][0] = (uint64_t)x_pow_bits(d[i] + 63) << 32;
        k[i][1] = (uint64_t)x_pow_bits(d[i] - 1) << 32;
    }
#endif
}

int crc32c_init(int highest) {
    pthread_once(&tables_once, build_tables);
    int best = CRC32C_TABLE;
#ifdef CRC32C_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) best = CRC32C_INSTRUCTION;
    if (best == CRC32C_INSTRUCTION && __builtin_cpu_supports("pclmul")) best = CRC32C_FOLD;
    if (best == CRC32C_FOLD && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq"))
        best = CRC32C_FOLD_WIDE;
#endif
    int chosen = highest < best ? (highest < 0 ? 0 : highest) : best;
    __atomic_store_n(&level, chosen, __ATOMIC_RELEASE); /* after the tables, for every thread */
    return chosen;
}

int crc32c_level(void) { return current_level(); }

crc32c_state crc32c_copy(crc32c_state s, void *dst, const void *src, size_t len) {
    crc32c_stream f;
    crc32c_stream_begin(&f, s);
    crc32c_stream_copy(&f, dst, src, len, 0);
    return crc32c_stream_end(&f);
}

crc32c_state crc32c_update(crc32c_state s, const void *p, size_t len) { return crc32c_copy(s, NULL, p, len); }

/* ---- combining: crc(A||B) = crc(A) * x^(8 len(B)) mod P  xor  crc(B) ------------------------ */
/* Polynomials are reflected: bit 31 is x^0. */

static uint32_t mul_mod_p(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (uint32_t m = 1u << 31; m; m >>= 1) {
        if (a & m) product ^= b;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1; /* b *= x */
    }
    return product;
}

static uint32_t x_pow_bits(uint64_t n) { /* x^n mod P by squaring */
    uint32_t result = 1u << 31, square = 1u << 30; /* x^0, x^1 */
    while (n) {
        if (n & 1) result = mul_mod_p(square, result);
        square = mul_mod_p(square, square);
        n >>= 1;
    }
    return result;
}

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
    return mul_mod_p(x_pow_bits(8 * len_b), crc_a) ^ crc_b;
}
