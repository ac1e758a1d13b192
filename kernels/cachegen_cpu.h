/* CPU driver of the CacheGen codec: whole-chunk encode/decode over threads. */
#ifndef KVTOOL_CACHEGEN_CPU_H
#define KVTOOL_CACHEGEN_CPU_H

#include <stddef.h>
#include <stdint.h>

#define CG_OK 0
#define CG_ERR_NONFINITE 1
#define CG_ERR_NOMEM 2
#define CG_ERR_PARAM 3
#define CG_ERR_CORRUPT 4

typedef struct {
    int dtype;              /* CG_DTYPE_* */
    uint32_t layers;        /* 2L */
    uint32_t tokens;        /* T */
    uint32_t channels;      /* C */
    const uint16_t *bins;   /* bin count per layer, `layers` entries */
    int prob_bits;          /* encode only: CG_PROB_BITS_MIN..MAX */
    int lanes;              /* encode only: 1..CG_LANES_MAX */
} cg_chunk;

/* Encode a contiguous [layers, tokens, channels] array of `dtype` elements.
 * On CG_OK *out is a malloc'ed payload of *out_len bytes (caller frees). */
int cg_encode_chunk(const void *kv, const cg_chunk *ck, int threads,
                    uint8_t **out, size_t *out_len, char *err, size_t errlen);

/* Decode a payload into `out` (layers*tokens*channels elements of dtype).
 * ck->prob_bits / lanes are ignored (read from the payload) and, on success,
 * set to the payload's values. */
int cg_decode_chunk(const uint8_t *payload, size_t len, cg_chunk *ck, void *out,
                    int threads, char *err, size_t errlen);

#endif
