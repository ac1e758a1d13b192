/*
 * CacheGen coder on the GPU (see cachegen_cuda.h). Bitstream:
 * format-spec/cachegen.md. Every arithmetic step that decides a byte is a
 * call into the shared header cachegen_stream.h (quantization, parameter
 * estimation, frequency tables, rANS steps, Rice decoding, float conversions)
 * or a helper of cachegen_cuda.h, so the bytes equal the CPU coder's
 * (kernels/cachegen_cpu.c) by construction. Parallel structure:
 *
 * encode (one section = one coded layer [T, C] of one chunk)
 *   k_quantize  warp per (section, token): row max-abs (the scale, as bits),
 *               non-finite check, symbols q[t, c]
 *   k_tables    thread per (section, channel): S1, S2 -> mean/sigma codes ->
 *               cg_build_cum (frequency tables computed on the GPU)
 *   k_side      warp per section: three Rice blocks (lower median by radix
 *               select, k by warp-reduced costs, codes placed by a prefix sum
 *               of their lengths and ORed into words)
 *   k_rans      warp per section: interleaved rANS over the symbols in
 *               reverse order; a group of N lanes is one or two warp steps, the
 *               words a step emits are ranked by a ballot so they land where
 *               the CPU's sequential stack puts them
 *   (host: read sizes, prefix-sum the section offsets)
 *   k_assemble  block per section: side words, lane states, words, padding
 * decode
 *   k_decode    warp per section: lane 0 reads the Rice side information
 *               (shared header's bit reader); lanes build the tables (global
 *               scratch, or shared memory); then tokens in order, channels in
 *               groups of N lanes, each lane one channel; the shared word
 *               pointer advances by ballot/popc of the lanes that need a word.
 *               Variants (CGC_VAR_*: table layout, word window, one shared
 *               Gaussian table per warp) decode the same values;
 *               kvtool/cuda/cachegen.py picks the measured fastest.
 *               One warp per section: a batch of chunks is what fills the GPU
 *               (H100, 32 chunks of [2, 32, 256, 1024] bf16: 75 GB/s decoded;
 *               one chunk: 4 GB/s, measured when a block always held 4
 *               sections; small launches now spread to one section per SM).
 * Build: nvcc -O3 -std=c++17 -arch=sm_90 (-shared -Xcompiler -fPIC for the .so).
 */
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

#include "cachegen_cuda.h"
#include "cachegen_stream.h"

namespace {

thread_local char g_err[512];

int fail(const char *what, cudaError_t e) {
    snprintf(g_err, sizeof g_err, "%s: %s", what, cudaGetErrorString(e));
    return -1;
}

constexpr unsigned kFull = 0xFFFFFFFFu;
constexpr int kWarpsPerBlock = 4;

__device__ __forceinline__ uint32_t lane_id() { return threadIdx.x & 31u; }

__device__ __forceinline__ uint32_t elem_bits(const uint8_t *row, uint32_t c, int dtype) {
    if (dtype == CG_DTYPE_F32) return reinterpret_cast<const uint32_t *>(row)[c];
    return reinterpret_cast<const uint16_t *>(row)[c];
}

__device__ __forceinline__ float bits_to_f32(uint32_t b, int dtype) {
    if (dtype == CG_DTYPE_F32) return cg_f32_from_bits(b);
    if (dtype == CG_DTYPE_BF16) return cg_bf16_to_f32((uint16_t)b);
    return cg_f16_to_f32((uint16_t)b);
}

/* ============================== encode ===================================== */

/* warp per (section, token) */
__global__ void __launch_bounds__(256) k_quantize(const cgc_section *__restrict__ secs, cgc_enc_result *res) {
    const cgc_section sec = secs[blockIdx.y];
    const uint32_t t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= sec.T) return;
    const uint32_t lane = lane_id(), C = sec.C;
    const int dtype = sec.dtype, M = sec.M;
    const size_t es = dtype == CG_DTYPE_F32 ? 4u : 2u;
    const uint8_t *row = reinterpret_cast<const uint8_t *>(sec.src) + (size_t)t * C * es;
    const cgc_enc_layout lay = cgc_encode_layout(sec.T, C, M);
    uint8_t *scr = reinterpret_cast<uint8_t *>(sec.scratch);
    const uint32_t absmask = dtype == CG_DTYPE_F32 ? 0x7FFFFFFFu : 0x7FFFu;
    uint32_t m = 0;
    for (uint32_t c = lane; c < C; c += 32) {
        const uint32_t a = elem_bits(row, c, dtype) & absmask;
        m = a > m ? a : m;
    }
    m = __reduce_max_sync(kFull, m);
    const uint32_t inf = dtype == CG_DTYPE_F32 ? 0x7F800000u : (dtype == CG_DTYPE_BF16 ? 0x7F80u : 0x7C00u);
    if (m >= inf) {
        if (lane == 0) atomicOr(&res[blockIdx.y].err, CGC_ENC_NONFINITE);
        return;
    }
    if (lane == 0) reinterpret_cast<uint32_t *>(scr + lay.scales)[t] = m;
    const float maxf = bits_to_f32(m, dtype);
    const float factor = cg_quant_factor(M, maxf);
    const float pre = cg_quant_prescale(maxf);
    uint8_t *q = scr + lay.q + (size_t)t * C;
    for (uint32_t c = lane; c < C; c += 32)
        q[c] = (uint8_t)cg_quantize(bits_to_f32(elem_bits(row, c, dtype), dtype), pre, factor, M);
}

/* thread per (section, channel): statistics, parameter codes, frequency table */
__global__ void __launch_bounds__(128) k_tables(const cgc_section *__restrict__ secs, const cgc_enc_result *res) {
    const cgc_section sec = secs[blockIdx.y];
    const uint32_t c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= sec.C || res[blockIdx.y].err) return;
    const uint32_t T = sec.T, C = sec.C;
    const int nsym = 2 * sec.M + 1;
    const cgc_enc_layout lay = cgc_encode_layout(T, C, sec.M);
    uint8_t *scr = reinterpret_cast<uint8_t *>(sec.scratch);
    const uint8_t *q = scr + lay.q + c;
    uint64_t s1 = 0, s2 = 0;
    for (uint32_t t = 0; t < T; t++) {
        const uint32_t s = q[(size_t)t * C];
        s1 += s;
        s2 += s * s;
    }
    const uint32_t mq = cg_estimate_mu(T, s1, nsym);
    const uint32_t sq = cg_estimate_sigma(T, s1, s2);
    reinterpret_cast<uint32_t *>(scr + lay.mq)[c] = mq;
    reinterpret_cast<uint32_t *>(scr + lay.sq)[c] = sq;
    cg_build_cum(nsym, mq, sq, sec.P,
                 reinterpret_cast<uint16_t *>(scr + lay.cum) + (size_t)c * cgc_enc_cum_stride(sec.M));
}

__device__ __forceinline__ uint64_t warp_sum_u64(uint64_t v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    return v;
}

/* sorted(v)[(n-1)/2] by 8-bit radix select; hist: 256 words of this warp's shared memory */
__device__ uint32_t warp_lower_median(const uint32_t *v, uint32_t n, int w, uint32_t *hist) {
    const uint32_t lane = lane_id();
    uint32_t rank = (n - 1u) / 2u, prefix = 0, pmask = 0;
    for (int shift = ((w - 1) / 8) * 8; shift >= 0; shift -= 8) {
        for (uint32_t i = lane; i < 256; i += 32) hist[i] = 0;
        __syncwarp();
        for (uint32_t i = lane; i < n; i += 32) {
            const uint32_t x = v[i];
            if ((x & pmask) == prefix) atomicAdd(&hist[(x >> shift) & 255u], 1u);
        }
        __syncwarp();
        /* the digit whose running count passes `rank`: lane l scans digits 8l..8l+7 */
        uint32_t cnt[8], tot = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) { cnt[j] = hist[lane * 8 + j]; tot += cnt[j]; }
        uint32_t incl = tot;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const uint32_t y = __shfl_up_sync(kFull, incl, o);
            if (lane >= (uint32_t)o) incl += y;
        }
        const uint32_t excl = incl - tot;
        const unsigned owner = __ballot_sync(kFull, excl <= rank && rank < incl);
        const uint32_t src = __ffs(owner) - 1;
        uint32_t digit = 0, before = excl;
        if (lane == src) {
            uint32_t run = excl;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                if (run + cnt[j] > rank) { digit = lane * 8 + j; before = run; break; }
                run += cnt[j];
            }
        }
        digit = __shfl_sync(kFull, digit, src);
        before = __shfl_sync(kFull, before, src);
        rank -= before;
        prefix |= digit << shift;
        pmask |= 255u << shift;
        __syncwarp();
    }
    return prefix;
}

__device__ __forceinline__ void put_bits(uint32_t *words, uint64_t pos, uint64_t code) {
    uint32_t w[3];
    cgc_place_bits(code, pos, w);
    uint32_t *p = words + (pos >> 5);
    if (w[0]) atomicOr(p, w[0]);
    if (w[1]) atomicOr(p + 1, w[1]);
    if (w[2]) atomicOr(p + 2, w[2]);
}

/* one Rice block (format-spec/cachegen.md section 4), warp-cooperative; returns the new bit position */
__device__ uint64_t warp_rice_block(const uint32_t *v, uint32_t n, int w, uint32_t *words, uint64_t pos,
                                    uint32_t *hist) {
    const uint32_t lane = lane_id();
    const uint32_t base = warp_lower_median(v, n, w, hist);
    const int kmax = w < 31 ? w : 31;
    int bestk = 0;
    uint64_t best = ~(uint64_t)0;
    for (int k = 0; k <= kmax; k++) {
        uint64_t c = 0;
        for (uint32_t i = lane; i < n; i += 32) c += cg_rice_cost(v[i], base, k, w);
        c = warp_sum_u64(c);
        if (c < best) { best = c; bestk = k; }
    }
    if (lane == 0) {
        put_bits(words, pos, base);
        put_bits(words, pos + (uint64_t)w, (uint64_t)bestk);
    }
    pos += (uint64_t)w + CG_W_K;
    for (uint32_t i0 = 0; i0 < n; i0 += 32) {
        const uint32_t i = i0 + lane;
        uint32_t len = 0;
        uint64_t code = 0;
        if (i < n) code = cgc_rice_code(v[i], base, bestk, w, &len);
        uint32_t incl = len;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const uint32_t y = __shfl_up_sync(kFull, incl, o);
            if (lane >= (uint32_t)o) incl += y;
        }
        if (len) put_bits(words, pos + (incl - len), code);
        pos += __shfl_sync(kFull, incl, 31);
    }
    return pos;
}

/* warp per section: side information */
__global__ void __launch_bounds__(32 * kWarpsPerBlock) k_side(const cgc_section *__restrict__ secs, cgc_enc_result *res,
                                                               uint32_t nsec) {
    __shared__ uint32_t hist_all[kWarpsPerBlock][256];
    const uint32_t s = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
    if (s >= nsec) return;
    const cgc_section sec = secs[s];
    if (res[s].err) return;
    uint32_t *hist = hist_all[threadIdx.x >> 5];
    const uint32_t lane = lane_id();
    const cgc_enc_layout lay = cgc_encode_layout(sec.T, sec.C, sec.M);
    uint8_t *scr = reinterpret_cast<uint8_t *>(sec.scratch);
    uint32_t *words = reinterpret_cast<uint32_t *>(scr + lay.side);
    const uint64_t cap = cgc_side_cap_words(sec.T, sec.C);
    for (uint64_t i = lane; i < cap; i += 32) words[i] = 0;
    __syncwarp();
    uint64_t pos = 0;
    pos = warp_rice_block(reinterpret_cast<const uint32_t *>(scr + lay.scales), sec.T,
                          sec.dtype == CG_DTYPE_F32 ? 32 : 16, words, pos, hist);
    pos = warp_rice_block(reinterpret_cast<const uint32_t *>(scr + lay.mq), sec.C, CG_W_MU, words, pos, hist);
    pos = warp_rice_block(reinterpret_cast<const uint32_t *>(scr + lay.sq), sec.C, CG_W_SIGMA, words, pos, hist);
    if (lane == 0) res[s].side_bits = pos;
}

/* warp per section: interleaved rANS, reverse order of decoding */
__global__ void __launch_bounds__(32 * kWarpsPerBlock) k_rans(const cgc_section *__restrict__ secs, cgc_enc_result *res,
                                                               uint32_t nsec) {
    const uint32_t s = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
    if (s >= nsec) return;
    const cgc_section sec = secs[s];
    if (res[s].err) return;
    const uint32_t lane = lane_id(), T = sec.T, C = sec.C, N = (uint32_t)sec.N;
    const int P = sec.P;
    const cgc_enc_layout lay = cgc_encode_layout(T, C, sec.M);
    uint8_t *scr = reinterpret_cast<uint8_t *>(sec.scratch);
    const uint8_t *q = scr + lay.q;
    const uint16_t *cum = reinterpret_cast<const uint16_t *>(scr + lay.cum);
    const uint32_t cs = cgc_enc_cum_stride(sec.M);
    uint16_t *words = reinterpret_cast<uint16_t *>(scr + lay.words);
    const uint32_t cap = T * C + 1u;
    uint32_t top = cap; /* words[top..cap) are written; the next goes below */
    const uint32_t G = (C + N - 1u) / N;
    const int H = N > 32u ? 2 : 1;
    uint32_t x0 = CG_RANS_L, x1 = CG_RANS_L;
    const unsigned lower = (1u << lane) - 1u;
    /* one warp step: lanes j = lane (+32) of group g, channel c = g*N + j */
    auto step = [&](uint32_t &xr, const uint8_t *qr, uint32_t g, uint32_t j) {
        const uint32_t c = g * N + j;
        const bool active = j < N && c < C;
        uint32_t st = 0, fr = 1, xx = xr;
        bool emit = false;
        if (active) {
            const uint16_t *cm = cum + (size_t)c * cs;
            const uint32_t sym = qr[c];
            st = cm[sym];
            fr = (uint32_t)cm[sym + 1] - st;
            emit = cg_enc_must_emit(xx, fr, P);
        }
        const unsigned em = __ballot_sync(kFull, emit);
        const uint32_t m = __popc(em);
        if (emit) {
            words[top - m + __popc(em & lower)] = (uint16_t)xx;
            xx >>= 16;
        }
        top -= m;
        if (active) xr = cg_enc_put(xx, st, fr, P);
    };
    for (int64_t t = (int64_t)T - 1; t >= 0; t--) {
        const uint8_t *qr = q + (size_t)t * C;
        for (int64_t g = (int64_t)G - 1; g >= 0; g--) {
            if (H == 2) step(x1, qr, (uint32_t)g, 32u + lane); /* higher channels first: reverse order */
            step(x0, qr, (uint32_t)g, lane);
        }
    }
    uint32_t *states = reinterpret_cast<uint32_t *>(scr + lay.states);
    if (lane < N) states[lane] = x0;
    if (H == 2 && 32u + lane < N) states[32u + lane] = x1;
    if (lane == 0) res[s].nwords = cap - top;
}

/* block per section: side words | lane states | words | zero padding */
__global__ void __launch_bounds__(256) k_assemble(const cgc_section *__restrict__ secs, const cgc_enc_result *__restrict__ res,
                                                  uint8_t *out) {
    const uint32_t s = blockIdx.x;
    const cgc_section sec = secs[s];
    const cgc_enc_result r = res[s];
    const cgc_enc_layout lay = cgc_encode_layout(sec.T, sec.C, sec.M);
    const uint8_t *scr = reinterpret_cast<const uint8_t *>(sec.scratch);
    const uint16_t *side = reinterpret_cast<const uint16_t *>(scr + lay.side);
    const uint16_t *states = reinterpret_cast<const uint16_t *>(scr + lay.states);
    const uint16_t *words = reinterpret_cast<const uint16_t *>(scr + lay.words) + ((uint64_t)sec.T * sec.C + 1u - r.nwords);
    uint16_t *dst = reinterpret_cast<uint16_t *>(out + r.out_offset);
    const uint64_t side_u = cgc_side_bytes(r.side_bits) / 2u;
    const uint64_t states_end = side_u + 2u * (uint64_t)sec.N;
    const uint64_t words_end = states_end + r.nwords;
    const uint64_t n = r.out_len / 2u;
    for (uint64_t u = threadIdx.x; u < n; u += blockDim.x) {
        uint16_t v;
        if (u < side_u) v = side[u];
        else if (u < states_end) v = states[u - side_u];
        else if (u < words_end) v = words[u - states_end];
        else v = 0;
        dst[u] = v;
    }
}

/* ============================== decode ===================================== */

__device__ int rice_block_get(cg_bitreader *br, uint32_t *v, uint32_t n, int w, uint32_t vmax) {
    const uint32_t base = cg_br_bits(br, w);
    const int k = (int)cg_br_bits(br, CG_W_K);
    if (br->err || k > w) return 0;
    for (uint32_t i = 0; i < n; i++) {
        const uint32_t x = cg_rice_get(br, base, k, w);
        if (br->err || x > vmax) return 0;
        v[i] = x;
    }
    return 1;
}

__device__ __forceinline__ int scale_ok(uint32_t b, int dtype) {
    if (dtype == CG_DTYPE_F32) return (b & 0x80000000u) == 0 && (b & 0x7F800000u) != 0x7F800000u;
    if (dtype == CG_DTYPE_BF16) return (b & 0x8000u) == 0 && (b & 0x7F80u) != 0x7F80u;
    return (b & 0x8000u) == 0 && (b & 0x7C00u) != 0x7C00u;
}

/* lane 0: side information of a section; returns a CGC_DEC_* code and the side bytes */
__device__ int read_side(const cgc_section &sec, uint8_t *scr, const cgc_dec_layout &lay, uint32_t *side_bytes) {
    const uint8_t *p = reinterpret_cast<const uint8_t *>(sec.src);
    cg_bitreader br = {p, sec.src_len * 8u, 0, 0};
    const int nsym = 2 * sec.M + 1;
    const int ws = sec.dtype == CG_DTYPE_F32 ? 32 : 16;
    uint32_t *scales = reinterpret_cast<uint32_t *>(scr + lay.scales);
    if (!rice_block_get(&br, scales, sec.T, ws, ws == 32 ? 0xFFFFFFFFu : 0xFFFFu)) return CGC_DEC_SCALES;
    for (uint32_t t = 0; t < sec.T; t++)
        if (!scale_ok(scales[t], sec.dtype)) return CGC_DEC_SCALE_VALUE;
    if (!rice_block_get(&br, reinterpret_cast<uint32_t *>(scr + lay.mq), sec.C, CG_W_MU, 4u * (uint32_t)(nsym - 1)))
        return CGC_DEC_MEANS;
    if (!rice_block_get(&br, reinterpret_cast<uint32_t *>(scr + lay.sq), sec.C, CG_W_SIGMA, CG_NSIGMA - 1))
        return CGC_DEC_SIGMAS;
    const uint64_t padded = (br.pos + 31u) & ~(uint64_t)31u;
    if (padded > br.nbits) return CGC_DEC_SIDE_OVERRUN;
    const uint32_t pad = cg_br_bits(&br, (int)(padded - br.pos));
    if (br.err || pad != 0) return CGC_DEC_SIDE_PADDING;
    *side_bytes = (uint32_t)(br.pos / 8u);
    if (sec.src_len - *side_bytes < 4u * (uint64_t)sec.N) return CGC_DEC_NO_STATES;
    return CGC_DEC_OK;
}

__device__ __forceinline__ uint32_t load_u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

template <bool SMEM, bool TRANSPOSED, bool WINDOW, bool GTAB>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) k_decode(const cgc_section *__restrict__ secs, int32_t *errs,
                                                                 uint32_t nsec, uint32_t smem_tab_u16) {
    extern __shared__ uint16_t smem_tables[];
    __shared__ float units_all[kWarpsPerBlock][CG_NSYM_MAX + 1];
    const uint32_t wib = threadIdx.x >> 5;
    const uint32_t s = blockIdx.x * (blockDim.x >> 5) + wib;
    if (s >= nsec) return;
    const cgc_section sec = secs[s];
    const uint32_t lane = lane_id(), T = sec.T, C = sec.C, N = (uint32_t)sec.N;
    const int P = sec.P, M = sec.M, nsym = 2 * M + 1, dtype = sec.dtype;
    const cgc_dec_layout lay = cgc_decode_layout(T, C, M, SMEM ? 0 : 1);
    uint8_t *scr = reinterpret_cast<uint8_t *>(sec.scratch);

    int err = CGC_DEC_OK;
    uint32_t side_bytes = 0;
    if (lane == 0) err = read_side(sec, scr, lay, &side_bytes);
    err = __shfl_sync(kFull, err, 0);
    side_bytes = __shfl_sync(kFull, side_bytes, 0);
    if (err) {
        if (lane == 0) errs[s] = err;
        return;
    }
    __syncwarp();

    const uint8_t *sp = reinterpret_cast<const uint8_t *>(sec.src);
    uint32_t x[2];
    x[0] = lane < N ? load_u32(sp + side_bytes + 4u * lane) : CG_RANS_L;
    x[1] = 32u + lane < N ? load_u32(sp + side_bytes + 4u * (32u + lane)) : CG_RANS_L;
    if (__any_sync(kFull, x[0] < CG_RANS_L || x[1] < CG_RANS_L)) {
        if (lane == 0) errs[s] = CGC_DEC_STATE_LOW;
        return;
    }

    /* tables: padded to S entries (2^P past nsym), transposed by groups of 32 channels;
     * GTAB: this warp's Gaussian table and each channel's base index in it */
    const uint32_t S = cgc_dec_table_size(M);
    uint16_t *tab = SMEM ? smem_tables + (size_t)wib * smem_tab_u16 : reinterpret_cast<uint16_t *>(scr + lay.tables);
    const uint32_t *mq = reinterpret_cast<const uint32_t *>(scr + lay.mq);
    const uint32_t *sq = reinterpret_cast<const uint32_t *>(scr + lay.sq);
    uint16_t *gbase = tab + cgc_gtab_entries(M);
    if (GTAB) {
        for (uint32_t e = lane; e < cgc_gtab_entries(M); e += 32) tab[e] = cgc_gtab_value(e, M, P);
        for (uint32_t c = lane; c < C; c += 32) gbase[c] = (uint16_t)cgc_gtab_base(mq[c], sq[c], M);
    } else {
        for (uint32_t c = lane; c < C; c += 32) {
            uint16_t row[CG_NSYM_MAX + 1];
            cg_build_cum(nsym, mq[c], sq[c], P, row);
            for (uint32_t e = 0; e < (TRANSPOSED ? S : S + 2u); e++) {
                const uint16_t v = e <= (uint32_t)nsym ? row[e] : (uint16_t)(1u << P);
                tab[TRANSPOSED ? cgc_dec_table_index(c, e, S) : cgc_dec_row_index(c, e, S)] = v;
            }
        }
    }
    float *units = units_all[wib];
    for (int k = (int)lane; k < nsym; k += 32) units[k] = cg_dequant_unit(k, M);
    __syncwarp();

    const uint32_t *scales = reinterpret_cast<const uint32_t *>(scr + lay.scales);
    const uint16_t *words = reinterpret_cast<const uint16_t *>(sp + side_bytes + 4u * N);
    const uint32_t avail = (uint32_t)((sec.src_len - side_bytes - 4u * (uint64_t)N) / 2u);
    const uint32_t mask = (1u << P) - 1u;
    const uint32_t G = (C + N - 1u) / N;
    const int H = N > 32u ? 2 : 1;
    const unsigned lower = (1u << lane) - 1u;
    /* The words, through a register window: lane i holds words[base + i],
     * [base + 32 + i] and [base + 64 + i]. At a step's start wpos - base < 32,
     * so every word the step reads is in the first 64 (shuffles); the third
     * chunk is the prefetch, loaded a whole chunk of words before it is used. */
    uint32_t wpos = 0, base = 0;
    uint32_t w0 = lane < avail ? words[lane] : 0u;
    uint32_t w1 = 32u + lane < avail ? words[32u + lane] : 0u;
    uint32_t w2 = 64u + lane < avail ? words[64u + lane] : 0u;
    bool overrun = false;
    uint8_t *outb = reinterpret_cast<uint8_t *>(sec.dst);
    for (uint32_t t = 0; t < T; t++) {
        const float scale = bits_to_f32(scales[t], dtype);
        const size_t rowbase = (size_t)t * C;
        for (uint32_t g = 0; g < G; g++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (h >= H) continue;
                const uint32_t j = (uint32_t)h * 32u + lane;
                const uint32_t c = g * N + j;
                const bool active = j < N && c < C;
                uint32_t xx = x[h], sym = 0;
                bool need = false;
                if (active && GTAB) {
                    const uint32_t slot = xx & mask;
                    uint32_t lo, hi;
                    sym = cgc_gtab_search(tab, gbase[c], M, P, S, slot, &lo, &hi);
                    xx = (hi - lo) * (xx >> P) + slot - lo;
                    need = cg_dec_needs_word(xx);
                } else if (active) {
                    const uint32_t es = TRANSPOSED ? 32u : 1u; /* entry stride */
                    const uint16_t *col = tab + (TRANSPOSED ? cgc_dec_table_index(c, 0, S) : cgc_dec_row_index(c, 0, S));
                    const uint32_t slot = xx & mask;
                    for (uint32_t step = S >> 1; step; step >>= 1)
                        if (col[(sym + step) * es] <= slot) sym += step;
                    const uint32_t st = col[sym * es];
                    xx = ((uint32_t)col[(sym + 1u) * es] - st) * (xx >> P) + slot - st;
                    need = cg_dec_needs_word(xx);
                }
                const unsigned nm = __ballot_sync(kFull, need);
                const uint32_t k = wpos - base + __popc(nm & lower); /* < 64 */
                if (WINDOW) {
                    const uint32_t v0 = __shfl_sync(kFull, w0, k & 31u);
                    const uint32_t v1 = __shfl_sync(kFull, w1, k & 31u);
                    if (need) {
                        if (base + k < avail) xx = cg_dec_push_word(xx, (uint16_t)(k < 32u ? v0 : v1));
                        else overrun = true;
                    }
                } else if (need) {
                    if (base + k < avail) xx = cg_dec_push_word(xx, words[base + k]);
                    else overrun = true;
                }
                wpos += __popc(nm);
                if (WINDOW && wpos - base >= 32u) {
                    base += 32u;
                    w0 = w1;
                    w1 = w2;
                    w2 = base + 64u + lane < avail ? words[base + 64u + lane] : 0u;
                }
                if (active) {
                    x[h] = xx;
                    const float v = cg_dequant(units[sym], scale);
                    if (dtype == CG_DTYPE_F32)
                        reinterpret_cast<uint32_t *>(outb)[rowbase + c] = cg_bits_from_f32(v);
                    else if (dtype == CG_DTYPE_BF16)
                        reinterpret_cast<uint16_t *>(outb)[rowbase + c] = cg_f32_to_bf16(v);
                    else
                        reinterpret_cast<uint16_t *>(outb)[rowbase + c] = cg_f32_to_f16(v);
                }
            }
        }
        if (__any_sync(kFull, overrun)) {
            if (lane == 0) errs[s] = CGC_DEC_SHORT;
            return;
        }
    }
    if (__any_sync(kFull, x[0] != CG_RANS_L || x[1] != CG_RANS_L)) {
        if (lane == 0) errs[s] = CGC_DEC_FINAL_STATE;
        return;
    }
    if (lane == 0) {
        const uint32_t used = 2u * wpos;
        const uint32_t want_pad = (used & 2u) ? 2u : 0u;
        const uint32_t left = 2u * avail + (uint32_t)((sec.src_len - side_bytes - 4u * (uint64_t)N) & 1u) - used;
        int e = CGC_DEC_OK;
        if (left != want_pad) e = CGC_DEC_TRAILING;
        else if (want_pad && words[wpos] != 0) e = CGC_DEC_PAD_NONZERO;
        errs[s] = e;
    }
}

int sm_count() {
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 1;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || v < 1) return 1;
    return v;
}

/* Warps (sections) per block: up to `most`, but few enough that a small launch
 * (one chunk: 2 L sections) still spreads over the SMs instead of packing
 * 4 sections on each of a few. */
int spread_warps(uint32_t nsec, int most) {
    const uint32_t per_sm = (nsec + (uint32_t)sm_count() - 1u) / (uint32_t)sm_count();
    return per_sm < (uint32_t)most ? (per_sm ? (int)per_sm : 1) : most;
}

int max_smem_optin() {
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 48 * 1024;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) return 48 * 1024;
    return v;
}

/* per-warp table bytes in shared memory */
uint64_t smem_table_bytes(uint32_t C, int M) { return cgc_dec_table_bytes(C, M); }

}  // namespace

extern "C" const char *cgc_last_error(void) { return g_err; }

extern "C" const char *cgc_decode_error_string(int code) {
    switch (code) {
    case CGC_DEC_OK: return "ok";
    case CGC_DEC_SCALES: return "scale block is corrupt";
    case CGC_DEC_SCALE_VALUE: return "a scale is negative, infinite or NaN";
    case CGC_DEC_MEANS: return "mean block is corrupt";
    case CGC_DEC_SIGMAS: return "sigma block is corrupt";
    case CGC_DEC_SIDE_OVERRUN: return "side information overruns its section";
    case CGC_DEC_SIDE_PADDING: return "nonzero padding after side information";
    case CGC_DEC_NO_STATES: return "section too short for its rANS states";
    case CGC_DEC_STATE_LOW: return "rANS state below its lower bound";
    case CGC_DEC_SHORT: return "rANS stream ends early";
    case CGC_DEC_FINAL_STATE: return "rANS stream does not end in its initial state";
    case CGC_DEC_TRAILING: return "rANS stream has trailing bytes";
    case CGC_DEC_PAD_NONZERO: return "nonzero section padding";
    default: return "unknown error";
    }
}

extern "C" uint64_t cgc_encode_scratch_bytes(uint32_t T, uint32_t C, int M) { return cgc_encode_layout(T, C, M).total; }

extern "C" uint64_t cgc_decode_scratch_bytes(uint32_t T, uint32_t C, int M, int with_tables) {
    return cgc_decode_layout(T, C, M, with_tables).total;
}

extern "C" int cgc_encode_sections(const cgc_section *secs, cgc_enc_result *res, uint32_t nsec, uint32_t max_T,
                                   uint32_t max_C, void *stream) {
    g_err[0] = 0;
    if (nsec == 0) return 0;
    if (nsec > 65535u) { snprintf(g_err, sizeof g_err, "at most 65535 sections per launch"); return -1; }
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    k_quantize<<<dim3((max_T + 7u) / 8u, nsec), 256, 0, st>>>(secs, res);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return fail("k_quantize launch", e);
    k_tables<<<dim3((max_C + 127u) / 128u, nsec), 128, 0, st>>>(secs, res);
    if ((e = cudaGetLastError()) != cudaSuccess) return fail("k_tables launch", e);
    const unsigned blocks = (nsec + kWarpsPerBlock - 1u) / kWarpsPerBlock;
    k_side<<<blocks, 32 * kWarpsPerBlock, 0, st>>>(secs, res, nsec);
    if ((e = cudaGetLastError()) != cudaSuccess) return fail("k_side launch", e);
    k_rans<<<blocks, 32 * kWarpsPerBlock, 0, st>>>(secs, res, nsec);
    if ((e = cudaGetLastError()) != cudaSuccess) return fail("k_rans launch", e);
    return 0;
}

extern "C" int cgc_assemble_sections(const cgc_section *secs, const cgc_enc_result *res, uint32_t nsec, uint8_t *out,
                                     void *stream) {
    g_err[0] = 0;
    if (nsec == 0) return 0;
    k_assemble<<<nsec, 256, 0, static_cast<cudaStream_t>(stream)>>>(secs, res, out);
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? 0 : fail("k_assemble launch", e);
}

static int warps_that_fit(uint64_t per_warp) {
    const uint64_t room = (uint64_t)max_smem_optin() - 8192u; /* static shared memory and slack */
    const uint64_t w = per_warp ? room / per_warp : kWarpsPerBlock;
    return (int)(w > (uint64_t)kWarpsPerBlock ? kWarpsPerBlock : w);
}

extern "C" int cgc_decode_tables_in_smem(uint32_t max_C, int max_M) {
    return warps_that_fit(smem_table_bytes(max_C, max_M));
}

extern "C" int cgc_decode_gtab_in_smem(uint32_t max_C, int max_M) {
    const uint64_t entries = cgc_gtab_entries(max_M);
    if (entries > 65535u) return 0; /* channel bases are u16 */
    return warps_that_fit(cgc_gtab_smem_bytes(max_C, max_M));
}

/* The variant's kernel: the bits CGC_VAR_* (the GTAB kernels keep their tables in shared memory). */
template <bool SMEM>
void *decode_kernel(int variant) {
    if (variant & CGC_VAR_GTAB)
        return (variant & CGC_VAR_WINDOW) ? (void *)k_decode<true, false, true, true> : (void *)k_decode<true, false, false, true>;
    switch (variant & 3) {
    case 0: return (void *)k_decode<SMEM, false, false, false>;
    case 1: return (void *)k_decode<SMEM, true, false, false>;
    case 2: return (void *)k_decode<SMEM, false, true, false>;
    default: return (void *)k_decode<SMEM, true, true, false>;
    }
}

cudaError_t launch_decode(void *kernel, unsigned blocks, unsigned threads, size_t smem, cudaStream_t st,
                          const cgc_section *secs, int32_t *errs, uint32_t nsec, uint32_t tab_u16) {
    void *args[] = {(void *)&secs, (void *)&errs, (void *)&nsec, (void *)&tab_u16};
    return cudaLaunchKernel(kernel, dim3(blocks), dim3(threads), args, smem, st);
}

extern "C" int cgc_decode_sections(const cgc_section *secs, int32_t *errs, uint32_t nsec, uint32_t max_C, int max_M,
                                   int tables_in_smem, int variant, void *stream) {
    g_err[0] = 0;
    if (nsec == 0) return 0;
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    cudaError_t e;
    const bool gtab = (variant & CGC_VAR_GTAB) != 0;
    if (gtab && tables_in_smem <= 0) {
        snprintf(g_err, sizeof g_err, "the Gaussian-table decoder needs its tables in shared memory");
        return -1;
    }
    if (tables_in_smem > 0) {
        const int wpb = spread_warps(nsec, tables_in_smem > kWarpsPerBlock ? kWarpsPerBlock : tables_in_smem);
        const uint64_t per_warp = gtab ? cgc_gtab_smem_bytes(max_C, max_M) : smem_table_bytes(max_C, max_M);
        const size_t bytes = (size_t)per_warp * (size_t)wpb;
        if (bytes > (size_t)max_smem_optin()) {
            snprintf(g_err, sizeof g_err, "decoder tables need %zu bytes of shared memory", bytes);
            return -1;
        }
        void *kernel = decode_kernel<true>(variant);
        if ((e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes)) != cudaSuccess)
            return fail("cudaFuncSetAttribute", e);
        const unsigned blocks = (nsec + (unsigned)wpb - 1u) / (unsigned)wpb;
        e = launch_decode(kernel, blocks, 32u * wpb, bytes, st, secs, errs, nsec, (uint32_t)(per_warp / 2u));
    } else {
        const int wpb = spread_warps(nsec, kWarpsPerBlock);
        const unsigned blocks = (nsec + (unsigned)wpb - 1u) / (unsigned)wpb;
        e = launch_decode(decode_kernel<false>(variant), blocks, 32u * wpb, 0, st, secs, errs, nsec, 0);
    }
    return e == cudaSuccess ? 0 : fail("k_decode launch", e);
}
