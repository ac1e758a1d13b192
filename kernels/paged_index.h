/*
 * Index arithmetic of the fused paged gather/scatter, shared by the CUDA
 * kernel (kernels/paged_copy.cu) and the CPU build (tests compile
 * kernels/paged_index_test_shim.c with gcc and compare it with
 * kvtool/connectors/paged_copy.py). Everything that decides WHICH bytes move
 * where lives here; the kernel only loads and stores.
 *
 * Mirrors `slot_to_block_offset` and `run_offset` of
 * kvtool/connectors/paged_copy.py (layouts, per layer; H heads, D head_dim):
 *   flash_attn  [2, NB, BS, H, D]     flashinfer [NB, 2, BS, H, D]
 *   vllm        [NB, H, BS, 2*D]      kv_tuple   K, V each [NB, BS, H, D]
 * and the KV_BLOB [2, L, T, H*D] (contiguous) on the other side.
 *
 * Work decomposition. One launch moves every (kv, layer, token) row of a token
 * range. A row is H*D blob elements; it is cut into "items" of E consecutive
 * channels of one head (E divides D; E > 1 only when the cache's channels are
 * contiguous). Item i of a launch is, from the fastest-varying index:
 *   v = i mod VPR (VPR = H * D/E items per row), row = i / VPR;
 *   token = row mod Tn, kl = row / Tn, layer = kl mod L, kv = kl / L;
 *   head = v / (D/E), chan = (v mod (D/E)) * E.
 * so consecutive threads touch consecutive blob bytes. Division is by
 * precomputed 32-bit magic numbers (item indices < 2^31).
 *
 * Plain C99 (+ stdint); under nvcc every function is __host__ __device__.
 */
#ifndef KVTOOL_PAGED_INDEX_H
#define KVTOOL_PAGED_INDEX_H

#include <stdint.h>

#ifdef __CUDACC__
#define KVT_FN __host__ __device__ __forceinline__
#else
#define KVT_FN static inline
#endif

/* layouts: the order of kvtool.connectors.PagedLayout */
#define KVT_LAYOUT_FLASH_ATTN 0
#define KVT_LAYOUT_FLASHINFER 1
#define KVT_LAYOUT_VLLM 2
#define KVT_LAYOUT_KV_TUPLE 3

#define KVT_MAX_ITEMS 0x7FFFFFFFu /* items per launch (exclusive bound): 2^31 - 1 */

/* plan_init errors */
#define KVT_OK 0
#define KVT_ERR_LAYOUT 1
#define KVT_ERR_SHAPE 2
#define KVT_ERR_VEC 3

/* ---- slots and run offsets (mirror of paged_copy.py) ---------------------- */

/* slot -> (block, offset), slot = block * block_size + offset; slot >= 0 */
KVT_FN void kvt_slot_to_block_offset(int64_t slot, int64_t block_size, int64_t *block, int64_t *offset) {
    *block = slot / block_size;
    *offset = slot - *block * block_size;
}

/* number of dims of the tensor that holds K (and V): 5 or 4 */
KVT_FN int kvt_layout_ndim(int layout) {
    return (layout == KVT_LAYOUT_FLASH_ATTN || layout == KVT_LAYOUT_FLASHINFER) ? 5 : 4;
}

/* Element offset of the first of the D channels of head `head` of the token
 * at (block, offset), K if kv == 0 else V, from the start of the tensor that
 * holds it (kv_tuple: the K or the V tensor; kv does not enter the offset).
 * `s` are that tensor's element strides; channel c is at + c * s[ndim-1]. */
KVT_FN int64_t kvt_run_offset(int layout, int64_t kv, int64_t block, int64_t offset, int64_t head,
                              const int64_t *s, int64_t head_dim) {
    switch (layout) {
    case KVT_LAYOUT_FLASH_ATTN: /* [2, NB, BS, H, D] */
        return kv * s[0] + block * s[1] + offset * s[2] + head * s[3];
    case KVT_LAYOUT_FLASHINFER: /* [NB, 2, BS, H, D] */
        return block * s[0] + kv * s[1] + offset * s[2] + head * s[3];
    case KVT_LAYOUT_VLLM: /* [NB, H, BS, 2*D] */
        return block * s[0] + head * s[1] + offset * s[2] + kv * head_dim * s[3];
    default: /* KVT_LAYOUT_KV_TUPLE: K or V, [NB, BS, H, D] */
        return block * s[0] + offset * s[1] + head * s[2];
    }
}

/* ---- 32-bit division by an invariant divisor ------------------------------
 * q = (umulhi(n, m) + n) >> shift, exact for 1 <= d <= 2^31 and n < 2^31
 * (Granlund-Montgomery, as in PyTorch's IntDivider). */
typedef struct {
    uint32_t d;
    uint32_t m;
    uint32_t shift;
} kvt_divider;

KVT_FN kvt_divider kvt_divider_make(uint32_t d) {
    kvt_divider r;
    uint32_t sh = 0;
    while (sh < 32 && ((uint64_t)1 << sh) < (uint64_t)d) sh++;
    r.d = d;
    r.shift = sh;
    r.m = (uint32_t)((((uint64_t)1 << 32) * (((uint64_t)1 << sh) - (uint64_t)d)) / (uint64_t)d + 1u);
    return r;
}

KVT_FN uint32_t kvt_umulhi(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
    return __umulhi(a, b);
#else
    return (uint32_t)(((uint64_t)a * (uint64_t)b) >> 32);
#endif
}

KVT_FN uint32_t kvt_div(kvt_divider dv, uint32_t n) { return (kvt_umulhi(n, dv.m) + n) >> dv.shift; }

/* ---- the plan of one launch ----------------------------------------------- */
typedef struct {
    int32_t layout;
    int32_t ndim;            /* dims of the K/V-holding tensor (4 or 5) */
    int32_t num_layers;      /* L */
    int32_t num_heads;       /* H */
    int32_t head_dim;        /* D */
    int32_t block_size;      /* BS */
    int32_t elems_per_item;  /* E */
    int32_t slots_fit_32;    /* every slot < 2^31: divide slots with div_block */
    int64_t strides[5];      /* element strides of the K/V-holding tensor (first ndim used) */
    int64_t blob_tokens;     /* T: the blob's token dim (row pitch of a layer) */
    int64_t token_begin;     /* first blob token of this launch */
    uint32_t num_tokens;     /* Tn: tokens of this launch */
    uint32_t num_items;      /* 2 * L * Tn * VPR */
    uint32_t items_per_row;  /* VPR = H * D / E */
    uint32_t items_per_head; /* D / E */
    kvt_divider div_row;     /* by VPR */
    kvt_divider div_head;    /* by D / E */
    kvt_divider div_tokens;  /* by Tn */
    kvt_divider div_layers;  /* by L */
    kvt_divider div_block;   /* by BS */
} kvt_paged_plan;

/* The widest access, in bytes (1..16, a power of two, a multiple of esize),
 * that every item can use: E = vec/esize consecutive channels must be
 * contiguous (s_last == 1), lie in one head (E | D), and start at addresses
 * that are multiples of vec on both sides. `align_bits` is the OR of every
 * base address, every non-last byte stride of the cache tensors, and the
 * blob's address and row pitch in bytes: its lowest set bit bounds the
 * alignment. esize: bytes per element (the larger of the two sides when they
 * differ is handled by the caller, which passes the cache's). */
KVT_FN uint32_t kvt_pick_vec_bytes(uint64_t align_bits, int64_t head_dim, uint32_t esize, int64_t s_last) {
    if (s_last != 1) return esize;
    uint32_t vec = 16;
    while (vec > esize) {
        if (vec % esize == 0 && (align_bits & (uint64_t)(vec - 1)) == 0 &&
            (head_dim % (int64_t)(vec / esize)) == 0)
            return vec;
        vec >>= 1;
    }
    return esize;
}

/* Fill a plan for tokens [token_begin, token_begin + num_tokens) of a blob of
 * blob_tokens tokens. num_slots = NB * BS. Returns KVT_OK or a KVT_ERR_*. The
 * caller splits token ranges so that 2 * L * Tn * VPR < 2^31
 * (kvt_max_tokens_per_launch). */
KVT_FN int kvt_plan_init(kvt_paged_plan *p, int layout, const int64_t *strides, int64_t num_layers,
                         int64_t num_heads, int64_t head_dim, int64_t block_size, int64_t num_slots,
                         int64_t elems_per_item, int64_t blob_tokens, int64_t token_begin,
                         int64_t num_tokens) {
    if (layout < KVT_LAYOUT_FLASH_ATTN || layout > KVT_LAYOUT_KV_TUPLE) return KVT_ERR_LAYOUT;
    if (num_layers < 1 || num_heads < 1 || head_dim < 1 || block_size < 1 || num_tokens < 1 ||
        token_begin < 0 || token_begin + num_tokens > blob_tokens || num_layers > 0x7FFFFFFF ||
        num_heads > 0x7FFFFFFF || head_dim > 0x7FFFFFFF || block_size > 0x7FFFFFFF)
        return KVT_ERR_SHAPE;
    if (elems_per_item < 1 || head_dim % elems_per_item != 0) return KVT_ERR_VEC;
    const int64_t per_head = head_dim / elems_per_item;
    const int64_t per_row = per_head * num_heads;
    if (per_row > (int64_t)KVT_MAX_ITEMS || 2 * num_layers * per_row > (int64_t)KVT_MAX_ITEMS ||
        2 * num_layers * num_tokens * per_row > (int64_t)KVT_MAX_ITEMS - 1)
        return KVT_ERR_SHAPE;
    p->layout = layout;
    p->ndim = kvt_layout_ndim(layout);
    for (int k = 0; k < 5; k++) p->strides[k] = k < p->ndim ? strides[k] : 0;
    p->num_layers = (int32_t)num_layers;
    p->num_heads = (int32_t)num_heads;
    p->head_dim = (int32_t)head_dim;
    p->block_size = (int32_t)block_size;
    p->elems_per_item = (int32_t)elems_per_item;
    p->slots_fit_32 = num_slots <= (int64_t)0x7FFFFFFF;
    p->blob_tokens = blob_tokens;
    p->token_begin = token_begin;
    p->num_tokens = (uint32_t)num_tokens;
    p->items_per_row = (uint32_t)per_row;
    p->items_per_head = (uint32_t)per_head;
    p->num_items = (uint32_t)(2 * num_layers * num_tokens * per_row);
    p->div_row = kvt_divider_make((uint32_t)per_row);
    p->div_head = kvt_divider_make((uint32_t)per_head);
    p->div_tokens = kvt_divider_make((uint32_t)num_tokens);
    p->div_layers = kvt_divider_make((uint32_t)num_layers);
    p->div_block = kvt_divider_make((uint32_t)block_size);
    return KVT_OK;
}

/* Tokens per launch such that the item count stays below 2^31. */
KVT_FN int64_t kvt_max_tokens_per_launch(int64_t num_layers, int64_t items_per_row) {
    int64_t per_token = 2 * num_layers * items_per_row;
    if (per_token <= 0) return 0;
    return ((int64_t)KVT_MAX_ITEMS - 1) / per_token;
}

/* ---- one item ------------------------------------------------------------- */
typedef struct {
    uint32_t kv;     /* 0 = K, 1 = V */
    uint32_t layer;
    uint32_t token;  /* within the launch: slot index is token_begin + token */
    uint32_t head;
    uint32_t chan;   /* first channel of the item */
} kvt_item;

KVT_FN kvt_item kvt_decompose(const kvt_paged_plan *p, uint32_t i) {
    kvt_item it;
    const uint32_t row = kvt_div(p->div_row, i);
    const uint32_t v = i - row * p->items_per_row;
    const uint32_t kl = kvt_div(p->div_tokens, row);
    it.token = row - kl * p->num_tokens;
    it.kv = kvt_div(p->div_layers, kl);
    it.layer = kl - it.kv * (uint32_t)p->num_layers;
    it.head = kvt_div(p->div_head, v);
    it.chan = (v - it.head * p->items_per_head) * (uint32_t)p->elems_per_item;
    return it;
}

/* which entry of the layer-pointer array holds this item:
 * kv_tuple: 2 * layer + kv (K and V are separate tensors); else layer */
KVT_FN uint32_t kvt_ptr_index(const kvt_paged_plan *p, const kvt_item *it) {
    return p->layout == KVT_LAYOUT_KV_TUPLE ? 2u * it->layer + it->kv : it->layer;
}

/* element offset of the item's first channel in its cache tensor, for the slot
 * of its token (slot in [0, num_slots)) */
KVT_FN int64_t kvt_cache_elem(const kvt_paged_plan *p, const kvt_item *it, int64_t slot) {
    int64_t block, offset;
    if (p->slots_fit_32) {
        const uint32_t b = kvt_div(p->div_block, (uint32_t)slot);
        block = (int64_t)b;
        offset = (int64_t)((uint32_t)slot - b * (uint32_t)p->block_size);
    } else {
        kvt_slot_to_block_offset(slot, (int64_t)p->block_size, &block, &offset);
    }
    return kvt_run_offset(p->layout, (int64_t)it->kv, block, offset, (int64_t)it->head, p->strides,
                          (int64_t)p->head_dim) +
           (int64_t)it->chan * p->strides[p->ndim - 1];
}

/* element offset of the item's first channel in the contiguous blob
 * [2, L, blob_tokens, H*D] */
KVT_FN int64_t kvt_blob_elem(const kvt_paged_plan *p, const kvt_item *it) {
    const int64_t row = ((int64_t)it->kv * p->num_layers + it->layer) * p->blob_tokens + p->token_begin + it->token;
    return row * ((int64_t)p->num_heads * p->head_dim) + (int64_t)it->head * p->head_dim + it->chan;
}

#endif /* KVTOOL_PAGED_INDEX_H */
