/* CPU paged gather/scatter: kvtool._paged_native (connectors/paged_native.py calls it).
 *
 * connectors/paged_native.py reduces every layout to "segments", one per (layer, K/V) tensor: the
 * blob's [T, H*D] part for that tensor, the tokens' slots, and the tensor's address map. Token
 * t's slot gives (block, offset) = (slot / block_size, slot % block_size); the tensor holds its
 * `groups` rows (1: a token's H*D channels are one stretch; H: one row per head) at byte
 *     a + block * sb + offset * so + group * sh
 * from the tensor's data pointer, each row `run` bytes of the blob, contiguous (stride 0) or as
 * elements of `elem` bytes `stride` bytes apart (vLLM's CPU K pages are transposed: one channel
 * every block_size elements). The same arithmetic as connectors/paged_layout.run_offset, done
 * here per token so no index tensors are built. There are no torch headers: tensors come as
 * pointers and byte counts, and every slot of every segment is checked against its tensor's
 * extent before anything is copied, so a bad slot is an error, never a stray or partial write.
 * Threads (kept from call to call) take jobs of whole segments, the GIL released.
 *
 * A segment: 14 uint64 (paged_ptr, paged_bytes, blob_ptr, tokens, slots_ptr, block_size, groups,
 * a, sb, so, sh, run, stride, elem), slots_ptr pointing to `tokens` int64. Blob row
 * (t * groups + g) is at blob_ptr + (t * groups + g) * run.
 *
 * copy_segments(segments, scatter, threads[, blob, tokens, slots]) -> None
 *   scatter: 1 = blob -> paged, 0 = paged -> blob
 *   With the last three, `segments` is a template (the buffers' half, kept by the caller for
 *   every call on the same buffers): each blob_ptr holds the segment's part of the KV_BLOB (its
 *   index in [2, L]), and this call's blob address, token count and slots address are filled in
 *   here (blob_ptr = blob + part * tokens * groups * run). Filling them in Python cost as much as
 *   copying a small chunk.
 *
 * scatter_checked(segments, payload, threads[, blob, tokens, slots]) -> CRC-32C of payload
 *   The load of a stored chunk straight from its (memory-mapped) bytes: every byte of `payload`
 *   is read once, checksummed as it is copied (crc32c_cpu.c), and the CRC of the whole payload
 *   comes back for the caller to compare with the stored one. The bytes written are the bytes
 *   checked even if the mapping changes meanwhile; a mismatch means the caller refuses the
 *   chunk (its slots then hold no loaded tokens). Segments' blobs lie inside the payload in
 *   ascending order, apart; bytes no segment copies are checksummed only. The payload is split
 *   between threads at segment starts and the parts' CRCs combined. The payload is read through
 *   a fault guard (fault_guard.c): when it is a file's mapping and the file is cut short under
 *   the copy, the SIGBUS is an EOFError, not the end of the process.
 *
 * scatter_checked_file(segments, fd, offset, length, threads, tokens, slots) -> CRC-32C
 *   scatter_checked of a payload still in an open file (a store object): mapped for the call
 *   behind the fault guard from map_min_bytes (4 MiB) up, else (or where it cannot be mapped)
 *   read a window at a time into a buffer that stays in the cache, each window checked and
 *   scattered from there (a template's call; EOFError when the file ends first, OSError when a
 *   read fails, or a mapped page could not be read). map_min_bytes(n) -> the previous threshold
 *   (tests and the bench take both ways); file_maps() -> payloads read from a mapping so far.
 *
 * copy_checked(dst, src) -> CRC-32C of src, copied into dst in the same pass (pinned staging); src
 *   read through the fault guard (a mapped file cut short under the copy: EOFError).
 *
 * slots_ok(slots, count, num_slots, distinct) -> True when `count` int64 at address `slots` all lie
 *   in [0, num_slots) and, `distinct`, none repeats: the connectors' checks of a slot mapping
 *   (their torch version, which words the error, runs only when this says no).
 *
 * crc32c(buffer) -> CRC-32C;  crc32c_combine(a, b, len_b);  crc32c_level() -> 0 table, 1 crc32
 * instruction, 2 PCLMULQDQ folding, 3 the same on 256-bit registers;  crc32c_set_level(n) -> the level now in effect (tests).
 *
 * Large calls write with non-temporal stores: a load writes far more than the caches hold, and
 * those stores skip reading each destination line before overwriting it (a third of a copy's
 * memory traffic; measured 1.3-1.6x on shuffled 6-32 KB runs). nontemporal_min(n) -> the
 * previous threshold in bytes per call (tests lower it to cover both kinds of store). Copies
 * from 512 bytes store a whole line at a time where the CPU can (AVX-512, else AVX2);
 * stream_width(bits) -> the width in effect after asking for at most `bits` (tests take each).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <unistd.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>

#if defined(__x86_64__) || defined(__SSE2__)
#include <emmintrin.h>
#include <immintrin.h>
#define HAVE_SSE2 1
#endif

#include "crc32c_cpu.h"
#include "fault_guard.h"

typedef struct {
    uint64_t paged, paged_bytes, blob, tokens, slots, block_size, groups, a, sb, so, sh, run, stride, elem;
} segment_t;

#define MAX_THREADS 64

static size_t nontemporal_min = (size_t)4 << 20; /* bytes per call from which stores bypass the caches */

/* A streaming copy prefetches as it goes, a line for each line it copies: its own source
 * PREFETCH_AHEAD bytes on when the source runs on past the copy (the blob, scattering), or the
 * next run's lines when the next run lies elsewhere (a page, gathering). The hardware prefetcher
 * ramps up too slowly over runs of a few KB, and prefetches issued in a burst stall once the
 * line-fill buffers are full (measured on a Zen 4 host, 2,048 tokens: gathers 4.4 -> 2.7 ms on
 * vLLM's flash_attn layout, 5.1 -> 2.7 ms on its CUDA layout; scatters 2.1 -> 1.8 ms). */
#define PREFETCH_AHEAD 4096

static inline void prefetch_bytes(const char *p, size_t n) {
    for (size_t o = 0; o < n; o += 64) __builtin_prefetch(p + o);
}

#ifdef HAVE_SSE2
/* Whole lines (n a multiple of 64, d 64-byte aligned) with non-temporal stores of a line at a
 * time, prefetching `pf` on a line per line (see copy_bytes_pf), on the widest registers the CPU
 * has (stream_lines, set at import): each store then hands the write-combining buffer a whole
 * line at once. Measured against four 16-byte stores a line on a shared Sapphire-Rapids-class
 * host, 2,048 tokens, paired: gathers and scatters 5-40% faster on every layout (AVX2's two
 * 32-byte stores a line: between the two). */
__attribute__((target("avx512f"))) static void stream_lines_512(char *d, const char *p, size_t n, const char *pf) {
    for (; n >= 64; d += 64, p += 64, n -= 64) {
        if (pf) _mm_prefetch(pf, _MM_HINT_T1), pf += 64;
        _mm512_stream_si512((void *)d, _mm512_loadu_si512((const void *)p));
    }
}

__attribute__((target("avx2"))) static void stream_lines_256(char *d, const char *p, size_t n, const char *pf) {
    for (; n >= 64; d += 64, p += 64, n -= 64) {
        if (pf) _mm_prefetch(pf, _MM_HINT_T1), pf += 64;
        __m256i a = _mm256_loadu_si256((const __m256i *)p), b = _mm256_loadu_si256((const __m256i *)(p + 32));
        _mm256_stream_si256((__m256i *)d, a);
        _mm256_stream_si256((__m256i *)(d + 32), b);
    }
}

static void (*stream_lines)(char *d, const char *p, size_t n, const char *pf) = NULL; /* NULL: SSE2 inline */

/* The widest stores up to `bits` (512, 256; less: the inline 16-byte loop) the CPU has; returns
 * the width now in effect. */
static int pick_stream_lines(int bits) {
    __builtin_cpu_init();
    if (bits >= 512 && __builtin_cpu_supports("avx512f")) {
        stream_lines = stream_lines_512;
        return 512;
    }
    if (bits >= 256 && __builtin_cpu_supports("avx2")) {
        stream_lines = stream_lines_256;
        return 256;
    }
    stream_lines = NULL;
    return 128;
}
#endif

/* memcpy, or with non-temporal stores (the ends plainly), then prefetching `pf` on (NULL:
 * nothing) a line per line copied, into L2: each line is read once, a run later, and prefetches
 * into L1 measured 5-20% slower gathers (2,048 tokens, contiguous runs of 6 KB, on a shared
 * Sapphire-Rapids-class host) and no faster scatters. From 512 bytes the lines go through
 * stream_lines (an indirect call); shorter rows (a head's 128-256 bytes) in an inline loop of
 * 16-byte stores, as rows of whole 16-byte units do without non-temporal stores: a call per row
 * costs as much as the row. */
static inline void copy_bytes_pf(void *dst, const void *src, size_t n, int nt, const char *pf) {
#ifdef HAVE_SSE2
    char *d = (char *)dst;
    const char *p = (const char *)src;
    if (nt && n >= 512 && stream_lines) {
        size_t head = (size_t)(-(uintptr_t)d & 63), body;
        memcpy(d, p, head);
        d += head, p += head, n -= head;
        body = n & ~(size_t)63;
        stream_lines(d, p, body, pf);
        memcpy(d + body, p + body, n - body);
        return;
    }
    if (nt && n >= 64) {
        size_t head = (size_t)(-(uintptr_t)d & 15);
        memcpy(d, p, head);
        d += head, p += head, n -= head;
        for (; n >= 64; d += 64, p += 64, n -= 64) {
            if (pf) _mm_prefetch(pf, _MM_HINT_T1), pf += 64;
            __m128i a = _mm_loadu_si128((const __m128i *)p), b = _mm_loadu_si128((const __m128i *)(p + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(p + 32)), e = _mm_loadu_si128((const __m128i *)(p + 48));
            _mm_stream_si128((__m128i *)d, a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
        }
        memcpy(d, p, n);
        return;
    }
    if (n <= 512 && n % 16 == 0) {
        for (size_t i = 0; i < n; i += 16) _mm_storeu_si128((__m128i *)(d + i), _mm_loadu_si128((const __m128i *)(p + i)));
        return;
    }
#endif
    (void)nt, (void)pf;
    memcpy(dst, src, n);
}

static inline void copy_bytes(void *dst, const void *src, size_t n, int nt) {
    copy_bytes_pf(dst, src, n, nt, NULL);
}

/* Non-temporal stores are weakly ordered: fence them before a thread's work is handed on. */
static inline void store_fence(void) {
#ifdef HAVE_SSE2
    _mm_sfence();
#endif
}

/* Byte offset of a slot's first row (group 0). Block sizes are powers of two in every engine:
 * a shift and a mask then, not a 64-bit division per token and tensor. */
static inline size_t token_at(const segment_t *g, int64_t slot) {
    uint64_t s = (uint64_t)slot, bs = g->block_size, block, offset;
    if ((bs & (bs - 1)) == 0) {
        block = s >> __builtin_ctzll(bs);
        offset = s & (bs - 1);
    } else {
        block = s / bs;
        offset = s % bs;
    }
    return (size_t)(g->a + block * g->sb + offset * g->so);
}

static inline size_t row_at(const segment_t *g, int64_t slot, size_t group) {
    return token_at(g, slot) + group * (size_t)g->sh;
}

/* ---- checks ------------------------------------------------------------------------------- */

/* Every slot of every segment inside its paged tensor; sane sizes. Strides are non-negative, so
 * the farthest byte is reached by the largest block, the last offset and the last group. Slot
 * lists are shared by all segments, so their extremes are computed once per list. */
static int segments_ok(const segment_t *seg, size_t n) {
    uint64_t last_slots = 0;
    int64_t lo = 0, hi = -1;
    for (size_t k = 0; k < n; k++) {
        const segment_t *g = &seg[k];
        if (!g->paged || !g->blob || !g->slots || !g->run || !g->block_size || !g->groups) return 0;
        if (g->stride && (!g->elem || g->run % g->elem || g->stride < g->elem)) return 0;
        if (g->slots != last_slots) {
            const int64_t *r = (const int64_t *)(uintptr_t)g->slots;
            lo = 0, hi = -1;
            for (uint64_t i = 0; i < g->tokens; i++) {
                if (i == 0 || r[i] < lo) lo = r[i];
                if (i == 0 || r[i] > hi) hi = r[i];
            }
            last_slots = g->slots;
        }
        if (!g->tokens) continue;
        if (lo < 0) return 0;
        uint64_t reach = g->stride ? (g->run / g->elem - 1) * g->stride + g->elem : g->run;
        /* in 128 bits: a forged stride must not wrap around */
        unsigned __int128 far = (unsigned __int128)g->a + (unsigned __int128)((uint64_t)hi / g->block_size) * g->sb +
                                (unsigned __int128)(g->block_size - 1) * g->so +
                                (unsigned __int128)(g->groups - 1) * g->sh + reach;
        if (far > g->paged_bytes) return 0;
    }
    return 1;
}

/* The segments of a call: `segs` as given, or (a template: `base` != 0) a copy with this call's
 * blob, token count and slots filled in (in `stack` when it is given and holds them, else on the
 * heap). Returns NULL (a Python error set) when malformed. */
#define STACK_SEGMENTS 128
static segment_t *call_segments(const Py_buffer *segs, unsigned long long base, unsigned long long tokens,
                                unsigned long long slots, segment_t *stack, size_t *count) {
    size_t n = (size_t)segs->len / sizeof(segment_t);
    *count = n;
    if (segs->len % sizeof(segment_t)) {
        PyErr_SetString(PyExc_IndexError, "paged copy: segments are not whole");
        return NULL;
    }
    if (!base) return (segment_t *)segs->buf;
    segment_t *seg = stack && n <= STACK_SEGMENTS ? stack : (segment_t *)malloc(n * sizeof(segment_t));
    if (!seg) {
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(seg, segs->buf, n * sizeof(segment_t));
    for (size_t k = 0; k < n; k++) {
        unsigned __int128 offset = (unsigned __int128)seg[k].blob * tokens * seg[k].groups * seg[k].run;
        if (offset > UINT64_MAX - base) { /* a forged part index: refused by the checks below */
            seg[k].blob = 0;
            continue;
        }
        seg[k].blob = base + (uint64_t)offset;
        seg[k].tokens = tokens;
        seg[k].slots = slots;
    }
    return seg;
}

static void release_segments(segment_t *seg, const Py_buffer *segs, segment_t *stack) {
    if (seg && seg != stack && seg != (segment_t *)segs->buf) free(seg);
}

/* slots_ok: every slot in [0, num_slots), and (distinct) none twice: an open-addressed set of
 * the slots seen, twice as many entries as slots. */
static int slots_in_range_distinct(const int64_t *slots, size_t n, int64_t num_slots, int distinct) {
    for (size_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= num_slots) return 0;
    if (!distinct || n < 2) return 1;
    size_t size = 16;
    int bits = 4;
    while (size < 2 * n) size <<= 1, bits++;
    int64_t stack[1024], *seen = size <= 1024 ? stack : (int64_t *)malloc(size * sizeof(int64_t));
    if (!seen) return -1;
    memset(seen, 0xff, size * sizeof(int64_t)); /* -1: empty (slots are non-negative) */
    int ok = 1;
    for (size_t i = 0; i < n && ok; i++) {
        /* Fibonacci hashing: the product's top bits; consecutive slots spread over the table */
        for (size_t j = (size_t)(((uint64_t)slots[i] * 0x9E3779B97F4A7C15ull) >> (64 - bits));; j = (j + 1) & (size - 1)) {
            if (seen[j] == -1) {
                seen[j] = slots[i];
                break;
            }
            if (seen[j] == slots[i]) {
                ok = 0;
                break;
            }
        }
    }
    if (seen != stack) free(seen);
    return ok;
}

/* ---- plain copies ------------------------------------------------------------------------- */

/* Rows of one head are short (128-256 bytes) and scattered over the pages: gathering, the rows
 * of a token a few tokens ahead are prefetched, so their misses overlap this token's copies
 * instead of following them. (Scattering, the blob side is read in order, which the hardware
 * prefetches; prefetching the lines about to be overwritten would only fetch them for nothing.) */
#define ROW_PREFETCH_TOKENS 4
#define COPY_ROWS(N)                                                                      \
    for (size_t t = 0; t < tokens; t++) {                                                 \
        char *p = paged + token_at(g, slots[t]);                                          \
        if (!scatter && t + ROW_PREFETCH_TOKENS < tokens) {                               \
            const char *q = paged + token_at(g, slots[t + ROW_PREFETCH_TOKENS]);          \
            for (size_t gi = 0; gi < groups; gi++, q += g->sh)                            \
                for (size_t o = 0; o < (N); o += 64) __builtin_prefetch(q + o);            \
        }                                                                                 \
        for (size_t gi = 0; gi < groups; gi++, b += (N), p += g->sh)                      \
            if (scatter) copy_bytes_pf(p, b, (N), nt, b + PREFETCH_AHEAD);                \
            else copy_bytes(b, p, (N), nt);                                               \
    }
static size_t slot_run(const segment_t *g, const int64_t *slots, size_t t, size_t tokens) {
    size_t n = 1;
    uint64_t room = g->block_size - (uint64_t)slots[t] % g->block_size; /* slots left in the block */
    while (t + n < tokens && n < room && slots[t + n] == slots[t] + (int64_t)n) n++;
    return n;
}

/* transpose_tile: element (r, c) of a rows x cols tile at src + r*ss + c*elem goes to
 * dst + c*ds + r*elem. Scattering a run of slots into a transposed page, the rows are tokens
 * (blob rows) and the columns channels; gathering, the other way round. 8x8 tiles of 16-bit and
 * 4x4 tiles of 32-bit elements move through SSE2 registers (16 bytes read or written per row of
 * a tile, not 2 or 4); the edges and other element sizes one element at a time. */
#ifdef HAVE_SSE2
static inline void transpose8x8_16(char *dst, size_t ds, const char *src, size_t ss) {
    __m128i a0 = _mm_loadu_si128((const __m128i *)src), a1 = _mm_loadu_si128((const __m128i *)(src + ss));
    __m128i a2 = _mm_loadu_si128((const __m128i *)(src + 2 * ss)), a3 = _mm_loadu_si128((const __m128i *)(src + 3 * ss));
    __m128i a4 = _mm_loadu_si128((const __m128i *)(src + 4 * ss)), a5 = _mm_loadu_si128((const __m128i *)(src + 5 * ss));
    __m128i a6 = _mm_loadu_si128((const __m128i *)(src + 6 * ss)), a7 = _mm_loadu_si128((const __m128i *)(src + 7 * ss));
    __m128i t0 = _mm_unpacklo_epi16(a0, a1), t1 = _mm_unpackhi_epi16(a0, a1);
    __m128i t2 = _mm_unpacklo_epi16(a2, a3), t3 = _mm_unpackhi_epi16(a2, a3);
    __m128i t4 = _mm_unpacklo_epi16(a4, a5), t5 = _mm_unpackhi_epi16(a4, a5);
    __m128i t6 = _mm_unpacklo_epi16(a6, a7), t7 = _mm_unpackhi_epi16(a6, a7);
    __m128i u0 = _mm_unpacklo_epi32(t0, t2), u1 = _mm_unpackhi_epi32(t0, t2); /* columns 0-1, 2-3 of rows 0-3 */
    __m128i u2 = _mm_unpacklo_epi32(t1, t3), u3 = _mm_unpackhi_epi32(t1, t3); /* columns 4-5, 6-7 */
    __m128i u4 = _mm_unpacklo_epi32(t4, t6), u5 = _mm_unpackhi_epi32(t4, t6); /* the same of rows 4-7 */
    __m128i u6 = _mm_unpacklo_epi32(t5, t7), u7 = _mm_unpackhi_epi32(t5, t7);
    _mm_storeu_si128((__m128i *)dst, _mm_unpacklo_epi64(u0, u4));
    _mm_storeu_si128((__m128i *)(dst + ds), _mm_unpackhi_epi64(u0, u4));
    _mm_storeu_si128((__m128i *)(dst + 2 * ds), _mm_unpacklo_epi64(u1, u5));
    _mm_storeu_si128((__m128i *)(dst + 3 * ds), _mm_unpackhi_epi64(u1, u5));
    _mm_storeu_si128((__m128i *)(dst + 4 * ds), _mm_unpacklo_epi64(u2, u6));
    _mm_storeu_si128((__m128i *)(dst + 5 * ds), _mm_unpackhi_epi64(u2, u6));
    _mm_storeu_si128((__m128i *)(dst + 6 * ds), _mm_unpacklo_epi64(u3, u7));
    _mm_storeu_si128((__m128i *)(dst + 7 * ds), _mm_unpackhi_epi64(u3, u7));
}

static inline void transpose4x4_32(char *dst, size_t ds, const char *src, size_t ss) {
    __m128i a0 = _mm_loadu_si128((const __m128i *)src), a1 = _mm_loadu_si128((const __m128i *)(src + ss));
    __m128i a2 = _mm_loadu_si128((const __m128i *)(src + 2 * ss)), a3 = _mm_loadu_si128((const __m128i *)(src + 3 * ss));
    __m128i t0 = _mm_unpacklo_epi32(a0, a1), t1 = _mm_unpacklo_epi32(a2, a3); /* columns 0-1 */
    __m128i t2 = _mm_unpackhi_epi32(a0, a1), t3 = _mm_unpackhi_epi32(a2, a3); /* columns 2-3 */
    _mm_storeu_si128((__m128i *)dst, _mm_unpacklo_epi64(t0, t1));
    _mm_storeu_si128((__m128i *)(dst + ds), _mm_unpackhi_epi64(t0, t1));
    _mm_storeu_si128((__m128i *)(dst + 2 * ds), _mm_unpacklo_epi64(t2, t3));
    _mm_storeu_si128((__m128i *)(dst + 3 * ds), _mm_unpackhi_epi64(t2, t3));
}
/* The same with non-temporal stores (dst and ds 16-byte aligned). */
static inline void transpose8x8_16_nt(char *dst, size_t ds, const char *src, size_t ss) {
    __m128i a0 = _mm_loadu_si128((const __m128i *)src), a1 = _mm_loadu_si128((const __m128i *)(src + ss));
    __m128i a2 = _mm_loadu_si128((const __m128i *)(src + 2 * ss)), a3 = _mm_loadu_si128((const __m128i *)(src + 3 * ss));
    __m128i a4 = _mm_loadu_si128((const __m128i *)(src + 4 * ss)), a5 = _mm_loadu_si128((const __m128i *)(src + 5 * ss));
    __m128i a6 = _mm_loadu_si128((const __m128i *)(src + 6 * ss)), a7 = _mm_loadu_si128((const __m128i *)(src + 7 * ss));
    __m128i t0 = _mm_unpacklo_epi16(a0, a1), t1 = _mm_unpackhi_epi16(a0, a1);
    __m128i t2 = _mm_unpacklo_epi16(a2, a3), t3 = _mm_unpackhi_epi16(a2, a3);
    __m128i t4 = _mm_unpacklo_epi16(a4, a5), t5 = _mm_unpackhi_epi16(a4, a5);
    __m128i t6 = _mm_unpacklo_epi16(a6, a7), t7 = _mm_unpackhi_epi16(a6, a7);
    __m128i u0 = _mm_unpacklo_epi32(t0, t2), u1 = _mm_unpackhi_epi32(t0, t2); /* columns 0-1, 2-3 of rows 0-3 */
    __m128i u2 = _mm_unpacklo_epi32(t1, t3), u3 = _mm_unpackhi_epi32(t1, t3); /* columns 4-5, 6-7 */
    __m128i u4 = _mm_unpacklo_epi32(t4, t6), u5 = _mm_unpackhi_epi32(t4, t6); /* the same of rows 4-7 */
    __m128i u6 = _mm_unpacklo_epi32(t5, t7), u7 = _mm_unpackhi_epi32(t5, t7);
    _mm_stream_si128((__m128i *)dst, _mm_unpacklo_epi64(u0, u4));
    _mm_stream_si128((__m128i *)(dst + ds), _mm_unpackhi_epi64(u0, u4));
    _mm_stream_si128((__m128i *)(dst + 2 * ds), _mm_unpacklo_epi64(u1, u5));
    _mm_stream_si128((__m128i *)(dst + 3 * ds), _mm_unpackhi_epi64(u1, u5));
    _mm_stream_si128((__m128i *)(dst + 4 * ds), _mm_unpacklo_epi64(u2, u6));
    _mm_stream_si128((__m128i *)(dst + 5 * ds), _mm_unpackhi_epi64(u2, u6));
    _mm_stream_si128((__m128i *)(dst + 6 * ds), _mm_unpacklo_epi64(u3, u7));
    _mm_stream_si128((__m128i *)(dst + 7 * ds), _mm_unpackhi_epi64(u3, u7));
}

static inline void transpose4x4_32_nt(char *dst, size_t ds, const char *src, size_t ss) {
    __m128i a0 = _mm_loadu_si128((const __m128i *)src), a1 = _mm_loadu_si128((const __m128i *)(src + ss));
    __m128i a2 = _mm_loadu_si128((const __m128i *)(src + 2 * ss)), a3 = _mm_loadu_si128((const __m128i *)(src + 3 * ss));
    __m128i t0 = _mm_unpacklo_epi32(a0, a1), t1 = _mm_unpacklo_epi32(a2, a3); /* columns 0-1 */
    __m128i t2 = _mm_unpackhi_epi32(a0, a1), t3 = _mm_unpackhi_epi32(a2, a3); /* columns 2-3 */
    _mm_stream_si128((__m128i *)dst, _mm_unpacklo_epi64(t0, t1));
    _mm_stream_si128((__m128i *)(dst + ds), _mm_unpackhi_epi64(t0, t1));
    _mm_stream_si128((__m128i *)(dst + 2 * ds), _mm_unpacklo_epi64(t2, t3));
    _mm_stream_si128((__m128i *)(dst + 3 * ds), _mm_unpackhi_epi64(t2, t3));
}
#endif

static void transpose_tile(char *dst, size_t ds, const char *src, size_t ss, size_t rows, size_t cols, size_t elem) {
    size_t r0 = 0, c0 = 0, edge = 0; /* [0, r0) x [0, c0): done by whole SIMD tiles */
#ifdef HAVE_SSE2
    if (elem == 2 || elem == 4) {
        edge = elem == 2 ? 8 : 4;
        r0 = rows / edge * edge, c0 = cols / edge * edge;
        for (size_t c = 0; c < c0; c += edge) /* a band of destination rows at a time: their lines fill at once */
            for (size_t r = 0; r < r0; r += edge) {
                const char *s = src + r * ss + c * elem;
                char *d = dst + c * ds + r * elem;
                if (elem == 2) transpose8x8_16(d, ds, s, ss);
                else transpose4x4_32(d, ds, s, ss);
            }
    }
#endif
    (void)edge;
    for (size_t r = 0; r < rows; r++) /* the rest: columns past c0 of every row, all of rows past r0 */
        for (size_t c = r < r0 ? c0 : 0; c < cols; c++) memcpy(dst + c * ds + r * elem, src + r * ss + c * elem, elem);
}

/* Rows x cols straight into memory with non-temporal stores, when whole SIMD tiles cover it and
 * the destination rows are 16-byte aligned; 0 (nothing done) otherwise. The tiles go a band of
 * destination rows at a time, along them: each row's lines fill in order, and the write-
 * combining buffers send whole lines, none read first. */
static int transpose_nt(char *dst, size_t ds, const char *src, size_t ss, size_t rows, size_t cols, size_t elem,
                        const char *pf) {
#ifdef HAVE_SSE2
    size_t edge = elem == 2 ? 8 : elem == 4 ? 4 : 0;
    if (!edge || rows % edge || cols % edge || ((uintptr_t)dst | ds) % 16) return 0;
    for (size_t c = 0; c < cols; c += edge)
        for (size_t r = 0; r < rows; r += edge) {
            if (pf) { /* as many bytes of `pf` as a tile moves (128 or 64) */
                __builtin_prefetch(pf);
                if (elem == 2) __builtin_prefetch(pf + 64);
                pf += edge * edge * elem;
            }
            const char *sp = src + r * ss + c * elem;
            char *dp = dst + c * ds + r * elem;
            if (elem == 2) transpose8x8_16_nt(dp, ds, sp, ss);
            else transpose4x4_32_nt(dp, ds, sp, ss);
        }
    return 1;
#else
    return 0;
#endif
}

/* Strided rows (a transposed page) move a tile at a time: the tokens of a run of consecutive
 * slots in one block, by one group. A run that fills its channel rows (a whole block) goes
 * straight to memory with non-temporal stores when the call is large and whole lines result
 * (transpose_nt); otherwise it is transposed into a buffer and written to its page in one
 * contiguous copy, and gathering, the run's blob rows are put together the same way and written
 * at once. (Transposing straight into memory with plain stores writes 16 bytes per row, every
 * line read for ownership first: 1.5-2.5x slower.) Pages whose adjacent slots are not adjacent
 * elements (no engine has them) go one element at a time. */
#define TILE_BUFFER (256 << 10) /* a block of 128 slots of 8 heads x 128 bf16 channels */

/* Tile buffers are kept for the next call, not freed: a 256 KB malloc is served by mmap or
 * trimmed back to the system when freed, and its page faults on every call cost more than the
 * transposes (at most 2 * MAX_THREADS are kept: one per thread of the calls running at once). */
static pthread_mutex_t tile_lock = PTHREAD_MUTEX_INITIALIZER;
static char *tile_free[2 * MAX_THREADS];
static int tile_kept = 0;

static char *tile_take(void) {
    char *buffer = NULL;
    pthread_mutex_lock(&tile_lock);
    if (tile_kept) buffer = tile_free[--tile_kept];
    pthread_mutex_unlock(&tile_lock);
    return buffer ? buffer : malloc(TILE_BUFFER); /* NULL: the copies go without one */
}

static void tile_give(char *buffer) {
    if (!buffer) return;
    pthread_mutex_lock(&tile_lock);
    if (tile_kept < 2 * MAX_THREADS) tile_free[tile_kept++] = buffer, buffer = NULL;
    pthread_mutex_unlock(&tile_lock);
    free(buffer);
}

/* One run: tokens [t, t + n), their blob rows at `rows` (token k at rows + k * groups * run). */
static void tiles_run(const segment_t *g, size_t t, size_t n, char *rows, int scatter, int nt, char *buffer) {
    char *paged = (char *)(uintptr_t)g->paged;
    const int64_t *slots = (const int64_t *)(uintptr_t)g->slots;
    size_t groups = g->groups, run = g->run, stride = g->stride, so = g->so, elem = g->elem;
    size_t channels = run / elem, token_bytes = groups * run;
    if (so != elem) {
        for (size_t gi = 0; gi < groups; gi++) {
            char *p = paged + row_at(g, slots[t], gi);
            for (size_t j = 0; j < channels; j++)
                for (size_t k = 0; k < n; k++) {
                    char *pk = p + k * so + j * stride, *bk = rows + k * token_bytes + gi * run + j * elem;
                    if (scatter) memcpy(pk, bk, elem); else memcpy(bk, pk, elem);
                }
        }
        return;
    }
    if (scatter && nt && run % 64 == 0 && token_bytes % 16 == 0 && n * elem == stride) { /* whole rows, whole lines */
        size_t done = 0;
        for (size_t gi = 0; gi < groups; gi++, done++) {
            char *p = paged + row_at(g, slots[t], gi), *b0 = rows + gi * run;
            if (!transpose_nt(p, stride, b0, token_bytes, n, channels, elem, NULL)) break;
        }
        if (done == groups) return; /* (else every group again below: the same bytes) */
    }
    if (!scatter && buffer && token_bytes <= TILE_BUFFER) { /* as many tokens at a time as the buffer holds */
        for (size_t k0 = 0, m; k0 < n; k0 += m) {
            m = n - k0 < TILE_BUFFER / token_bytes ? n - k0 : TILE_BUFFER / token_bytes;
            for (size_t gi = 0; gi < groups; gi++)
                transpose_tile(buffer + gi * run, token_bytes, paged + row_at(g, slots[t], gi) + k0 * so, stride,
                               channels, m, elem);
            copy_bytes(rows + k0 * token_bytes, buffer, m * token_bytes, nt);
        }
        return;
    }
    for (size_t gi = 0; gi < groups; gi++) {
        char *p = paged + row_at(g, slots[t], gi), *b0 = rows + gi * run;
        if (scatter && buffer && n * elem == stride && channels * stride <= TILE_BUFFER) { /* whole rows */
            transpose_tile(buffer, stride, b0, token_bytes, n, channels, elem);
            copy_bytes(p, buffer, channels * stride, nt);
        } else if (scatter) {
            transpose_tile(p, stride, b0, token_bytes, n, channels, elem);
        } else {
            transpose_tile(b0, token_bytes, p, stride, channels, n, elem);
        }
    }
}

/* The next run's source, fetched while this run moves. */
static void prefetch_run(const segment_t *g, size_t t, size_t tokens, const char *b, int scatter) {
    if (t >= tokens) return;
    const int64_t *slots = (const int64_t *)(uintptr_t)g->slots;
    size_t n = slot_run(g, slots, t, tokens), token_bytes = g->groups * g->run;
    if (scatter) {
        for (size_t o = 0; o < n * token_bytes; o += 64) __builtin_prefetch(b + t * token_bytes + o);
        return;
    }
    for (size_t gi = 0; gi < g->groups; gi++) {
        const char *q = (const char *)(uintptr_t)g->paged + row_at(g, slots[t], gi);
        for (size_t j = 0; j < g->run / g->elem; j++)
            for (size_t o = 0; o < n * g->so; o += 64) __builtin_prefetch(q + j * g->stride + o);
    }
}

/* `buffer`: TILE_BUFFER bytes, or NULL (then transposed straight into memory). */
static void copy_tiles(const segment_t *g, char *b, int scatter, int nt, char *buffer) {
    const int64_t *slots = (const int64_t *)(uintptr_t)g->slots;
    size_t tokens = g->tokens, token_bytes = g->groups * g->run;
    for (size_t t = 0; t < tokens;) {
        size_t n = slot_run(g, slots, t, tokens);
        prefetch_run(g, t + n, tokens, b, scatter);
        tiles_run(g, t, n, b + t * token_bytes, scatter, nt, buffer);
        t += n;
    }
}

static void copy_segment(const segment_t *g, int scatter, int nt, char *tile_buffer) {
    char *paged = (char *)(uintptr_t)g->paged, *b = (char *)(uintptr_t)g->blob;
    const int64_t *slots = (const int64_t *)(uintptr_t)g->slots;
    size_t tokens = g->tokens, groups = g->groups, run = g->run, stride = g->stride;
    if (stride) {
        copy_tiles(g, b, scatter, nt, tile_buffer);
        return;
    }
    if (groups == 1 && g->so == run) { /* a token's row follows the previous slot's: one copy per run of slots */
        for (size_t t = 0; t < tokens;) {
            size_t n = slot_run(g, slots, t, tokens);
            char *p = paged + token_at(g, slots[t]);
            if (scatter)
                copy_bytes_pf(p, b, n * run, nt, b + PREFETCH_AHEAD);
            else
                copy_bytes_pf(b, p, n * run, nt, t + n < tokens ? paged + token_at(g, slots[t + n]) : NULL);
            b += n * run;
            t += n;
        }
        return;
    }
    switch (run) { /* fixed sizes the compiler inlines (the common head and token sizes) */
    case 128: COPY_ROWS(128); return;
    case 256: COPY_ROWS(256); return;
    default: COPY_ROWS(run); return;
    }
}

typedef struct {
    const segment_t *seg;
    size_t first, last;
    int scatter, nt;
} copy_job;

/* vLLM's CUDA layout keeps a token's K and V of one head side by side in one row (K then V):
 * copying the K segment and the V segment of a layer separately reads (or fills) each row's
 * cache lines twice, half each time. Paired, they move together, a block's page in address
 * order. Segments come K then V of each layer (paged_native orders them so for copy_segments). */
static int pairs_with(const segment_t *k, const segment_t *v) {
    return !k->stride && !v->stride && k->paged == v->paged && k->slots == v->slots && k->tokens == v->tokens &&
           k->block_size == v->block_size && k->groups == v->groups && k->sb == v->sb && k->so == v->so &&
           k->sh == v->sh && k->run == v->run && v->a == k->a + k->run;
}

#define PAIR_PREFETCH_TOKENS 8
static void copy_pair(const segment_t *gk, const segment_t *gv, int scatter, int nt) {
    char *paged = (char *)(uintptr_t)gk->paged;
    char *bk = (char *)(uintptr_t)gk->blob, *bv = (char *)(uintptr_t)gv->blob;
    const int64_t *slots = (const int64_t *)(uintptr_t)gk->slots;
    size_t tokens = gk->tokens, groups = gk->groups, run = gk->run, so = gk->so;
    for (size_t t = 0; t < tokens;) {
        size_t n = slot_run(gk, slots, t, tokens);
        char *p0 = paged + token_at(gk, slots[t]);
        for (size_t k = 0; k < n; k++) {
            char *p = p0 + k * so;
            if (!scatter && t + k + PAIR_PREFETCH_TOKENS < tokens) { /* a token's rows, a few tokens ahead */
                const char *q = paged + token_at(gk, slots[t + k + PAIR_PREFETCH_TOKENS]);
                for (size_t gi = 0; gi < groups; gi++, q += gk->sh) prefetch_bytes(q, 2 * run);
            }
            for (size_t gi = 0; gi < groups; gi++, p += gk->sh) {
                size_t at = ((t + k) * groups + gi) * run;
                if (scatter) {
                    copy_bytes_pf(p, bk + at, run, nt, bk + at + PREFETCH_AHEAD);
                    copy_bytes_pf(p + run, bv + at, run, nt, bv + at + PREFETCH_AHEAD);
                } else {
                    copy_bytes(bk + at, p, run, nt);
                    copy_bytes(bv + at, p + run, run, nt);
                }
            }
        }
        t += n;
    }
}

/* vLLM's CPU layout keeps a (block, head) page as K^T [D, block_size] then V [block_size, D]:
 * copied apart, the K segment and the V segment of a layer each fill half of every page in a
 * pass of its own. Paired, a run that fills a block moves a whole page at a time: scattering,
 * its K rows are transposed and its V rows put after them in a buffer, written to the page in
 * one contiguous copy; gathering, the page's two halves are read in order into token-major K and
 * V rows, each written to the blob at once. Other runs go as the unpaired segments would. */
static int pairs_transposed(const segment_t *k, const segment_t *v) {
    return k->stride && !v->stride && k->paged == v->paged && k->slots == v->slots && k->tokens == v->tokens &&
           k->block_size == v->block_size && k->groups == v->groups && k->sb == v->sb && k->sh == v->sh &&
           k->run == v->run && k->elem == v->elem && k->so == k->elem && k->stride == k->block_size * k->elem &&
           v->so == v->run && v->a == k->a + (k->run / k->elem) * k->stride;
}

static void copy_page_pair(const segment_t *gk, const segment_t *gv, int scatter, int nt, char *buffer) {
    char *paged = (char *)(uintptr_t)gk->paged;
    char *bk = (char *)(uintptr_t)gk->blob, *bv = (char *)(uintptr_t)gv->blob;
    const int64_t *slots = (const int64_t *)(uintptr_t)gk->slots;
    size_t tokens = gk->tokens, groups = gk->groups, run = gk->run, elem = gk->elem, stride = gk->stride;
    size_t bs = gk->block_size, channels = run / elem, token_bytes = groups * run;
    size_t half = channels * stride, page = 2 * half; /* K^T's bytes; the page's */
    for (size_t t = 0; t < tokens;) {
        size_t n = slot_run(gk, slots, t, tokens);
        int whole = n == bs && (uint64_t)slots[t] % bs == 0;
        if (!buffer || !whole || page > TILE_BUFFER || (!scatter && 2 * token_bytes > TILE_BUFFER)) {
            tiles_run(gk, t, n, bk + t * token_bytes, scatter, nt, buffer);
            segment_t v = *gv; /* this run of the V segment, as copy_segment would move it */
            v.blob = (uint64_t)(uintptr_t)(bv + t * token_bytes), v.tokens = n, v.slots = (uint64_t)(uintptr_t)(slots + t);
            copy_segment(&v, scatter, nt, NULL);
            t += n;
            continue;
        }
        char *rk = bk + t * token_bytes, *rv = bv + t * token_bytes; /* the run's blob rows */
        size_t share = n * token_bytes / groups; /* the next run's blob rows, a head's share at a time */
        const char *next_page = t + n < tokens ? paged + token_at(gk, slots[t + n]) : NULL;
        if (scatter && nt && run % 64 == 0) { /* whole lines: straight into the page, none read first */
            for (size_t gi = 0; gi < groups; gi++) {
                char *p = paged + row_at(gk, slots[t], gi);
                const char *pk = t + n < tokens ? rk + n * token_bytes + gi * share : NULL; /* K, V rows to come */
                if (!transpose_nt(p, stride, rk + gi * run, token_bytes, n, channels, elem, pk))
                    transpose_tile(p, stride, rk + gi * run, token_bytes, n, channels, elem);
                for (size_t k = 0; k < n; k++)
                    copy_bytes_pf(p + half + k * run, rv + k * token_bytes + gi * run, run, 1,
                                  pk ? rv + n * token_bytes + gi * share + k * run : NULL);
            }
        } else if (scatter) {
            for (size_t gi = 0; gi < groups; gi++) {
                transpose_tile(buffer, stride, rk + gi * run, token_bytes, n, channels, elem);
                for (size_t k = 0; k < n; k++) memcpy(buffer + half + k * run, rv + k * token_bytes + gi * run, run);
                copy_bytes(paged + row_at(gk, slots[t], gi), buffer, page, nt);
            }
        } else {
            /* Gathering, through the buffer, as many tokens at a time as half of it holds: the
             * page is read in order into token-major K and V rows there, each then written to the
             * blob in one stretch (whole lines, non-temporal in a large call) while the next
             * run's pages are prefetched, a line per line written. (Transposed straight into the
             * blob, 16 bytes to each of 8 token rows per tile, the non-temporal stores fill 16
             * lines at once, more than the write-combining buffers hold: measured 2x slower at
             * 2,048 tokens.) */
            char *kb = buffer, *vb = buffer + TILE_BUFFER / 2;
            for (size_t k0 = 0, m; k0 < n; k0 += m) {
                m = n - k0 < TILE_BUFFER / 2 / token_bytes ? n - k0 : TILE_BUFFER / 2 / token_bytes;
                for (size_t gi = 0; gi < groups; gi++) {
                    const char *p = paged + row_at(gk, slots[t], gi);
                    transpose_tile(kb + gi * run, token_bytes, p + k0 * elem, stride, channels, m, elem);
                    for (size_t k = 0; k < m; k++) memcpy(vb + k * token_bytes + gi * run, p + half + (k0 + k) * run, run);
                }
                /* (a whole run in one go, its heads' pages adjacent: the next block's pages are
                 * as many bytes as this run's K and V rows) */
                const char *pf = m == n && next_page && gk->sh == page ? next_page : NULL;
                copy_bytes_pf(rk + k0 * token_bytes, kb, m * token_bytes, nt, pf);
                copy_bytes_pf(rv + k0 * token_bytes, vb, m * token_bytes, nt, pf ? pf + m * token_bytes : NULL);
            }
        }
        t += n;
    }
}

static void *copy_work(void *arg) {
    copy_job *j = (copy_job *)arg;
    char *tile_buffer = NULL; /* one per thread and call, for transposed pages */
    for (size_t k = j->first; k < j->last; k++) {
        if (k + 1 < j->last && pairs_with(&j->seg[k], &j->seg[k + 1])) {
            copy_pair(&j->seg[k], &j->seg[k + 1], j->scatter, j->nt);
            k++;
        } else if (k + 1 < j->last && pairs_transposed(&j->seg[k], &j->seg[k + 1])) {
            if (!tile_buffer) tile_buffer = tile_take();
            copy_page_pair(&j->seg[k], &j->seg[k + 1], j->scatter, j->nt, tile_buffer);
            k++;
        } else {
            if (j->seg[k].stride && !tile_buffer) tile_buffer = tile_take();
            copy_segment(&j->seg[k], j->scatter, j->nt, tile_buffer);
        }
    }
    tile_give(tile_buffer);
    store_fence();
    return NULL;
}

static size_t segments_bytes(const segment_t *seg, size_t n) {
    size_t total = 0;
    for (size_t k = 0; k < n; k++) total += (size_t)(seg[k].tokens * seg[k].groups * seg[k].run);
    return total;
}

/* Jobs are taken one at a time by whichever thread is free (this one among them), not dealt
 * out one per thread: a worker that wakes late (an idle virtual CPU takes tens of microseconds)
 * then takes fewer instead of holding up the call. */
typedef struct {
    void *(*fn)(void *);
    char *jobs;
    size_t job_size;
    int count, next; /* next: the next job to take (atomic) */
} job_set;

static void take_jobs(job_set *set) {
    for (int i; (i = __atomic_fetch_add(&set->next, 1, __ATOMIC_RELAXED)) < set->count;)
        set->fn(set->jobs + (size_t)i * set->job_size);
}

static void *take_jobs_thread(void *set) {
    take_jobs((job_set *)set);
    return NULL;
}

/* Worker threads, started on first use and kept: starting threads on every call cost as much as
 * a 256-token chunk's copy. One call at a time uses them (`pool_owner`); a call that finds them
 * busy starts threads of its own. A forked child starts with none (pthread_atfork). */
static pthread_mutex_t pool_owner = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_work = PTHREAD_COND_INITIALIZER, pool_done = PTHREAD_COND_INITIALIZER;
static int pool_workers = 0, pool_active = 0; /* started; taking jobs of the posted set now */
static job_set *pool_set = NULL;             /* the call's jobs while it runs, else NULL */
static unsigned long pool_round = 0;

static void *pool_worker(void *arg) {
    (void)arg;
    pthread_mutex_lock(&pool_lock);
    for (unsigned long seen = pool_round;; seen = pool_round) {
        while (pool_round == seen) pthread_cond_wait(&pool_work, &pool_lock);
        job_set *set = pool_set;
        if (!set) continue; /* woke after the call ended */
        pool_active++;
        pthread_mutex_unlock(&pool_lock);
        take_jobs(set);
        pthread_mutex_lock(&pool_lock);
        if (--pool_active == 0) pthread_cond_signal(&pool_done);
    }
    return NULL;
}

static void pool_forked_child(void) {
    pthread_mutex_init(&pool_owner, NULL);
    pthread_mutex_init(&pool_lock, NULL);
    pthread_cond_init(&pool_work, NULL);
    pthread_cond_init(&pool_done, NULL);
    pool_workers = pool_active = 0;
    pool_set = NULL;
}

/* Run fn over jobs[0..count) on up to `threads` threads, this one among them, the GIL released
 * by the caller. */
static void run_jobs(void *(*fn)(void *), void *jobs, size_t job_size, int count, int threads) {
    job_set set = {fn, (char *)jobs, job_size, count, 0};
    if (threads > count) threads = count;
    if (threads <= 1) {
        take_jobs(&set);
        return;
    }
    if (pthread_mutex_trylock(&pool_owner) == 0) {
        while (pool_workers < threads - 1) { /* (none started: this thread runs every job itself) */
            pthread_t tid;
            if (pthread_create(&tid, NULL, pool_worker, NULL) != 0) break;
            pthread_detach(tid);
            pool_workers++;
        }
        pthread_mutex_lock(&pool_lock);
        pool_set = &set;
        pool_round++;
        pthread_cond_broadcast(&pool_work);
        pthread_mutex_unlock(&pool_lock);
        take_jobs(&set);
        pthread_mutex_lock(&pool_lock);
        pool_set = NULL; /* workers that wake from now on find nothing */
        while (pool_active) pthread_cond_wait(&pool_done, &pool_lock);
        pthread_mutex_unlock(&pool_lock);
        pthread_mutex_unlock(&pool_owner);
        return;
    }
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&tids[t], NULL, take_jobs_thread, &set) == 0;
    take_jobs(&set);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(tids[t], NULL);
}

static int clamp_threads(int threads, size_t n) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if ((size_t)threads > n) threads = n ? (int)n : 1;
    return threads;
}

/* How many jobs a call of n segments makes for `threads` threads (see job_set). */
#define JOBS_PER_THREAD 4
#define MAX_JOBS (MAX_THREADS * JOBS_PER_THREAD)
static int job_count(int threads, size_t n) {
    size_t count = threads > 1 ? (size_t)threads * JOBS_PER_THREAD : 1;
    return (int)(count < n ? count : (n ? n : 1));
}

static PyObject *py_copy_segments(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer segs;
    int scatter, threads;
    unsigned long long base = 0, tokens = 0, slots = 0;
    if (!PyArg_ParseTuple(args, "y*ii|KKK", &segs, &scatter, &threads, &base, &tokens, &slots)) return NULL;
    PyObject *result = NULL;
    segment_t stack[STACK_SEGMENTS];
    size_t n;
    segment_t *seg = call_segments(&segs, base, tokens, slots, stack, &n);
    if (!seg) goto done;
    if (!segments_ok(seg, n)) {
        PyErr_SetString(PyExc_IndexError, "copy_segments: a slot is out of range or a segment is malformed");
        goto done;
    }
    threads = clamp_threads(threads, n);
    int count = job_count(threads, n);
    copy_job jobs[MAX_JOBS];
    int nt = segments_bytes(seg, n) >= nontemporal_min;
    for (int j = 0; j < count; j++) { /* even bounds: a layer's K and V segments stay in one job (paired) */
        size_t first = j ? (n * j / count) & ~(size_t)1 : 0, last = j + 1 < count ? (n * (j + 1) / count) & ~(size_t)1 : n;
        jobs[j] = (copy_job){seg, first, last, scatter, nt};
    }
    Py_BEGIN_ALLOW_THREADS
    run_jobs(copy_work, jobs, sizeof(copy_job), count, threads);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    release_segments(seg, &segs, stack);
    PyBuffer_Release(&segs);
    return result;
}

/* ---- scatter_checked ---------------------------------------------------------------------- */

/* The finiteness check that rides on a checked copy (a NaN chunk with a valid CRC reached the
 * model). `kind` 0: none; 1 bf16, 2 fp16, 3 fp32: a value is NaN or infinite exactly when all of
 * its exponent bits are set. The CRC stream flags them on its own loads (crc32c_stream_values);
 * the scans below serve the strided path (which checksums what it wrote) and `nonfinite`. `bad`
 * is non-zero when one was found. */
typedef struct {
    int kind;
    uint64_t bad;
} finite_t;

typedef uint16_t u16_any __attribute__((aligned(1)));
typedef uint32_t u32_any __attribute__((aligned(1)));

/* Whether any value is NaN or infinite, in one pass that vectorises: with its exponent bits all
 * set, (x & mask) + lowest mask bit carries into the top bit (bf16: 0x7F80 + 0x0080 = 0x8000; any
 * other exponent stays below it), so the flags OR together in lanes of the value's own width. */
static int any_nonfinite(const uint8_t *p, size_t n, int kind) {
    if (kind == 1 || kind == 2) {
        const uint16_t mask = kind == 1 ? 0x7F80u : 0x7C00u, low = kind == 1 ? 0x0080u : 0x0400u;
        const u16_any *q = (const u16_any *)p;
        uint16_t flags = 0;
        for (size_t i = 0; i < n / 2; i++) flags |= (uint16_t)((q[i] & mask) + low);
        return (flags & 0x8000u) != 0;
    }
    if (kind == 3) {
        const u32_any *q = (const u32_any *)p;
        uint32_t flags = 0;
        for (size_t i = 0; i < n / 4; i++) flags |= (q[i] & 0x7F800000u) + 0x00800000u;
        return (flags & 0x80000000u) != 0;
    }
    return 0;
}

/* How many values are NaN or infinite (counted only once one is found: the rare case). */
static uint64_t count_nonfinite(const uint8_t *p, size_t n, int kind) {
    if (!any_nonfinite(p, n, kind)) return 0;
    uint64_t bad = 0;
    if (kind == 1 || kind == 2) {
        const uint16_t mask = kind == 1 ? 0x7F80u : 0x7C00u;
        const u16_any *q = (const u16_any *)p;
        for (size_t i = 0; i < n / 2; i++) bad += (q[i] & mask) == mask;
    } else {
        const u32_any *q = (const u32_any *)p;
        for (size_t i = 0; i < n / 4; i++) bad += (q[i] & 0x7F800000u) == 0x7F800000u;
    }
    return bad;
}

typedef struct {
    const segment_t *seg;
    size_t first, last;          /* segments [first, last) */
    const uint8_t *begin, *end;  /* this part of the payload */
    int nt;
    uint32_t crc;
    finite_t fin;
} part_t;

/* Segments [first, last) copied from the payload bytes [begin, end) into their pages, every byte
 * of [begin, end) (those between and after the segments too) run through the CRC stream `s`.
 * `rows`, `page`: tile buffers for transposed pages, or NULL. */
static void check_segments(crc32c_stream *s, finite_t *fin, const segment_t *seg, size_t first, size_t last,
                           const uint8_t *begin, const uint8_t *end, int nt, uint8_t *rows, uint8_t *page) {
    const uint8_t *pos = begin;
    for (size_t k = first; k < last; k++) {
        const segment_t *g = &seg[k];
        const uint8_t *b = (const uint8_t *)(uintptr_t)g->blob;
        uint8_t *paged = (uint8_t *)(uintptr_t)g->paged;
        const int64_t *slots = (const int64_t *)(uintptr_t)g->slots;
        crc32c_stream_copy(s, NULL, pos, (size_t)(b - pos), 0); /* bytes between segments */
        size_t token_bytes = (size_t)(g->groups * g->run);
        if (g->stride && rows && token_bytes <= TILE_BUFFER) {
            /* transposed rows: a run's blob rows are checked as they are copied into a buffer,
             * and its tiles move from there (the bytes written are the bytes checked) */
            for (size_t t = 0; t < g->tokens;) {
                size_t n = slot_run(g, slots, t, (size_t)g->tokens);
                if (n * token_bytes > TILE_BUFFER) n = TILE_BUFFER / token_bytes;
                crc32c_stream_copy(s, rows, b, n * token_bytes, 0);
                tiles_run(g, t, n, (char *)rows, 1, nt, (char *)page);
                b += n * token_bytes;
                t += n;
            }
        } else if (g->stride) {
            /* no buffer: copy in tiles, then checksum what was written, in blob order (the bytes
             * checked are still the bytes loaded; the paged side is private to this load) */
            if (fin && fin->kind) fin->bad += count_nonfinite(b, g->tokens * g->groups * (size_t)g->run, fin->kind);
            copy_segment(g, 1, 0, NULL);
            if (fin) fin->bad += (uint64_t)crc32c_stream_nonfinite(s); /* (begin below clears its flags) */
            crc32c_state r = crc32c_stream_end(s);
            for (size_t t = 0; t < g->tokens; t++)
                for (size_t gi = 0; gi < g->groups; gi++, b += g->run)
                    r = crc32c_update_strided(r, paged + row_at(g, slots[t], gi), (size_t)g->stride,
                                              (size_t)g->run, (size_t)g->elem);
            crc32c_stream_begin(s, r);
            if (fin) crc32c_stream_values(s, fin->kind);
        } else {
            int merge = g->groups == 1 && g->so == g->run; /* adjacent slots: one copy per run of them */
            for (size_t t = 0; t < g->tokens;) {
                size_t n = merge ? slot_run(g, slots, t, (size_t)g->tokens) : 1;
                uint8_t *row = paged + token_at(g, slots[t]);
                if (merge) {
                    crc32c_stream_copy(s, row, b, n * (size_t)g->run, nt);
                    b += n * g->run;
                } else {
                    for (size_t gi = 0; gi < g->groups; gi++, b += g->run, row += g->sh)
                        crc32c_stream_copy(s, row, b, (size_t)g->run, nt);
                }
                t += n;
            }
        }
        pos = b;
    }
    crc32c_stream_copy(s, NULL, pos, (size_t)(end - pos), 0);
}

/* Tile buffers for a part's transposed pages (both or neither), NULL when it has none. */
static void take_row_buffers(const segment_t *seg, size_t first, size_t last, uint8_t **rows, uint8_t **page) {
    *rows = *page = NULL;
    for (size_t k = first; k < last && !*rows; k++)
        if (seg[k].stride) {
            *rows = (uint8_t *)tile_take();
            if (*rows) *page = (uint8_t *)tile_take(); /* without `rows` no buffer is used */
        }
}

/* Split a payload [lo, lo + length) of n segments into `count` parts, each the part_t that begins
 * a job of `job_size` bytes at `jobs`: part j starts at the first segment whose start is at or
 * past j/count of the payload. */
static void split_payload(char *jobs, size_t job_size, int count, const segment_t *seg, size_t n, const uint8_t *lo,
                          uint64_t length, int nt) {
    const uint8_t *hi = lo + length;
    part_t *previous = NULL;
    size_t k = 0;
    for (int t = 0; t < count; t++) {
        const uint8_t *mark = lo + length * (uint64_t)t / (uint64_t)count;
        while (t > 0 && k < n && (const uint8_t *)(uintptr_t)seg[k].blob < mark) k++;
        const uint8_t *begin = t == 0 ? lo : (k < n ? (const uint8_t *)(uintptr_t)seg[k].blob : hi);
        part_t *part = (part_t *)(jobs + (size_t)t * job_size);
        *part = (part_t){seg, k, n, begin, hi, nt, 0, {0, 0}};
        if (previous) previous->last = k, previous->end = begin;
        previous = part;
    }
}

/* The payload's CRC-32C from its parts' (split_payload's jobs, in order). */
static uint32_t combine_parts(const char *jobs, size_t job_size, int count) {
    const part_t *first = (const part_t *)jobs;
    uint32_t crc = first->crc;
    for (int t = 1; t < count; t++) {
        const part_t *part = (const part_t *)(jobs + (size_t)t * job_size);
        crc = crc32c_combine(crc, part->crc, (uint64_t)(part->end - part->begin));
    }
    return crc;
}

/* A part of a checked scatter, with its tile buffers; the payload read through a fault guard
 * (`lo`, `hi`: the addresses it answers for), so that a mapped file cut short under the copy
 * ends the part (`faulted`) instead of the process. */
typedef struct {
    part_t part;
    const uint8_t *lo, *hi;
    int guarded, faulted;
    uint8_t *rows, *page;
} guarded_part_t;

static void check_part_in(void *arg) {
    guarded_part_t *g = (guarded_part_t *)arg;
    part_t *p = &g->part;
    crc32c_stream s;
    crc32c_stream_begin(&s, crc32c_begin());
    crc32c_stream_values(&s, p->fin.kind);
    check_segments(&s, &p->fin, p->seg, p->first, p->last, p->begin, p->end, p->nt, g->rows, g->page);
    p->fin.bad += (uint64_t)crc32c_stream_nonfinite(&s);
    p->crc = crc32c_end(crc32c_stream_end(&s));
}

static void *check_part(void *arg) {
    guarded_part_t *g = (guarded_part_t *)arg;
    take_row_buffers(g->part.seg, g->part.first, g->part.last, &g->rows, &g->page);
    if (g->guarded)
        g->faulted = fault_guarded(check_part_in, g, g->lo, g->hi);
    else
        check_part_in(g);
    store_fence();
    tile_give((char *)g->rows); /* (taken outside the guard: a fault does not lose them) */
    tile_give((char *)g->page);
    return NULL;
}

/* Segments' blobs inside [lo, hi), ascending, apart. */
static int inside_payload(const segment_t *seg, size_t n, const uint8_t *lo, const uint8_t *hi) {
    const uint8_t *pos = lo;
    for (size_t k = 0; k < n; k++) {
        const uint8_t *blob = (const uint8_t *)(uintptr_t)seg[k].blob;
        unsigned __int128 bytes = (unsigned __int128)seg[k].tokens * seg[k].groups * seg[k].run;
        if (blob < pos || blob > hi || bytes > (unsigned __int128)(hi - blob)) return 0;
        pos = blob + (size_t)bytes;
    }
    return 1;
}

/* scatter_checked of the payload [lo, lo + length) with the segments in `segs` (blobs at `base`
 * on; a template's with tokens and slots): 0 and the payload's CRC-32C in *crc, or -1 with an
 * exception set (`what` names the call). A fault on the payload while it is read (a mapped file
 * cut short) is an EOFError. */
static int checked_scatter(Py_buffer *segs, const uint8_t *lo, uint64_t length, int threads, unsigned long long base,
                           unsigned long long tokens, unsigned long long slots, const char *what, uint32_t *crc,
                           int finite, uint64_t *bad) {
    int ok = -1;
    segment_t stack[STACK_SEGMENTS];
    size_t n;
    segment_t *seg = call_segments(segs, base, tokens, slots, stack, &n);
    const uint8_t *hi = lo + length;
    if (!seg) goto done;
    if (!segments_ok(seg, n) || !inside_payload(seg, n, lo, hi)) {
        PyErr_Format(PyExc_IndexError, "%s: a segment lies outside the payload, out of order, or has a slot out "
                                       "of range", what);
        goto done;
    }
    threads = clamp_threads(threads, n);
    int count = job_count(threads, n);
    int nt = length >= nontemporal_min;
    int guarded = fault_guard_ready(); /* (without it, as before: a mapped payload is not guarded) */
    guarded_part_t parts[MAX_JOBS];
    split_payload((char *)parts, sizeof(guarded_part_t), count, seg, n, lo, length, nt);
    for (int t = 0; t < count; t++)
        parts[t].lo = lo, parts[t].hi = hi, parts[t].guarded = guarded, parts[t].faulted = 0,
        parts[t].rows = parts[t].page = NULL, parts[t].part.fin.kind = finite;
    Py_BEGIN_ALLOW_THREADS
    run_jobs(check_part, parts, sizeof(guarded_part_t), count, threads);
    Py_END_ALLOW_THREADS
    for (int t = 0; t < count; t++)
        if (parts[t].faulted) {
            PyErr_Format(PyExc_EOFError, "%s: the payload's file ended under the copy", what);
            goto done;
        }
    *crc = combine_parts((const char *)parts, sizeof(guarded_part_t), count);
    *bad = 0;
    for (int t = 0; t < count; t++) *bad += parts[t].part.fin.bad;
    ok = 0;
done:
    release_segments(seg, segs, stack);
    return ok;
}

/* What a checked copy returns: its CRC-32C; with a finiteness check asked for (`finite` > 0),
 * (CRC-32C, how many values are NaN or infinite). */
static PyObject *checked_result(uint32_t crc, int finite, uint64_t bad) {
    if (!finite) return PyLong_FromUnsignedLong(crc);
    return Py_BuildValue("(kK)", (unsigned long)crc, (unsigned long long)bad);
}

static PyObject *py_scatter_checked(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer segs, payload;
    int threads, finite = 0;
    unsigned long long base = 0, tokens = 0, slots = 0;
    if (!PyArg_ParseTuple(args, "y*y*i|KKKi", &segs, &payload, &threads, &base, &tokens, &slots, &finite)) return NULL;
    uint32_t crc;
    uint64_t bad = 0;
    int ok = checked_scatter(&segs, (const uint8_t *)payload.buf, (uint64_t)payload.len, threads, base, tokens, slots,
                             "scatter_checked", &crc, finite, &bad);
    PyBuffer_Release(&segs);
    PyBuffer_Release(&payload);
    return ok == 0 ? checked_result(crc, finite, bad) : NULL;
}

/* ---- scatter_checked_many ------------------------------------------------------------------ */

/* scatter_checked of several payloads (a load's chunks) in one call: each payload's segments are
 * the template's with its own blob (the payload), token count and slots, every payload split into
 * parts that any of the call's threads takes (a thread that finishes early takes the next part,
 * of whatever payload), every part read behind the fault guard. Per payload: (CRC-32C, values not
 * finite), or None when its mapping faulted under the copy (a file cut short). One call instead
 * of one per chunk: a load's chunk-by-chunk hand-offs between Python threads (the GIL taken and
 * given, the pool woken per chunk) cost the default model's 5.9 MB chunks about a quarter of
 * their copy time. What the payloads hold is checked by the caller against each one's CRC. */
typedef struct {
    guarded_part_t *parts; /* `count` parts, in payload order */
    int count;
    segment_t *seg;        /* its segments (the template's, filled in) */
} many_item_t;

static PyObject *py_scatter_checked_many(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer segs, items;
    PyObject *payloads;
    int threads, finite = 0;
    if (!PyArg_ParseTuple(args, "y*Oiy*|i", &segs, &payloads, &threads, &items, &finite)) return NULL;
    /* a tuple of its own: taking a payload's buffer may run Python code, which could change a list */
    PyObject *result = NULL, *seq = PySequence_Tuple(payloads);
    Py_ssize_t m = seq ? PyTuple_GET_SIZE(seq) : 0;
    Py_buffer *bufs = NULL;
    many_item_t *item = NULL;
    guarded_part_t *parts = NULL;
    Py_ssize_t held = 0;
    size_t n = (size_t)segs.len / sizeof(segment_t), total = 0;
    if (!seq) goto done;
    if (items.len != (Py_ssize_t)(2 * sizeof(uint64_t)) * m || segs.len % sizeof(segment_t) || !n) {
        PyErr_SetString(PyExc_IndexError, "scatter_checked_many: items must be (tokens, slots) per payload, "
                                          "segments whole");
        goto done;
    }
    bufs = (Py_buffer *)calloc(m ? (size_t)m : 1, sizeof(Py_buffer));
    item = (many_item_t *)calloc(m ? (size_t)m : 1, sizeof(many_item_t));
    if (!bufs || !item) {
        PyErr_NoMemory();
        goto done;
    }
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    /* enough parts that the threads end together: about JOBS_PER_THREAD each over the whole call */
    size_t per = m ? ((size_t)threads * JOBS_PER_THREAD + (size_t)m - 1) / (size_t)m : 1;
    if (threads == 1) per = 1;
    const uint64_t *it = (const uint64_t *)items.buf;
    for (Py_ssize_t i = 0; i < m; i++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(seq, i), &bufs[i], PyBUF_SIMPLE) < 0) goto done;
        held++;
        size_t count;
        segment_t *seg = call_segments(&segs, (unsigned long long)(uintptr_t)bufs[i].buf, it[2 * i], it[2 * i + 1],
                                       NULL, &count);
        if (!seg) goto done;
        item[i].seg = seg;
        const uint8_t *lo = (const uint8_t *)bufs[i].buf, *hi = lo + bufs[i].len;
        if (!bufs[i].buf || !segments_ok(seg, n) || !inside_payload(seg, n, lo, hi)) {
            PyErr_Format(PyExc_IndexError, "scatter_checked_many: payload %zd: a segment lies outside the payload, "
                                           "out of order, or has a slot out of range", i);
            goto done;
        }
        item[i].count = (int)(per < n ? per : n);
        total += (size_t)item[i].count;
    }
    parts = (guarded_part_t *)calloc(total ? total : 1, sizeof(guarded_part_t));
    if (!parts) {
        PyErr_NoMemory();
        goto done;
    }
    int guarded = fault_guard_ready();
    size_t next = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        const uint8_t *lo = (const uint8_t *)bufs[i].buf;
        uint64_t length = (uint64_t)bufs[i].len;
        item[i].parts = parts + next;
        split_payload((char *)item[i].parts, sizeof(guarded_part_t), item[i].count, item[i].seg, n, lo, length,
                      length >= nontemporal_min);
        for (int t = 0; t < item[i].count; t++) {
            guarded_part_t *g = &item[i].parts[t];
            g->lo = lo, g->hi = lo + length, g->guarded = guarded, g->part.fin.kind = finite;
        }
        next += (size_t)item[i].count;
    }
    Py_BEGIN_ALLOW_THREADS
    run_jobs(check_part, parts, sizeof(guarded_part_t), (int)total, threads);
    Py_END_ALLOW_THREADS
    result = PyList_New(m);
    for (Py_ssize_t i = 0; result && i < m; i++) {
        int faulted = 0;
        uint64_t bad = 0;
        for (int t = 0; t < item[i].count; t++) faulted |= item[i].parts[t].faulted, bad += item[i].parts[t].part.fin.bad;
        PyObject *one = faulted ? (Py_INCREF(Py_None), Py_None)
                                : Py_BuildValue("(kK)", (unsigned long)combine_parts((const char *)item[i].parts,
                                                                                     sizeof(guarded_part_t), item[i].count),
                                                (unsigned long long)bad);
        if (!one) Py_CLEAR(result);
        else PyList_SET_ITEM(result, i, one);
    }
done:
    free(parts);
    for (Py_ssize_t i = 0; item && i < m; i++) release_segments(item[i].seg, &segs, NULL);
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&bufs[i]);
    free(item);
    free(bufs);
    Py_XDECREF(seq);
    PyBuffer_Release(&segs);
    PyBuffer_Release(&items);
    return result;
}

/* ---- scatter_checked_file ------------------------------------------------------------------ */

/* The load of a stored chunk from a file another program may truncate or replace under it (a
 * store object). The payload is mapped and read through a fault guard (fault_guard.c): a file
 * cut short under the copy is an EOFError, refused like a file that ends early, where a plain
 * mapping would end the process with SIGBUS. That reads the bytes from the page cache once, as
 * a file's load does; a read into a buffer first reads them twice. Payloads under
 * `map_min_bytes`, and files that cannot be mapped or where the guard cannot be installed, are
 * read a window at a time into a buffer that stays in the L2 cache instead, and each window is
 * checked and scattered from there. For a 33.6 MB payload (an 8B model's 256-token chunk) windows
 * measured 1.2-1.3x slower than the mapping; for a 5.9 MB one (the default model's) they first
 * measured 6-10% faster (two runs), then, once the values check rode on the CRC's loads, 1.15x
 * slower at 2,048 tokens in three runs of three and slower at 8,192 in two of three (bench_load's
 * paired "every payload mapped / in windows" rows, 2026-11-26): the threshold is 4 MiB. Below it
 * (16-token chunks, ~370 KB) a mapping's page faults and unmapping cost more than they save. For the
 * windows, the segments' blobs are addresses in a virtual payload at FILE_BASE, rebased onto the
 * window. */
static uint64_t map_min_bytes = (uint64_t)4 << 20;
static unsigned long long file_maps = 0; /* payloads read from a mapping so far (tests) */

#define FILE_BASE ((uint64_t)1 << 20)
#define FILE_WINDOW TILE_BUFFER

typedef struct {
    part_t part;      /* begin/end: the part's virtual payload bytes */
    int fd;
    uint64_t offset;  /* the file offset of the payload's first byte */
    segment_t *subs;  /* room for the part's segments, rebased per window */
    int error;        /* 0, an errno, or -1: the file ended before the payload did */
} file_part_t;

static int read_fully(int fd, uint8_t *out, size_t n, uint64_t offset) {
    while (n) {
        ssize_t got = pread(fd, out, n, (off_t)offset);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return errno ? errno : EIO;
        if (got == 0) return -1;
        out += got, n -= (size_t)got, offset += (uint64_t)got;
    }
    return 0;
}

static void *check_file_part(void *arg) {
    file_part_t *f = (file_part_t *)arg;
    part_t *p = &f->part;
    uint8_t *rows, *page, *window = (uint8_t *)tile_take();
    take_row_buffers(p->seg, p->first, p->last, &rows, &page);
    crc32c_stream s;
    crc32c_stream_begin(&s, crc32c_begin());
    crc32c_stream_values(&s, p->fin.kind);
    if (!window) f->error = ENOMEM;
    size_t k = p->first, t = 0; /* the next token to move: token t of segment k */
    for (const uint8_t *pos = p->begin; pos < p->end && !f->error;) {
        const uint8_t *wend = (size_t)(p->end - pos) > FILE_WINDOW ? pos + FILE_WINDOW : p->end, *cut = wend;
        size_t n = 0;
        while (k < p->last) { /* the tokens that lie whole inside [pos, wend) */
            const segment_t *g = &p->seg[k];
            size_t token_bytes = (size_t)(g->groups * g->run);
            const uint8_t *at = (const uint8_t *)(uintptr_t)g->blob + t * token_bytes;
            if (at >= wend) break;
            size_t fit = (size_t)(wend - at) / token_bytes, take = g->tokens - t < fit ? g->tokens - t : fit;
            if (!take) { cut = at; break; } /* the window ends inside this token: read it next time */
            if (take < g->tokens - t) { /* end the window where a run of slots ends, not inside it
                                         * (a run is copied whole; transposed pages a block at a time) */
                const int64_t *r = (const int64_t *)(uintptr_t)g->slots + t;
                size_t keep = take;
                while (keep > 0 && r[keep] == r[keep - 1] + 1 && (uint64_t)r[keep] % g->block_size) keep--;
                if (keep) take = keep;
            }
            segment_t *sub = &f->subs[n++];
            *sub = *g;
            sub->blob = (uint64_t)(uintptr_t)window + (uint64_t)(at - pos);
            sub->slots = g->slots + t * sizeof(int64_t);
            sub->tokens = take;
            t += take;
            if (t < g->tokens) { cut = at + take * token_bytes; break; }
            k++, t = 0;
        }
        f->error = read_fully(f->fd, window, (size_t)(cut - pos), f->offset + (uint64_t)(pos - (const uint8_t *)(uintptr_t)FILE_BASE));
        if (!f->error) check_segments(&s, &p->fin, f->subs, 0, n, window, window + (cut - pos), p->nt, rows, page);
        pos = cut;
    }
    p->fin.bad += (uint64_t)crc32c_stream_nonfinite(&s);
    p->crc = crc32c_end(crc32c_stream_end(&s));
    store_fence();
    tile_give((char *)window);
    tile_give((char *)rows);
    tile_give((char *)page);
    return NULL;
}

/* scatter_checked_file(template, fd, offset, length, threads, tokens, slots) -> CRC-32C of the
 * payload: scatter_checked of the `length` bytes at `offset` in file `fd`, read a window at a time
 * (a template's call only). EOFError when the file ends first; OSError when a read fails. */
static PyObject *py_scatter_checked_file(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer segs;
    int fd, threads, finite = 0;
    unsigned long long offset, length, tokens, slots;
    uint64_t bad = 0;
    if (!PyArg_ParseTuple(args, "y*iKKiKK|i", &segs, &fd, &offset, &length, &threads, &tokens, &slots, &finite))
        return NULL;
    PyObject *result = NULL;
    long page_size = sysconf(_SC_PAGESIZE);
    uint64_t skew = page_size > 0 ? offset % (uint64_t)page_size : 0;
    if (length >= map_min_bytes && length && page_size > 0 && length <= SIZE_MAX - skew && offset <= (uint64_t)INT64_MAX &&
        fault_guard_ready()) {
        struct stat st;
        if (fstat(fd, &st) == 0 && ((uint64_t)st.st_size < offset || (uint64_t)st.st_size - offset < length)) {
            /* (read past its end, a mapping's last page holds zeros: refuse it as a short read) */
            PyBuffer_Release(&segs);
            PyErr_SetString(PyExc_EOFError, "scatter_checked_file: the file ended inside the payload");
            return NULL;
        }
        void *map = mmap(NULL, (size_t)(length + skew), PROT_READ, MAP_SHARED, fd, (off_t)(offset - skew));
        if (map != MAP_FAILED) {
            const uint8_t *lo = (const uint8_t *)map + skew;
            uint32_t crc;
            int ok = checked_scatter(&segs, lo, length, threads, (unsigned long long)(uintptr_t)lo, tokens, slots,
                                     "scatter_checked_file", &crc, finite, &bad);
            munmap(map, (size_t)(length + skew));
            PyBuffer_Release(&segs);
            file_maps++;
            if (ok == 0) return checked_result(crc, finite, bad);
            if (PyErr_ExceptionMatches(PyExc_EOFError)) {
                /* A fault on the mapping: the file ended (damage: refused) or, still as long, a
                 * page could not be read (an I/O error: the object is not to blame). */
                PyErr_Clear();
                if (fstat(fd, &st) == 0 && (uint64_t)st.st_size >= offset && (uint64_t)st.st_size - offset >= length) {
                    errno = EIO;
                    PyErr_SetFromErrno(PyExc_OSError);
                } else {
                    PyErr_SetString(PyExc_EOFError, "scatter_checked_file: the file ended inside the payload");
                }
            }
            return NULL;
        }
    }
    segment_t stack[STACK_SEGMENTS], *subs = NULL;
    size_t n;
    segment_t *seg = call_segments(&segs, FILE_BASE, tokens, slots, stack, &n);
    const uint8_t *lo = (const uint8_t *)(uintptr_t)FILE_BASE, *hi = lo + length;
    if (!seg) goto done;
    int fits = length <= UINT64_MAX - FILE_BASE;
    for (size_t k = 0; k < n && fits; k++) fits = seg[k].groups * seg[k].run <= FILE_WINDOW;
    if (!fits || !segments_ok(seg, n) || !inside_payload(seg, n, lo, hi)) {
        PyErr_SetString(PyExc_IndexError, "scatter_checked_file: a segment lies outside the payload, out of order, "
                                          "has a slot out of range, or a token larger than the read window");
        goto done;
    }
    subs = (segment_t *)malloc((n ? n : 1) * sizeof(segment_t));
    if (!subs) {
        PyErr_NoMemory();
        goto done;
    }
    threads = clamp_threads(threads, n);
    int count = job_count(threads, n);
    int nt = length >= nontemporal_min;
    file_part_t parts[MAX_JOBS];
    split_payload((char *)parts, sizeof(file_part_t), count, seg, n, lo, length, nt); /* as scatter_checked splits */
    for (int t = 0; t < count; t++)
        parts[t].fd = fd, parts[t].offset = offset, parts[t].subs = subs + parts[t].part.first, parts[t].error = 0,
        parts[t].part.fin.kind = finite;
    Py_BEGIN_ALLOW_THREADS
    run_jobs(check_file_part, parts, sizeof(file_part_t), count, threads);
    Py_END_ALLOW_THREADS
    for (int t = 0; t < count; t++) {
        if (parts[t].error == -1) {
            PyErr_SetString(PyExc_EOFError, "scatter_checked_file: the file ended inside the payload");
            goto done;
        }
        if (parts[t].error) {
            errno = parts[t].error;
            PyErr_SetFromErrno(PyExc_OSError);
            goto done;
        }
    }
    for (int t = 0; t < count; t++) bad += parts[t].part.fin.bad;
    result = checked_result(combine_parts((const char *)parts, sizeof(file_part_t), count), finite, bad);
done:
    free(subs);
    release_segments(seg, &segs, stack);
    PyBuffer_Release(&segs);
    return result;
}

typedef struct {
    crc32c_stream *s;
    void *dst;
    const void *src;
    size_t n;
    int nt;
    finite_t fin;
} checked_copy_t;

static void checked_copy_in(void *arg) {
    checked_copy_t *c = (checked_copy_t *)arg;
    crc32c_stream_values(c->s, c->fin.kind);
    crc32c_stream_copy(c->s, c->dst, c->src, c->n, c->nt);
    c->fin.bad = (uint64_t)crc32c_stream_nonfinite(c->s);
}

/* copy_checked(dst, src) -> CRC-32C of src, copied into dst (the same size) in the same pass;
 * src read through the fault guard (a mapped file cut short under the copy: EOFError) */
static PyObject *py_copy_checked(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer dst, src;
    int finite = 0;
    if (!PyArg_ParseTuple(args, "w*y*|i", &dst, &src, &finite)) return NULL;
    PyObject *result = NULL;
    if (dst.len != src.len) {
        PyErr_SetString(PyExc_ValueError, "copy_checked: the buffers differ in size");
    } else {
        crc32c_stream s;
        crc32c_stream_begin(&s, crc32c_begin());
        int nt = (size_t)src.len >= nontemporal_min; /* read with the GIL held, as its setter writes it */
        int guarded = fault_guard_ready(), faulted = 0;
        checked_copy_t copy = {&s, dst.buf, src.buf, (size_t)src.len, nt, {finite, 0}};
        const char *lo = (const char *)src.buf;
        Py_BEGIN_ALLOW_THREADS
        if (guarded)
            faulted = fault_guarded(checked_copy_in, &copy, lo, lo + src.len);
        else
            checked_copy_in(&copy);
        store_fence();
        Py_END_ALLOW_THREADS
        if (faulted)
            PyErr_SetString(PyExc_EOFError, "copy_checked: the source's file ended under the copy");
        else
            result = checked_result(crc32c_end(crc32c_stream_end(&s)), finite, copy.fin.bad);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

/* checked(buffer, kind) -> (CRC-32C, values not finite: 0, or more) of a buffer, in one pass (the
 * check of bytes already read into a buffer of our own: nothing to copy) */
static PyObject *py_checked(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer src;
    int finite = 0;
    if (!PyArg_ParseTuple(args, "y*|i", &src, &finite)) return NULL;
    crc32c_stream s;
    crc32c_stream_begin(&s, crc32c_begin());
    checked_copy_t copy = {&s, NULL, src.buf, (size_t)src.len, 0, {finite, 0}};
    Py_BEGIN_ALLOW_THREADS
    checked_copy_in(&copy);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    return Py_BuildValue("(kK)", (unsigned long)crc32c_end(crc32c_stream_end(&s)), (unsigned long long)copy.fin.bad);
}

/* nonfinite(buffer, kind) -> how many of its values (kind 1 bf16, 2 fp16, 3 fp32) are NaN or
 * infinite: the check of a chunk that did not come through a checked copy (a decoded one). */
static PyObject *py_nonfinite(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data;
    int kind;
    if (!PyArg_ParseTuple(args, "y*i", &data, &kind)) return NULL;
    uint64_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = count_nonfinite((const uint8_t *)data.buf, (size_t)data.len, kind);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong(bad);
}

/* slots_ok(slots, count, num_slots, distinct): `slots` the address of `count` int64 (a live tensor's) */
static PyObject *py_slots_ok(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long address, count;
    long long num_slots;
    int distinct;
    if (!PyArg_ParseTuple(args, "KKLp", &address, &count, &num_slots, &distinct)) return NULL;
    if (!address && count) {
        PyErr_SetString(PyExc_ValueError, "slots_ok: no slots");
        return NULL;
    }
    int ok = slots_in_range_distinct((const int64_t *)(uintptr_t)address, (size_t)count, num_slots, distinct);
    if (ok < 0) return PyErr_NoMemory();
    return PyBool_FromLong(ok);
}

/* ---- CRC-32C itself, for tests -------------------------------------------------------------- */

static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
    crc32c_state s = crc32c_begin();
    Py_BEGIN_ALLOW_THREADS
    s = crc32c_update(s, data.buf, (size_t)data.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(crc32c_end(s));
}

static PyObject *py_crc32c_combine(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long a, b;
    unsigned long long len;
    if (!PyArg_ParseTuple(args, "kkK", &a, &b, &len)) return NULL;
    return PyLong_FromUnsignedLong(crc32c_combine((uint32_t)a, (uint32_t)b, len));
}

static PyObject *py_crc32c_level(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    return PyLong_FromLong(crc32c_level());
}

static PyObject *py_crc32c_set_level(PyObject *self, PyObject *args) {
    (void)self;
    int highest;
    if (!PyArg_ParseTuple(args, "i", &highest)) return NULL;
    return PyLong_FromLong(crc32c_init(highest));
}

static PyObject *py_nontemporal_min(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long bytes;
    if (!PyArg_ParseTuple(args, "K", &bytes)) return NULL;
    size_t previous = nontemporal_min;
    nontemporal_min = (size_t)bytes;
    return PyLong_FromSize_t(previous);
}

/* stream_width(bits) -> the non-temporal store width in effect after asking for at most `bits`
 * (tests take every width the CPU has; 0 where there are no SSE2 stores at all) */
static PyObject *py_stream_width(PyObject *self, PyObject *args) {
    (void)self;
    int bits;
    if (!PyArg_ParseTuple(args, "i", &bits)) return NULL;
#ifdef HAVE_SSE2
    return PyLong_FromLong(pick_stream_lines(bits));
#else
    return PyLong_FromLong(0);
#endif
}

static PyObject *py_map_min_bytes(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long bytes;
    if (!PyArg_ParseTuple(args, "K", &bytes)) return NULL;
    uint64_t before = map_min_bytes;
    map_min_bytes = bytes;
    return PyLong_FromUnsignedLongLong(before);
}

static PyObject *py_file_maps(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    return PyLong_FromUnsignedLongLong(file_maps);
}

static PyMethodDef methods[] = {
    {"copy_segments", py_copy_segments, METH_VARARGS, "Move rows between paged KV tensors and KV_BLOB tensors."},
    {"scatter_checked", py_scatter_checked, METH_VARARGS,
     "Scatter rows of a stored payload into paged tensors, CRC-32C-checksumming it as it is copied."},
    {"scatter_checked_many", py_scatter_checked_many, METH_VARARGS,
     "scatter_checked of several payloads in one call, their parts shared by the threads."},
    {"scatter_checked_file", py_scatter_checked_file, METH_VARARGS,
     "scatter_checked of a payload in a file, mapped behind a fault guard (or read a window at a time)."},
    {"slots_ok", py_slots_ok, METH_VARARGS, "Whether slots lie in [0, num_slots) and (distinct) none repeats."},
    {"copy_checked", py_copy_checked, METH_VARARGS, "Copy a buffer into another, CRC-32C checked in the same pass."},
    {"checked", py_checked, METH_VARARGS, "(CRC-32C, values not finite) of a buffer, in one pass."},
    {"nonfinite", py_nonfinite, METH_VARARGS, "How many values of a buffer (1 bf16, 2 fp16, 3 fp32) are NaN or infinite."},
    {"crc32c", py_crc32c, METH_VARARGS, "CRC-32C of a buffer (this module's code; tests compare)."},
    {"crc32c_combine", py_crc32c_combine, METH_VARARGS, "crc(A||B) from crc(A), crc(B), len(B)."},
    {"crc32c_level", py_crc32c_level, METH_NOARGS, "The CRC-32C path in use: 0 table, 1 crc32, 2 folding, 3 folding on 256-bit registers."},
    {"crc32c_set_level", py_crc32c_set_level, METH_VARARGS,
     "Use the best CRC-32C path up to this level (tests force lower ones); returns the level in effect."},
    {"file_maps", py_file_maps, METH_NOARGS, "How many payloads scatter_checked_file has read from a mapping."},
    {"map_min_bytes", py_map_min_bytes, METH_VARARGS,
     "Set the payload size from which scatter_checked_file maps the file (below: windows); returns the previous."},
    {"stream_width", py_stream_width, METH_VARARGS,
     "Use non-temporal stores of at most this many bits a store (512, 256, 128); returns the width in effect."},
    {"nontemporal_min", py_nontemporal_min, METH_VARARGS,
     "Set the bytes per call from which copies use non-temporal stores; returns the previous value."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_paged_native",
                                    "CPU paged gather/scatter (connectors/paged_native.py)", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__paged_native(void) {
    crc32c_init(CRC32C_FOLD_WIDE);
#ifdef HAVE_SSE2
    pick_stream_lines(512);
#endif
    pthread_atfork(NULL, NULL, pool_forked_child);
    return PyModule_Create(&moddef);
}
