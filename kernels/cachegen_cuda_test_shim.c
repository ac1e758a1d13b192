/*
 * CPU test shim of the host/device helpers in kernels/cachegen_cuda.h (built
 * with gcc by tests/test_cuda.py, driven through ctypes). The GPU encoder
 * writes the side information with cgc_rice_code + cgc_place_bits at prefix-
 * summed bit positions; here the same helpers re-synthesise the side
 * information of a section made by the CPU coder, which must come out bit for
 * bit identical.
 */
#include <stdint.h>
#include <string.h>

#include "cachegen_stream.h"
#include "cachegen_cuda.h"

uint64_t shim_rice_code(uint32_t v, uint32_t base, int k, int w, uint32_t *len) {
    return cgc_rice_code(v, base, k, w, len);
}

uint64_t shim_rice_cost(uint32_t v, uint32_t base, int k, int w) { return cg_rice_cost(v, base, k, w); }

void shim_place_bits(uint64_t code, uint64_t pos, uint32_t *w3) { cgc_place_bits(code, pos, w3); }

uint64_t shim_section_len(uint64_t side_bits, uint32_t N, uint32_t nwords) {
    return cgc_section_len(side_bits, N, nwords);
}

uint64_t shim_side_cap_words(uint32_t T, uint32_t C) { return cgc_side_cap_words(T, C); }

/* layouts: 9 offsets (q, scales, mq, sq, cum, side, words, states, total) */
void shim_encode_layout(uint32_t T, uint32_t C, int M, uint64_t *o) {
    cgc_enc_layout l = cgc_encode_layout(T, C, M);
    o[0] = l.q; o[1] = l.scales; o[2] = l.mq; o[3] = l.sq; o[4] = l.cum;
    o[5] = l.side; o[6] = l.words; o[7] = l.states; o[8] = l.total;
}

void shim_decode_layout(uint32_t T, uint32_t C, int M, int with_tables, uint64_t *o) {
    cgc_dec_layout l = cgc_decode_layout(T, C, M, with_tables);
    o[0] = l.scales; o[1] = l.mq; o[2] = l.sq; o[3] = l.tables; o[4] = l.total;
}

uint32_t shim_dec_table_size(int M) { return cgc_dec_table_size(M); }

uint64_t shim_dec_table_index(uint32_t c, uint32_t e, uint32_t S) { return cgc_dec_table_index(c, e, S); }

uint64_t shim_dec_table_bytes(uint32_t C, int M) { return cgc_dec_table_bytes(C, M); }

static void put(uint32_t *words, uint64_t pos, uint64_t code) {
    uint32_t w[3];
    cgc_place_bits(code, pos, w);
    words[pos >> 5] |= w[0];
    words[(pos >> 5) + 1] |= w[1];
    words[(pos >> 5) + 2] |= w[2];
}

/* one block: read (base, k, n values) from br, re-emit at *pos; returns 0 on a read error */
static int resynth_block(cg_bitreader *br, uint32_t n, int w, uint32_t *words, uint64_t *pos, uint32_t *vals) {
    uint32_t base = cg_br_bits(br, w);
    int k = (int)cg_br_bits(br, CG_W_K);
    if (br->err || k > w) return 0;
    put(words, *pos, base);
    put(words, *pos + (uint64_t)w, (uint64_t)k);
    *pos += (uint64_t)w + CG_W_K;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t v = cg_rice_get(br, base, k, w);
        if (br->err) return 0;
        uint32_t len;
        uint64_t code = cgc_rice_code(v, base, k, w, &len);
        if ((uint64_t)len != cg_rice_cost(v, base, k, w)) return 0;
        put(words, *pos, code);
        *pos += len;
        if (vals) vals[i] = v;
    }
    return 1;
}

/* Parse the side information of a CPU-made section and re-emit it with the
 * GPU's helpers into `words` (cap words, zeroed here). Returns the number of
 * side bits, or -1 on a parse error / capacity problem. */
int64_t shim_resynth_side(const uint8_t *sec, uint64_t seclen, int dtype, uint32_t T, uint32_t C, uint32_t *words,
                          uint64_t cap) {
    if (cgc_side_cap_words(T, C) + 3u > cap) return -1;
    memset(words, 0, cap * 4u);
    cg_bitreader br = {sec, seclen * 8u, 0, 0};
    uint64_t pos = 0;
    const int ws = dtype == CG_DTYPE_F32 ? 32 : 16;
    if (!resynth_block(&br, T, ws, words, &pos, 0)) return -1;
    if (!resynth_block(&br, C, CG_W_MU, words, &pos, 0)) return -1;
    if (!resynth_block(&br, C, CG_W_SIGMA, words, &pos, 0)) return -1;
    if (pos != br.pos) return -1;
    return (int64_t)pos;
}

/* The Gaussian-table decoder (CGC_VAR_GTAB) against the per-channel tables:
 * for every sigma code and mean code of a geometry, every `stride`-th slot
 * must give the symbol, cum[sym] and cum[sym + 1] that cg_build_cum's table
 * gives. Returns the number of disagreements (or -1 if gtab is too small). */
int64_t shim_gtab_mismatches(int M, int P, uint32_t stride, uint16_t *gtab, uint32_t gtab_len) {
    const int nsym = 2 * M + 1;
    const uint32_t entries = cgc_gtab_entries(M), S = cgc_dec_table_size(M);
    if (entries > gtab_len) return -1;
    for (uint32_t e = 0; e < entries; e++) gtab[e] = cgc_gtab_value(e, M, P);
    int64_t bad = 0;
    uint16_t cum[CG_NSYM_MAX + 1];
    for (uint32_t sq = 0; sq < CG_NSIGMA; sq++) {
        for (uint32_t mq = 0; mq <= 4u * (uint32_t)(nsym - 1); mq++) {
            cg_build_cum(nsym, mq, sq, P, cum);
            const uint32_t base = cgc_gtab_base(mq, sq, M);
            uint32_t want = 0;
            for (uint32_t slot = 0; slot < (1u << P); slot += stride) {
                while (cum[want + 1] <= slot) want++;
                uint32_t lo, hi;
                const uint32_t got = cgc_gtab_search(gtab, base, M, P, S, slot, &lo, &hi);
                if (got != want || lo != cum[want] || hi != cum[want + 1]) bad++;
            }
        }
    }
    return bad;
}
