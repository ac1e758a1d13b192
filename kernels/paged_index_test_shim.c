/*
 * CPU test shim of kernels/paged_index.h: compiled with gcc into a shared
 * library by tests/test_cuda.py and driven through ctypes, so the CPU build
 * exercises exactly the index arithmetic the CUDA kernel uses.
 */
#include <stdint.h>

#include "paged_index.h"

int64_t shim_run_offset(int layout, int64_t kv, int64_t block, int64_t offset, int64_t head, const int64_t *s,
                        int64_t head_dim) {
    return kvt_run_offset(layout, kv, block, offset, head, s, head_dim);
}

void shim_slot_to_block_offset(int64_t slot, int64_t block_size, int64_t *block, int64_t *offset) {
    kvt_slot_to_block_offset(slot, block_size, block, offset);
}

/* number of n in [n0, n1) where the magic division by d is wrong */
int64_t shim_div_mismatches(uint32_t d, uint32_t n0, uint32_t n1) {
    kvt_divider dv = kvt_divider_make(d);
    int64_t bad = 0;
    for (uint64_t n = n0; n < n1; n++)
        if (kvt_div(dv, (uint32_t)n) != (uint32_t)n / d) bad++;
    return bad;
}

uint32_t shim_div(uint32_t d, uint32_t n) { return kvt_div(kvt_divider_make(d), n); }

uint32_t shim_pick_vec_bytes(uint64_t align_bits, int64_t head_dim, uint32_t esize, int64_t s_last) {
    return kvt_pick_vec_bytes(align_bits, head_dim, esize, s_last);
}

int64_t shim_max_tokens_per_launch(int64_t num_layers, int64_t items_per_row) {
    return kvt_max_tokens_per_launch(num_layers, items_per_row);
}

/* The whole per-item mapping of one launch, as the kernel computes it:
 * for item i, cache_elem[i] (element offset in tensor ptr_index[i]) and
 * blob_elem[i] of its first channel; slots are indexed by blob token.
 * Returns the item count, or -(plan error). */
int64_t shim_map(int layout, const int64_t *strides, int64_t num_layers, int64_t num_heads, int64_t head_dim,
                 int64_t block_size, int64_t num_blocks, int64_t elems_per_item, int64_t blob_tokens,
                 int64_t token_begin, int64_t num_tokens, const int64_t *slots, int64_t *cache_elem,
                 int64_t *blob_elem, int32_t *ptr_index, int64_t capacity) {
    kvt_paged_plan p;
    int rc = kvt_plan_init(&p, layout, strides, num_layers, num_heads, head_dim, block_size, num_blocks * block_size,
                           elems_per_item, blob_tokens, token_begin, num_tokens);
    if (rc != KVT_OK) return -(int64_t)rc;
    if ((int64_t)p.num_items > capacity) return -100;
    for (uint32_t i = 0; i < p.num_items; i++) {
        kvt_item it = kvt_decompose(&p, i);
        int64_t slot = slots[p.token_begin + it.token];
        cache_elem[i] = kvt_cache_elem(&p, &it, slot);
        blob_elem[i] = kvt_blob_elem(&p, &it);
        ptr_index[i] = (int32_t)kvt_ptr_index(&p, &it);
    }
    return (int64_t)p.num_items;
}
