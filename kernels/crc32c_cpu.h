/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, initial value and final XOR 0xFFFFFFFF),
 * the checksum of format-spec/container.md, computed while bytes are copied.
 *
 * A crc32c_state is the CRC register *before* the final XOR: crc32c_begin() gives the initial
 * state, crc32c_end() the CRC. On x86-64 with SSE4.2 the register moves with the crc32
 * instruction (or PCLMULQDQ folding); elsewhere with a slicing-by-8 table (the same values, tests compare both with
 * the `crc32c` package).
 */
#ifndef KVTOOL_CRC32C_CPU_H
#define KVTOOL_CRC32C_CPU_H

#include <stddef.h>
#include <stdint.h>

typedef uint32_t crc32c_state;

static inline crc32c_state crc32c_begin(void) { return 0xFFFFFFFFu; }
static inline uint32_t crc32c_end(crc32c_state s) { return s ^ 0xFFFFFFFFu; }

/* The paths, slowest first: the slicing-by-8 table, SSE4.2's crc32 instruction, folding with
 * PCLMULQDQ (16-byte loads, no latency chain; ~1.5x the instruction on one core), and the same
 * fold two lanes at a time with 256-bit VPCLMULQDQ (AVX2 CPUs that have it). */
enum { CRC32C_TABLE = 0, CRC32C_INSTRUCTION = 1, CRC32C_FOLD = 2, CRC32C_FOLD_WIDE = 3 };

/* Use the best path this CPU has, up to `highest` (tests force lower ones); returns it. */
int crc32c_init(int highest);
int crc32c_level(void);

/* The state after `len` bytes at `p`. */
crc32c_state crc32c_update(crc32c_state s, const void *p, size_t len);

/* A running CRC over pieces of one message, each optionally copied: a scatter's rows go through
 * one stream, so the fold runs on across rows of whole 64-byte units. `nontemporal`: write
 * `dst` with non-temporal stores (large copies; call _mm_sfence before the bytes are
 * handed on: paged_copy_cpu.c's workers do). */
typedef struct {
    uint64_t lanes[8];  /* the folding path's four 128-bit lanes */
    crc32c_state state; /* the register, when not folding */
    int folding;
    /* The values check that rides on the same loads (crc32c_stream_values): each value's
     * exponent bits, masked, plus the mask's lowest bit, carry into the value's top bit exactly
     * when they are all set (NaN or infinity); the sums are OR-ed here, lane by lane. */
    uint64_t flags[4];
    uint32_t value_mask, value_low;
    int value_width; /* 0: no check; 2 (bf16, fp16) or 4 (fp32) bytes a value */
} crc32c_stream;

/* begin also turns the values check off (crc32c_stream_values turns it on). */
void crc32c_stream_begin(crc32c_stream *f, crc32c_state s);
/* Check every value copied from now on: kind 1 bf16, 2 fp16, 3 fp32 (0: no check). Pieces must
 * begin on a value's boundary. */
void crc32c_stream_values(crc32c_stream *f, int kind);
/* Whether a value copied since crc32c_stream_values was NaN or infinite. */
int crc32c_stream_nonfinite(const crc32c_stream *f);
void crc32c_stream_copy(crc32c_stream *f, void *dst, const void *src, size_t len, int nontemporal);
crc32c_state crc32c_stream_end(crc32c_stream *f);

/* Copy `len` bytes from `src` to `dst` and return the state after them. Every byte is loaded
 * once: the bytes written are exactly the bytes checked, even if `src` changes meanwhile
 * (a memory-mapped file another process writes). */
crc32c_state crc32c_copy(crc32c_state s, void *dst, const void *src, size_t len);

/* The state after `len / elem` elements of `elem` bytes read `stride` bytes apart from src. */
crc32c_state crc32c_update_strided(crc32c_state s, const void *src, size_t stride, size_t len, size_t elem);

/* CRC of A||B from crc(A), crc(B) and len(B) (finished CRCs). */
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

#endif
