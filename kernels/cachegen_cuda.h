/*
 * CacheGen on the GPU (kernels/cachegen_cuda.cu): quantize + encode and
 * decode + dequantize of layer sections, byte-identical to the CPU coder
 * (kernels/cachegen_cpu.c) because every byte-deciding step is a function of
 * the shared per-stream header kernels/cachegen_stream.h or of the small
 * host/device helpers below (which the CPU tests exercise through
 * kernels/cachegen_cuda_test_shim.c). Bitstream: format-spec/cachegen.md.
 *
 * Work is described per *section* (one coded layer of one chunk, [T, C]); a
 * launch takes any number of sections, from any number of chunks. The
 * payload header and section directory are built/checked on the host
 * (kvtool/cuda/cachegen.py); the device produces/consumes section bytes.
 *
 * Encode (all asynchronous on `stream`):
 *   cgc_encode_sections: per section, quantize + per-channel statistics +
 *     frequency tables + Rice side information + interleaved rANS into the
 *     section's scratch, and its sizes into a cgc_enc_result;
 *   (host: read the results, lay the sections out: out_offset/out_len)
 *   cgc_assemble_sections: compact each section's pieces into the output.
 * Decode: cgc_decode_sections, one warp per section; per-section error codes.
 */
#ifndef KVTOOL_CACHEGEN_CUDA_H
#define KVTOOL_CACHEGEN_CUDA_H

#include <stdint.h>

#include "cachegen_stream.h"

#ifdef __CUDACC__
#define CGC_FN __host__ __device__ __forceinline__
#else
#define CGC_FN static inline
#endif

/* One section. 64 bytes, no padding (mirrored by a numpy dtype on the host). */
typedef struct {
    uint64_t src;      /* encode: [T, C] input elements; decode: the section's bytes (device addresses) */
    uint64_t dst;      /* decode: [T, C] output elements; encode: unused */
    uint64_t scratch;  /* this section's scratch (cgc_*_scratch_bytes), 16-byte aligned */
    uint64_t src_len;  /* decode: section length in bytes; encode: unused */
    uint32_t T, C;     /* tokens, channels */
    int32_t M, P;      /* half range (bins/2 - 1), prob_bits */
    int32_t N, dtype;  /* lanes (<= min(64, C)), CG_DTYPE_* */
    uint32_t reserved0, reserved1;
} cgc_section;

/* Per-section encode results. 32 bytes. */
typedef struct {
    uint64_t side_bits;  /* bits of side information */
    uint32_t nwords;     /* rANS words */
    int32_t err;         /* 0, or CGC_ENC_NONFINITE */
    uint64_t out_offset; /* set by the host before cgc_assemble_sections */
    uint64_t out_len;    /* section length in bytes (host, = cgc_section_len) */
} cgc_enc_result;

/* encode error (cgc_enc_result.err): the section holds NaN or infinity */
#define CGC_ENC_NONFINITE 1

/* decode error codes (0 = ok); messages: cgc_decode_error_string */
#define CGC_DEC_OK 0
#define CGC_DEC_SCALES 1
#define CGC_DEC_SCALE_VALUE 2
#define CGC_DEC_MEANS 3
#define CGC_DEC_SIGMAS 4
#define CGC_DEC_SIDE_OVERRUN 5
#define CGC_DEC_SIDE_PADDING 6
#define CGC_DEC_NO_STATES 7
#define CGC_DEC_STATE_LOW 8
#define CGC_DEC_SHORT 9
#define CGC_DEC_FINAL_STATE 10
#define CGC_DEC_TRAILING 11
#define CGC_DEC_PAD_NONZERO 12

/* ---- host/device helpers that decide bytes (tested on the CPU) ------------ */

/* Rice code of v around base with parameter k, field width w: the bits in
 * stream order (LSB first) and their number (<= 48). Same bits as
 * cachegen_cpu.c's rice_block_put; length = cg_rice_cost. */
CGC_FN uint64_t cgc_rice_code(uint32_t v, uint32_t base, int k, int w, uint32_t *len) {
    const uint64_t z = v >= base ? 2u * (uint64_t)(v - base) : 2u * (uint64_t)(base - v) - 1u;
    const uint64_t q = z >> k;
    if (q < 16u) {
        *len = (uint32_t)q + 1u + (uint32_t)k;
        return (((uint64_t)1 << q) - 1u) | ((z & (((uint64_t)1 << k) - 1u)) << (q + 1u));
    }
    *len = 16u + (uint32_t)w;
    return 0xFFFFu | ((uint64_t)v << 16);
}

/* The (up to three) 32-bit words that bits `code` (len <= 48) placed at bit
 * `pos` of an LSB-first stream touch: word (pos >> 5) + i gets w[i] ORed in. */
CGC_FN void cgc_place_bits(uint64_t code, uint64_t pos, uint32_t w[3]) {
    const uint32_t sh = (uint32_t)(pos & 31u);
    const uint64_t lo = code << sh;
    w[0] = (uint32_t)lo;
    w[1] = (uint32_t)(lo >> 32);
    w[2] = sh ? (uint32_t)(code >> (64u - sh)) : 0u;
}

/* bytes of side information (padded to 32 bits) */
CGC_FN uint64_t cgc_side_bytes(uint64_t side_bits) { return ((side_bits + 31u) / 32u) * 4u; }

/* section length: side info, N lane states, the words, padding to 4 bytes */
CGC_FN uint64_t cgc_section_len(uint64_t side_bits, uint32_t N, uint32_t nwords) {
    const uint64_t body = cgc_side_bytes(side_bits) + 4u * (uint64_t)N + 2u * (uint64_t)nwords;
    return (body + 3u) & ~(uint64_t)3u;
}

/* capacity (32-bit words) of the side-information scratch: every value may
 * take its longest code (scales 16+32 bits, means 16+10, sigmas 16+5) */
CGC_FN uint64_t cgc_side_cap_words(uint32_t T, uint32_t C) {
    return ((uint64_t)T * 48u + (uint64_t)C * 47u + 256u) / 32u + 4u;
}

CGC_FN uint64_t cgc_align16(uint64_t x) { return (x + 15u) & ~(uint64_t)15u; }

/* stride (uint16 entries) of one channel's cumulative table in the encoder */
CGC_FN uint32_t cgc_enc_cum_stride(int M) { return (uint32_t)((2 * M + 2 + 1) & ~1); }

/* Encoder scratch of one section: byte offsets of its parts and the total. */
typedef struct {
    uint64_t q, scales, mq, sq, cum, side, words, states, total;
} cgc_enc_layout;

CGC_FN cgc_enc_layout cgc_encode_layout(uint32_t T, uint32_t C, int M) {
    cgc_enc_layout l;
    uint64_t o = 0;
    l.q = o;      o = cgc_align16(o + (uint64_t)T * C);
    l.scales = o; o = cgc_align16(o + 4u * (uint64_t)T);
    l.mq = o;     o = cgc_align16(o + 4u * (uint64_t)C);
    l.sq = o;     o = cgc_align16(o + 4u * (uint64_t)C);
    l.cum = o;    o = cgc_align16(o + 2u * (uint64_t)C * cgc_enc_cum_stride(M));
    l.side = o;   o = cgc_align16(o + 4u * cgc_side_cap_words(T, C));
    l.words = o;  o = cgc_align16(o + 2u * ((uint64_t)T * C + 1u));
    l.states = o; o = cgc_align16(o + 4u * 64u);
    l.total = o;
    return l;
}

/* Decoder tables: each channel's cumulative frequencies padded to S entries
 * (S = a power of two >= nsym + 1; entries past nsym hold 2^P), stored
 * transposed by groups of 32 channels, entry-major:
 *   tab[((c / 32) * S + e) * 32 + c % 32] = cum_c[e]
 * so the 32 lanes of a warp (32 consecutive channels) reading entry e touch
 * 64 consecutive bytes (coalesced in global memory, conflict-free in shared). */
CGC_FN uint32_t cgc_dec_table_size(int M) {
    uint32_t S = 2;
    while (S < (uint32_t)(2 * M + 2)) S <<= 1;
    return S;
}
CGC_FN uint64_t cgc_dec_table_index(uint32_t c, uint32_t e, uint32_t S) {
    return ((uint64_t)(c >> 5) * S + e) * 32u + (c & 31u);
}
/* the alternative layout (decoder variant without CGC_VAR_TRANSPOSED): row c
 * at c * (S + 2), entries contiguous */
CGC_FN uint64_t cgc_dec_row_index(uint32_t c, uint32_t e, uint32_t S) { return (uint64_t)c * (S + 2u) + e; }
/* bytes for either layout */
CGC_FN uint64_t cgc_dec_table_bytes(uint32_t C, int M) {
    const uint64_t S = cgc_dec_table_size(M);
    const uint64_t tr = 2u * 32u * (uint64_t)((C + 31u) / 32u) * S, rows = 2u * (uint64_t)C * (S + 2u);
    return tr > rows ? tr : rows;
}

/* decoder variants (bit flags; all decode identically, they differ in speed) */
#define CGC_VAR_TRANSPOSED 1 /* tables entry-major by groups of 32 channels (else one row per channel) */
#define CGC_VAR_WINDOW 2     /* renormalisation words through a register window + shuffles (else direct loads) */
#define CGC_VAR_GTAB 4       /* the shared Gaussian table below instead of per-channel tables (TRANSPOSED ignored) */

/* The Gaussian table (CGC_VAR_GTAB). cum_c[s] = s + g(4s - 2 - mq_c, sq_c) for
 * 0 < s < nsym (cg_cum_gauss), so one table of g over (sq, num) serves every
 * channel of a section: gtab[sq * W + num - num_min], num in
 * [num_min, num_max] = [6 - 4 nsym, 4 nsym - 6], W = 8 nsym - 11 values per
 * sigma code; 7.0 KB for 16 bins, 15.2 KB for 32 (vs 37 to 70 KB of
 * per-channel tables for a [256, 1024] section). A channel needs only the
 * index of its s = 1 entry (cgc_gtab_base); entry s is at base + 4 (s - 1). */
CGC_FN uint32_t cgc_gtab_width(int M) { return 8u * (uint32_t)(2 * M + 1) - 11u; }
CGC_FN uint32_t cgc_gtab_entries(int M) { return (uint32_t)CG_NSIGMA * cgc_gtab_width(M); }
/* value of entry e (0 <= e < cgc_gtab_entries(M)) */
CGC_FN uint16_t cgc_gtab_value(uint32_t e, int M, int P) {
    const int nsym = 2 * M + 1;
    const uint32_t W = cgc_gtab_width(M);
    const int32_t num = (int32_t)(e % W) + 6 - 4 * nsym;
    return (uint16_t)cg_cum_gauss(num, e / W, (1u << P) - (uint32_t)nsym);
}
/* index of a channel's s = 1 entry: num = 2 - mq, mq <= 4 (nsym - 1) */
CGC_FN uint32_t cgc_gtab_base(uint32_t mq, uint32_t sq, int M) {
    const uint32_t nsym = 2u * (uint32_t)M + 1u;
    return sq * cgc_gtab_width(M) + 4u * nsym - 4u - mq;
}
/* slot -> symbol (cum[sym] <= slot < cum[sym + 1]) by binary search over
 * S = cgc_dec_table_size(M) entries; also returns cum[sym] and cum[sym + 1],
 * the last probes of the search (no further table reads). */
CGC_FN uint32_t cgc_gtab_search(const uint16_t *gtab, uint32_t base, int M, int P, uint32_t S, uint32_t slot,
                                uint32_t *lo, uint32_t *hi) {
    const uint32_t nsym = 2u * (uint32_t)M + 1u;
    uint32_t sym = 0, l = 0, h = 1u << P;
    for (uint32_t step = S >> 1; step; step >>= 1) {
        const uint32_t p = sym + step;
        const uint32_t v = p < nsym ? p + gtab[base + 4u * (p - 1u)] : (1u << P);
        if (v <= slot) { sym = p; l = v; } else { h = v; }
    }
    *lo = l;
    *hi = h;
    return sym;
}
/* shared-memory bytes of one warp's Gaussian table + channel bases (C u16), 16-aligned */
CGC_FN uint64_t cgc_gtab_smem_bytes(uint32_t C, int M) {
    return (2u * (uint64_t)cgc_gtab_entries(M) + 2u * (uint64_t)C + 15u) & ~(uint64_t)15u;
}

/* Decoder scratch of one section (tables: also room for the frequency
 * tables when they do not go to shared memory). */
typedef struct {
    uint64_t scales, mq, sq, tables, total;
} cgc_dec_layout;

CGC_FN cgc_dec_layout cgc_decode_layout(uint32_t T, uint32_t C, int M, int with_tables) {
    cgc_dec_layout l;
    uint64_t o = 0;
    l.scales = o; o = cgc_align16(o + 4u * (uint64_t)T);
    l.mq = o;     o = cgc_align16(o + 4u * (uint64_t)C);
    l.sq = o;     o = cgc_align16(o + 4u * (uint64_t)C);
    l.tables = o; o = cgc_align16(o + (with_tables ? cgc_dec_table_bytes(C, M) : 0u));
    l.total = o;
    return l;
}

/* ---- C ABI (kernels/cachegen_cuda.cu) -------------------------------------- */
#ifdef __cplusplus
extern "C" {
#endif

uint64_t cgc_encode_scratch_bytes(uint32_t T, uint32_t C, int M);
uint64_t cgc_decode_scratch_bytes(uint32_t T, uint32_t C, int M, int with_tables);

/* secs, res: device arrays of nsec entries (res zeroed by the caller).
 * max_T / max_C: the largest T / C among the sections. Returns 0 or -1
 * (cgc_last_error). Asynchronous. */
int cgc_encode_sections(const cgc_section *secs, cgc_enc_result *res, uint32_t nsec, uint32_t max_T, uint32_t max_C,
                        void *stream);
/* after the host filled res[i].out_offset / out_len: write section i at out + out_offset */
int cgc_assemble_sections(const cgc_section *secs, const cgc_enc_result *res, uint32_t nsec, uint8_t *out,
                          void *stream);

/* How many warps (sections) per block fit their decoder tables in shared
 * memory for this geometry (1..4), or 0 (then the tables go to global
 * scratch). 'auto' callers use shared memory only at 4 warps per block: fewer
 * resident warps cost more than L1-cached global tables (measured). */
int cgc_decode_tables_in_smem(uint32_t max_C, int max_M);
/* The same for the Gaussian tables of CGC_VAR_GTAB (which need shared memory):
 * warps per block (1..4), or 0 when even one does not fit. */
int cgc_decode_gtab_in_smem(uint32_t max_C, int max_M);
/* errs: device int32[nsec], one CGC_DEC_* per section. tables_in_smem: 0
 * (tables in the scratch: with_tables = 1 in its layout) or 1..4 warps per
 * block with the tables in shared memory (with_tables = 0). */
int cgc_decode_sections(const cgc_section *secs, int32_t *errs, uint32_t nsec, uint32_t max_C, int max_M,
                        int tables_in_smem, int variant, void *stream);
const char *cgc_decode_error_string(int code);
const char *cgc_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* KVTOOL_CACHEGEN_CUDA_H */
