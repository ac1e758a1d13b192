/* CRC-32C while copying: see crc32c_cpu.h. */
#include "crc32c_cpu.h"

#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define CRC32C_X86 1
#endif

#define POLY 0x82F63B78u /* reflected Castagnoli polynomial */

/* ---- the portable path: slicing-by-8 ------------------------------------------------------ */

static uint32_t table[8][256];
static int use_hardware = -1; /* -1: not chosen yet */

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
__attribute__((target("sse4.2"))) static uint32_t hard_copy(uint32_t s, uint8_t *dst, const uint8_t *src,
                                                             size_t len) {
    uint64_t c = s;
    size_t i = 0;
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
            memcpy(dst + i, &a, 8);
            memcpy(dst + i + 8, &b, 8);
            memcpy(dst + i + 16, &d, 8);
            memcpy(dst + i + 24, &e, 8);
        }
    }
    for (; i + 8 <= len; i += 8) {
        uint64_t v;
        memcpy(&v, src + i, 8);
        c = _mm_crc32_u64(c, v);
        if (dst) memcpy(dst + i, &v, 8);
    }
    uint32_t c32 = (uint32_t)c;
    for (; i < len; i++) {
        uint8_t b = src[i];
        c32 = _mm_crc32_u8(c32, b);
        if (dst) dst[i] = b;
    }
    return c32;
}
#endif

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
    for (size_t j = 0; j < len / elem; j++) c = hard_copy(c, NULL, src + j * stride, elem);
    return c;
}
#endif

crc32c_state crc32c_update_strided(crc32c_state s, const void *src, size_t stride, size_t len, size_t elem) {
    if (use_hardware < 0) crc32c_init(0);
#ifdef CRC32C_X86
    if (use_hardware) return hard_gather(s, (const uint8_t *)src, stride, len, elem);
#endif
    for (size_t j = 0; j < len / elem; j++) s = soft_copy(s, NULL, (const uint8_t *)src + j * stride, elem);
    return s;
}

void crc32c_init(int force_portable) {
    if (use_hardware < 0) build_table();
#ifdef CRC32C_X86
    __builtin_cpu_init();
    use_hardware = !force_portable && __builtin_cpu_supports("sse4.2");
#else
    use_hardware = 0;
#endif
}

int crc32c_hardware(void) { return use_hardware > 0; }

crc32c_state crc32c_copy(crc32c_state s, void *dst, const void *src, size_t len) {
    if (use_hardware < 0) crc32c_init(0);
#ifdef CRC32C_X86
    if (use_hardware) return hard_copy(s, (uint8_t *)dst, (const uint8_t *)src, len);
#endif
    return soft_copy(s, (uint8_t *)dst, (const uint8_t *)src, len);
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

static uint32_t x_pow_8n(uint64_t n) { /* x^(8n) mod P by squaring */
    uint32_t result = 1u << 31, square = 1u << 23; /* x^0, x^8 */
    while (n) {
        if (n & 1) result = mul_mod_p(square, result);
        square = mul_mod_p(square, square);
        n >>= 1;
    }
    return result;
}

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
    return mul_mod_p(x_pow_8n(len_b), crc_a) ^ crc_b;
}
