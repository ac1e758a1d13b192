/*
 * Fused multi-layer paged gather/scatter (see paged_copy.h). One launch moves
 * every layer's K and V for a token range; the index arithmetic is the shared
 * host/device header paged_index.h, which the CPU tests exercise against
 * kvtool/connectors/paged_copy.py.
 *
 * Two kernels:
 *  - raw: same dtype on both sides; each item moves VB bytes (1..16, chosen by
 *    kvt_pick_vec_bytes: 16-byte accesses for contiguous head runs), U items
 *    per thread with all loads issued before the stores;
 *  - convert: the dtypes differ (bf16/fp16/fp32); one element per item,
 *    converted through fp32 with round-to-nearest-even (torch's copy_).
 * Build: nvcc -O3 -std=c++17 -arch=sm_90 -shared -Xcompiler -fPIC.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

#include "paged_copy.h"
#include "paged_index.h"

namespace {

thread_local char g_err[512];
thread_local int g_last_vec = 0;

int fail(int code, const char *fmt, const char *detail = nullptr) {
    snprintf(g_err, sizeof g_err, fmt, detail ? detail : "");
    return code;
}

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <int B> struct VecOf;
template <> struct VecOf<1> { typedef uint8_t T; };
template <> struct VecOf<2> { typedef uint16_t T; };
template <> struct VecOf<4> { typedef uint32_t T; };
template <> struct VecOf<8> { typedef uint2 T; };
template <> struct VecOf<16> { typedef uint4 T; };

/* Same dtype: move VB bytes per item (E = VB / esize channels). */
template <int VB, int DIR>
__global__ void __launch_bounds__(kThreads) paged_raw_kernel(const kvt_paged_plan p, const uint64_t *__restrict__ ptrs,
                                                             const int64_t *__restrict__ slots, char *blob, int esize) {
    typedef typename VecOf<VB>::T V;
    const uint32_t n = p.num_items;
    const uint32_t step = gridDim.x * blockDim.x * kUnroll;
    for (uint32_t base = blockIdx.x * blockDim.x * kUnroll + threadIdx.x; base < n; base += step) {
        V val[kUnroll];
        V *dst[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; u++) {
            const uint32_t i = base + (uint32_t)u * blockDim.x;
            dst[u] = nullptr;
            if (i < n) {
                const kvt_item it = kvt_decompose(&p, i);
                const int64_t slot = __ldg(slots + p.token_begin + it.token);
                char *cache = reinterpret_cast<char *>(__ldg(ptrs + kvt_ptr_index(&p, &it))) +
                              kvt_cache_elem(&p, &it, slot) * esize;
                char *b = blob + kvt_blob_elem(&p, &it) * esize;
                if (DIR == KVT_GATHER) {
                    val[u] = *reinterpret_cast<const V *>(cache);
                    dst[u] = reinterpret_cast<V *>(b);
                } else {
                    val[u] = *reinterpret_cast<const V *>(b);
                    dst[u] = reinterpret_cast<V *>(cache);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; u++)
            if (dst[u]) *dst[u] = val[u];
    }
}

/* element types of the convert kernel: storage, and the trip through fp32 */
struct Bf16 {
    typedef uint16_t S;
    static __device__ __forceinline__ float to_f32(S v) { return __uint_as_float((uint32_t)v << 16); }
    static __device__ __forceinline__ S from_f32(float f) {
        return __bfloat16_as_ushort(__float2bfloat16_rn(f));
    }
};
struct F16 {
    typedef uint16_t S;
    static __device__ __forceinline__ float to_f32(S v) { return __half2float(__ushort_as_half(v)); }
    static __device__ __forceinline__ S from_f32(float f) { return __half_as_ushort(__float2half_rn(f)); }
};
struct F32 {
    typedef float S;
    static __device__ __forceinline__ float to_f32(S v) { return v; }
    static __device__ __forceinline__ S from_f32(float f) { return f; }
};

/* Different dtypes: one element per item; gather converts cache -> blob,
 * scatter blob -> cache. */
template <typename CT, typename BT, int DIR>
__global__ void __launch_bounds__(kThreads) paged_convert_kernel(const kvt_paged_plan p, const uint64_t *__restrict__ ptrs,
                                                                 const int64_t *__restrict__ slots, char *blob) {
    typedef typename CT::S CS;
    typedef typename BT::S BS;
    const uint32_t n = p.num_items;
    const uint32_t step = gridDim.x * blockDim.x * kUnroll;
    for (uint32_t base = blockIdx.x * blockDim.x * kUnroll + threadIdx.x; base < n; base += step) {
        float val[kUnroll];
        void *dst[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; u++) {
            const uint32_t i = base + (uint32_t)u * blockDim.x;
            dst[u] = nullptr;
            if (i < n) {
                const kvt_item it = kvt_decompose(&p, i);
                const int64_t slot = __ldg(slots + p.token_begin + it.token);
                CS *cache = reinterpret_cast<CS *>(__ldg(ptrs + kvt_ptr_index(&p, &it))) + kvt_cache_elem(&p, &it, slot);
                BS *b = reinterpret_cast<BS *>(blob) + kvt_blob_elem(&p, &it);
                if (DIR == KVT_GATHER) {
                    val[u] = CT::to_f32(*cache);
                    dst[u] = b;
                } else {
                    val[u] = BT::to_f32(*b);
                    dst[u] = cache;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; u++) {
            if (!dst[u]) continue;
            if (DIR == KVT_GATHER)
                *reinterpret_cast<BS *>(dst[u]) = BT::from_f32(val[u]);
            else
                *reinterpret_cast<CS *>(dst[u]) = CT::from_f32(val[u]);
        }
    }
}

unsigned grid_for(uint32_t items) {
    uint64_t per_block = (uint64_t)kThreads * kUnroll;
    uint64_t g = ((uint64_t)items + per_block - 1) / per_block;
    return (unsigned)(g < 1 ? 1 : g);
}

template <int DIR>
cudaError_t launch_raw(uint32_t vec, const kvt_paged_plan &p, const uint64_t *ptrs, const int64_t *slots, char *blob,
                       int esize, cudaStream_t st) {
    const unsigned g = grid_for(p.num_items);
    switch (vec) {
    case 16: paged_raw_kernel<16, DIR><<<g, kThreads, 0, st>>>(p, ptrs, slots, blob, esize); break;
    case 8: paged_raw_kernel<8, DIR><<<g, kThreads, 0, st>>>(p, ptrs, slots, blob, esize); break;
    case 4: paged_raw_kernel<4, DIR><<<g, kThreads, 0, st>>>(p, ptrs, slots, blob, esize); break;
    case 2: paged_raw_kernel<2, DIR><<<g, kThreads, 0, st>>>(p, ptrs, slots, blob, esize); break;
    default: paged_raw_kernel<1, DIR><<<g, kThreads, 0, st>>>(p, ptrs, slots, blob, esize); break;
    }
    return cudaGetLastError();
}

template <typename CT, typename BT>
cudaError_t launch_convert2(int dir, const kvt_paged_plan &p, const uint64_t *ptrs, const int64_t *slots, char *blob,
                            cudaStream_t st) {
    const unsigned g = grid_for(p.num_items);
    if (dir == KVT_GATHER)
        paged_convert_kernel<CT, BT, KVT_GATHER><<<g, kThreads, 0, st>>>(p, ptrs, slots, blob);
    else
        paged_convert_kernel<CT, BT, KVT_SCATTER><<<g, kThreads, 0, st>>>(p, ptrs, slots, blob);
    return cudaGetLastError();
}

template <typename CT>
cudaError_t launch_convert1(int dir, int blob_dtype, const kvt_paged_plan &p, const uint64_t *ptrs,
                            const int64_t *slots, char *blob, cudaStream_t st) {
    switch (blob_dtype) {
    case KVT_DT_BF16: return launch_convert2<CT, Bf16>(dir, p, ptrs, slots, blob, st);
    case KVT_DT_F16: return launch_convert2<CT, F16>(dir, p, ptrs, slots, blob, st);
    default: return launch_convert2<CT, F32>(dir, p, ptrs, slots, blob, st);
    }
}

int dtype_esize(int code) {
    switch (code) {
    case KVT_DT_BF16:
    case KVT_DT_F16: return 2;
    case KVT_DT_F32: return 4;
    case KVT_DT_RAW(1): return 1;
    case KVT_DT_RAW(2): return 2;
    case KVT_DT_RAW(4): return 4;
    case KVT_DT_RAW(8): return 8;
    default: return 0;
    }
}

}  // namespace

extern "C" const char *kvt_paged_last_error(void) { return g_err; }
extern "C" int kvt_paged_last_vec_bytes(void) { return g_last_vec; }

extern "C" int kvt_paged_copy(int direction, int layout, const int64_t *strides, int64_t num_layers, int64_t num_heads,
                              int64_t head_dim, int64_t block_size, int64_t num_blocks, const uint64_t *layer_ptrs,
                              uint64_t align_bits, const int64_t *slots, int64_t num_tokens, void *blob,
                              int blob_on_host, int cache_dtype, int blob_dtype, void *stream) {
    g_err[0] = 0;
    if (direction != KVT_GATHER && direction != KVT_SCATTER) return fail(1, "bad direction");
    if (layout < KVT_LAYOUT_FLASH_ATTN || layout > KVT_LAYOUT_KV_TUPLE) return fail(1, "bad layout");
    const int ces = dtype_esize(cache_dtype), bes = dtype_esize(blob_dtype);
    if (!ces || !bes) return fail(1, "unsupported dtype code");
    const bool same = cache_dtype == blob_dtype;
    if (!same && (cache_dtype > KVT_DT_F32 || blob_dtype > KVT_DT_F32))
        return fail(1, "dtype conversion supports bfloat16, float16 and float32 only");
    if (num_tokens < 1 || num_layers < 1 || num_heads < 1 || head_dim < 1 || block_size < 1 || num_blocks < 1)
        return fail(1, "empty or negative shape");
    if (!layer_ptrs || !slots || !blob) return fail(1, "null pointer");

    char *dblob = static_cast<char *>(blob);
    if (blob_on_host) {
        cudaPointerAttributes attr;
        cudaError_t e = cudaPointerGetAttributes(&attr, blob);
        if (e != cudaSuccess) return fail(2, "blob pointer: %s", cudaGetErrorString(e));
        if (attr.type != cudaMemoryTypeHost || !attr.devicePointer)
            return fail(1, "the host blob is not pinned (page-locked) memory mapped for the device");
        dblob = static_cast<char *>(attr.devicePointer);
    }

    const int ndim = kvt_layout_ndim(layout);
    const int64_t s_last = strides[ndim - 1];
    uint64_t bits = align_bits | (uint64_t)(uintptr_t)dblob;
    for (int k = 0; k < ndim - 1; k++) bits |= (uint64_t)(strides[k] < 0 ? -strides[k] : strides[k]) * (uint64_t)ces;
    const uint32_t vec = same ? kvt_pick_vec_bytes(bits, head_dim, (uint32_t)ces, s_last) : (uint32_t)ces;
    const int64_t E = same ? (int64_t)(vec / (uint32_t)ces) : 1;
    const int64_t per_row = num_heads * (head_dim / E);
    const int64_t max_tok = kvt_max_tokens_per_launch(num_layers, per_row);
    if (max_tok < 1) return fail(1, "one token of all layers exceeds 2^31 items");

    cudaStream_t st = static_cast<cudaStream_t>(stream);
    for (int64_t t0 = 0; t0 < num_tokens; t0 += max_tok) {
        const int64_t tn = num_tokens - t0 < max_tok ? num_tokens - t0 : max_tok;
        kvt_paged_plan p;
        int rc = kvt_plan_init(&p, layout, strides, num_layers, num_heads, head_dim, block_size,
                               num_blocks * block_size, E, num_tokens, t0, tn);
        if (rc != KVT_OK) return fail(1, "bad geometry (plan error)");
        cudaError_t e;
        if (same) {
            e = direction == KVT_GATHER ? launch_raw<KVT_GATHER>(vec, p, layer_ptrs, slots, dblob, ces, st)
                                        : launch_raw<KVT_SCATTER>(vec, p, layer_ptrs, slots, dblob, ces, st);
        } else {
            switch (cache_dtype) {
            case KVT_DT_BF16: e = launch_convert1<Bf16>(direction, blob_dtype, p, layer_ptrs, slots, dblob, st); break;
            case KVT_DT_F16: e = launch_convert1<F16>(direction, blob_dtype, p, layer_ptrs, slots, dblob, st); break;
            default: e = launch_convert1<F32>(direction, blob_dtype, p, layer_ptrs, slots, dblob, st); break;
            }
        }
        if (e != cudaSuccess) return fail(2, "kernel launch failed: %s", cudaGetErrorString(e));
    }
    g_last_vec = (int)vec;
    return 0;
}
