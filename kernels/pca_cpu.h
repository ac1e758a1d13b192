/* CPU coder of the pca codec (format-spec/pca.md): one chunk payload, rows over pthreads.
 * Bit-exact with kvtool/codecs/pca/reference.py. Everything that depends on the calibration
 * object (and the RoPE tables) is prepared by the caller (kvtool/codecs/pca/native.py), so the
 * float inputs of both coders are the same numbers. */
#ifndef KVTOOL_PCA_CPU_H
#define KVTOOL_PCA_CPU_H

#include <stddef.h>
#include <stdint.h>

#define PCA_OK 0
#define PCA_ERR_NONFINITE 1
#define PCA_ERR_NOMEM 2
#define PCA_ERR_PARAM 3
#define PCA_ERR_CORRUPT 4
#define PCA_ERR_RANGE 5 /* encode: a token's sum of |q| exceeds 2^16 at this step */
#define PCA_ERR_UNIT 6  /* encode, version 2: a pair of units exceeds 65535 bytes */

#define PCA_DTYPE_BF16 0
#define PCA_DTYPE_F16 1
#define PCA_DTYPE_F32 2

typedef struct {
    int dtype;            /* PCA_DTYPE_* */
    uint32_t layers;      /* L (rows: 2L) */
    uint32_t tokens;      /* T */
    uint32_t channels;    /* C: even, <= 4096 */
    uint32_t head_dim;    /* D: even, divides C */
    uint32_t sinks;       /* S: tokens kept exact (encode: given; decode: must match the payload) */
    uint32_t lanes;       /* encode: 1..64 (decode: read from the payload) */
    uint32_t cols;        /* C rounded up to a multiple of 24: the padded width of m2 */
    uint32_t block;       /* 0, or D when every row's basis is block-diagonal in KV heads (zero outside the
                           * D x D blocks of head h's channels and components hD..hD+D-1; D a multiple
                           * of 8): the transform then multiplies the blocks only (the sums are the same
                           * integers, as the terms left out are zeros) */
    const float *mean;    /* [2][L][C] */
    const float *weight;  /* [2][L][C] (encode) */
    const float *gain;    /* [2][L][C]: h = f32(f64(step) / (16384 f64(weight))) (decode) */
    const int16_t *m2;    /* [2][L][C/2][cols][2]: pairs (M[2i][j], M[2i+1][j]); M = basis (encode:
                           * rows c, columns k) or its transpose (decode: rows k, columns c) */
    const int16_t *basis; /* [2][L][C][C] as stored (encode: the exact path of large tokens) */
    const int64_t *sumsq_limit; /* [2][L] (encode): a token whose sum of U^2 is at most this has
                                 * every partial sum of its transform within int32 */
    const float *cos;     /* [nrope][T - S][D/2]: positions start + S ... (layers with the same */
    const float *sin;     /* RoPE frequencies share one table) */
    uint32_t nrope;
    const int32_t *rope_of_layer; /* [L]: the table of layer l, < nrope */
    double r;             /* encode: f64(1 / (step * 2^22)) */
    const int32_t *freq;  /* [32][16] FREQ of _tables.py */
    const int32_t *cost;  /* [32][16] COST_Q8 */
    const uint8_t *slot_sym; /* [32][4096]: the symbol whose cumulative range holds a slot. Not read
                              * since the decoder's packed table (pca_rans.h) is built from freq;
                              * kept so the binding's signature stays */
} pca_chunk;

/* Encode a contiguous [2, L, T, C] array of dtype elements. On PCA_OK *out is a malloc'ed
 * payload of *out_len bytes (caller frees). */
int pca_encode_chunk(const void *kv, const pca_chunk *ck, int threads, uint8_t **out, size_t *out_len,
                     char *err, size_t errlen);

/* Decode a payload into out ([2, L, T, C] elements of dtype). */
int pca_decode_chunk(const uint8_t *payload, size_t len, const pca_chunk *ck, void *out, int threads,
                     char *err, size_t errlen);

/* Decode a version-2 payload (format-spec/pca.md §11) into out, but for its sinks: units [n][6]
 * (row, first symbol, count, stream's first byte, direction +-1, length) and row_units [2L + 1]
 * (row r's units are row_units[r] .. row_units[r + 1] - 1) as the caller parsed them from the
 * payload; consumed[u] (out): unit u's stream bytes used, for the caller's check of each region. */
int pca_decode_chunk_v2(const uint8_t *payload, size_t len, const pca_chunk *ck, const int64_t *units, uint32_t nunits,
                        const int32_t *row_units, int64_t *consumed, void *out, int threads, char *err,
                        size_t errlen);

/* Encode a version-2 chunk: on PCA_OK the buffer alloc(ctx, size) gave (the caller's) holds the
 * whole payload of format-spec/pca.md §11.2: head (the caller's header), the side bytes [2L][C],
 * sinks (the caller's), the u16 region table, then the regions (units 2j and 2j + 1's streams,
 * the second backward). PCA_ERR_UNIT when a region exceeds 65535 bytes (nothing allocated). */
int pca_encode_chunk_v2(const void *kv, const pca_chunk *ck, uint32_t unit, int threads, const uint8_t *head,
                        size_t head_len, const uint8_t *sinks, size_t sink_len, uint8_t *(*alloc)(void *, size_t),
                        void *ctx, char *err, size_t errlen);

/* f32 -> f16 bits as numpy's astype(float16) does (round to nearest even, NaN payloads kept):
 * exposed for the tests. */
uint16_t pca_f32_to_f16(float f);

#endif
