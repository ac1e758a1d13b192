/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, initial value and final XOR 0xFFFFFFFF),
 * the checksum of format-spec/container.md, computed while bytes are copied.
 *
 * A crc32c_state is the CRC register *before* the final XOR: crc32c_begin() gives the initial
 * state, crc32c_end() the CRC. On x86-64 with SSE4.2 the register moves with the crc32
 * instruction; elsewhere with a slicing-by-8 table (the same values, tests compare both with
 * the `crc32c` package).
 */
#ifndef KVTOOL_CRC32C_CPU_H
#define KVTOOL_CRC32C_CPU_H

#include <stddef.h>
#include <stdint.h>

typedef uint32_t crc32c_state;

static inline crc32c_state crc32c_begin(void) { return 0xFFFFFFFFu; }
static inline uint32_t crc32c_end(crc32c_state s) { return s ^ 0xFFFFFFFFu; }

/* Select the hardware or table path once (force_portable != 0: the table path, for tests). */
void crc32c_init(int force_portable);
int crc32c_hardware(void);

/* The state after `len` bytes at `p`. */
crc32c_state crc32c_update(crc32c_state s, const void *p, size_t len);

/* Copy `len` bytes from `src` to `dst` and return the state after them. Every byte is loaded
 * once: the bytes written are exactly the bytes checked, even if `src` changes meanwhile
 * (a memory-mapped file another process writes). */
crc32c_state crc32c_copy(crc32c_state s, void *dst, const void *src, size_t len);

/* The state after `len / elem` elements of `elem` bytes read `stride` bytes apart from src. */
crc32c_state crc32c_update_strided(crc32c_state s, const void *src, size_t stride, size_t len, size_t elem);

/* CRC of A||B from crc(A), crc(B) and len(B) (finished CRCs). */
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

#endif
