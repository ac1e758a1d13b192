/*
 * Fused multi-layer paged gather/scatter (kernels/paged_copy.cu): one launch
 * moves a token range of every layer's K and V between paged engine buffers
 * and a contiguous KV_BLOB [2, L, T, H*D], following a slot mapping. Same
 * semantics as kvtool.connectors.paged_copy.gather_paged / scatter_paged;
 * index arithmetic in kernels/paged_index.h.
 *
 * C ABI (loaded with ctypes by kvtool/cuda/paged.py). Pointers are device
 * pointers, except `blob` with blob_on_host != 0: then it is pinned host
 * memory (cudaHostAlloc / cudaHostRegister), reached through its mapped
 * device address, so the kernel reads or writes host memory over the bus.
 */
#ifndef KVTOOL_PAGED_COPY_H
#define KVTOOL_PAGED_COPY_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* element types. Values of the same code move as raw bytes (any element size:
 * use KVT_DT_RAW(esize) for dtypes other than these three); different codes
 * convert (round to nearest even, as torch's copy_). */
#define KVT_DT_BF16 0
#define KVT_DT_F16 1
#define KVT_DT_F32 2
#define KVT_DT_RAW(esize) (16 + (esize)) /* esize 1, 2, 4 or 8: raw bytes */

#define KVT_GATHER 0  /* cache -> blob */
#define KVT_SCATTER 1 /* blob -> cache */

/* Returns 0 on success, else an error code with kvt_paged_last_error() set.
 * layout: KVT_LAYOUT_* (paged_index.h); strides: the ndim (5 or 4) element
 *   strides of every layer's K/V-holding tensor (all layers alike);
 * layer_ptrs: device array of L (kv_tuple: 2L, K then V per layer) base
 *   addresses; align_bits: OR of those addresses (the host knows them);
 * slots: device int64 array of num_tokens slots, each in [0, NB*BS);
 * blob: [2, L, num_tokens, H*D] contiguous;
 * stream: a cudaStream_t (0: the legacy default stream). */
int kvt_paged_copy(int direction, int layout, const int64_t *strides, int64_t num_layers, int64_t num_heads,
                   int64_t head_dim, int64_t block_size, int64_t num_blocks, const uint64_t *layer_ptrs,
                   uint64_t align_bits, const int64_t *slots, int64_t num_tokens, void *blob, int blob_on_host,
                   int cache_dtype, int blob_dtype, void *stream);

/* the message of the last failure in this thread */
const char *kvt_paged_last_error(void);

/* access width (bytes) the last successful call used: a test/benchmark probe */
int kvt_paged_last_vec_bytes(void);

#ifdef __cplusplus
}
#endif

#endif /* KVTOOL_PAGED_COPY_H */
