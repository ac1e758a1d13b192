/*
 * pca CPU coder: the chunk payload of format-spec/pca.md, encoded and decoded one row (one part
 * of one layer) per task, rows spread over pthreads. Bytes and values equal
 * kvtool/codecs/pca/reference.py's: rows are coded independently (the reference advances all
 * rows' rANS lanes together, which changes nothing in any one row) and the payload is assembled
 * in row order, so the thread count changes nothing either.
 *
 * Per row, the decoder first runs the rANS lanes over all the row's symbols (component-major: the
 * lane of symbol i is i mod N; AVX2: 8 lanes a vector, pca_rans.c), then per component one pass
 * over its tokens that reads the escapes, low bits and sign bits in that same order into a row of
 * int16 coefficients; the rows are interleaved in pairs for the inverse transform, one int16
 * product per block of tokens (skipping the trailing components that are zero), and each token is
 * finished in pca_kernels.c. The encoder mirrors it: per token the forward step, per block of
 * tokens the product computed transposed (components come out as contiguous runs), per component
 * the (table, shift) choice and the raw parts, then the rANS lanes backwards.
 */
#include "pca_cpu.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pca_kernels.h"
#include "pca_rans.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvtool's pca coder assumes a little-endian host"
#endif

#define NSYM 16
#define NTAB 32
#define ESCAPE 15
#define PROB_BITS 12
#define RANS_L (1u << 16)
#define ALL_ZERO 0xFFu
#define Q_LIMIT 32767
#define U_LIMIT ((1 << 23) - 1)
#define L1_LIMIT (1u << 16)
#define HEADER 24u
#define ENTRY 16u
#define TBLK 64u /* decode: tokens per block of the transform (a multiple of PCA_TB): keeps Y in cache */
#define EBLK 72u /* encode: tokens per block of the transform, its columns (a multiple of PCA_JB) */

static size_t pad4(size_t n) { return (4u - (n & 3u)) & 3u; }
static uint32_t get_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint16_t get_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static void put_u32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static size_t esize(int dtype) { return dtype == PCA_DTYPE_F32 ? 4u : 2u; }


/* ------------------------------------------------------------------------ */
/* tables (format-spec/pca.md §6; given by the caller from _tables.py)        */
typedef struct {
    uint32_t freq[NTAB][NSYM], cum[NTAB][NSYM + 1];
    uint64_t cost_t[NSYM][NTAB];   /* COST_Q8 transposed: the choice sums over tables */
    int16_t cost16[NSYM / 2][NTAB][2]; /* the same as int16 pairs (pca_choose_shift) */
    int cost16_ok;                 /* every COST_Q8 <= 4096 */
    uint64_t rcp[NTAB][NSYM];      /* floor(2^32 / f): the encoder's x / f with one correction */
    uint32_t *dec;                 /* decode: [32][4096] pca_dec_entry of each slot (malloc'ed) */
    pca_enc_table enc[NTAB];       /* encode: the AVX2 loop's copy */
} tables;

static int pca_tables_init(tables *tb, const int32_t *freq, const int32_t *cost) {
    tb->cost16_ok = 1;
    for (int t = 0; t < NTAB; t++) {
        uint32_t c = 0;
        for (int j = 0; j < NSYM; j++) {
            const int32_t f = freq[t * NSYM + j];
            if (f < 1 || f > (1 << PROB_BITS)) return 0;
            tb->freq[t][j] = (uint32_t)f;
            tb->cum[t][j] = c;
            tb->rcp[t][j] = (1ull << 32) / (uint64_t)f;
            tb->enc[t].f[j] = (uint32_t)f;
            tb->enc[t].cum[j] = c;
            tb->enc[t].rcp[j] = 0xFFFFFFFFu / (uint32_t)f;
            tb->cost_t[j][t] = (uint64_t)(uint32_t)cost[t * NSYM + j];
            tb->cost16[j / 2][t][j % 2] = (int16_t)cost[t * NSYM + j];
            if ((uint32_t)cost[t * NSYM + j] > 4096u) tb->cost16_ok = 0;
            c += (uint32_t)f;
        }
        if (c != 1u << PROB_BITS) return 0;
        tb->cum[t][NSYM] = c;
    }
    return 1;
}

/* ------------------------------------------------------------------------ */
/* shared geometry                                                           */
typedef struct {
    const pca_chunk *ck;
    tables tb;
    uint32_t Tc, Tp;      /* coded tokens; rounded up to PCA_TB */
    size_t es;
} geo;

static const float *row_vec(const float *base, const pca_chunk *ck, uint32_t row) {
    return base + (size_t)row * ck->channels;
}

/* ------------------------------------------------------------------------ */
/* decoder                                                                   */
typedef struct {
    const uint8_t *side, *states, *words, *lo, *sign, *esc;
    uint32_t nwords, lo_bits, sign_bits, nesc;
} row_in;

typedef struct {
    int16_t *q;   /* pair-major [C/2][Tp][2]: the transform's input */
    int16_t *qc;  /* component-major [C][Tp] (the raw pass writes runs), then zeros [Tp] */
    int32_t *y;
    uint32_t *l1, *last, *pairs, *mag;
    uint16_t *live;
    uint8_t *sym, *tabs; /* the row's symbols; the table of each live component */
} dscratch;

#define FAIL(...) do { snprintf(msg, msglen, __VA_ARGS__); return PCA_ERR_CORRUPT; } while (0)

/* a row's rANS lanes between its first steps and the rest of its decoding */
typedef struct {
    uint32_t x[64]; /* the lanes' states */
    uint32_t nl;    /* live components */
    uint32_t wp;    /* the next word */
    size_t i;       /* symbols decoded */
} rans_state;

static const uint16_t no_words[1] = {0};

/* a row's words; a row without any reads word 0 of a one-word dummy */
static const uint8_t *row_words(const row_in *ri) { return ri->nwords ? ri->words : (const uint8_t *)no_words; }

/* the live components (s->live), their tables (s->tabs) and the lanes' first states */
static int rans_setup(const geo *g, const row_in *ri, uint32_t N, dscratch *s, rans_state *st, char *msg,
                      size_t msglen) {
    const uint32_t C = g->ck->channels, Tc = g->Tc;
    uint32_t nl = 0;
    uint64_t lo_expect = 0;
    for (uint32_t k = 0; k < C; k++) {
        const uint8_t sb = ri->side[k];
        if (sb == ALL_ZERO) continue;
        if ((sb >> 5) == 7) FAIL("a side byte names shift 7");
        s->live[nl++] = (uint16_t)k;
        lo_expect += (uint64_t)(sb >> 5) * Tc;
    }
    if (lo_expect != ri->lo_bits) FAIL("a row's low-bit count does not match its side bytes");
    for (uint32_t j = 0; j < nl; j++) s->tabs[j] = ri->side[s->live[j]] & 31u;
    for (uint32_t n = 0; n < N; n++) st->x[n] = get_u32(ri->states + 4 * n);
    st->nl = nl;
    st->wp = 0;
    st->i = 0;
    return PCA_OK;
}

/* entropy decode of one row into s->q, pair-major ([C/2][Tp][2]: component k of token t at
 * ((k/2) Tp + t) 2 + k%2, so one component's tokens are written in memory order), zero where
 * nothing is coded; st from rans_setup, its SIMD steps already taken when `stepped` */
static int decode_symbols(const geo *g, const row_in *ri, uint32_t N, dscratch *s, rans_state *st, int stepped,
                          char *msg, size_t msglen) {
    const uint32_t C = g->ck->channels, Tc = g->Tc, nl = st->nl;
    const size_t Tp = g->Tp;
    for (uint32_t t = 0; t < Tp; t++) s->l1[t] = s->last[t] = 0;
    uint32_t *x = st->x;
    pca_raw_in raw = {ri->lo, ri->sign, (size_t)(((uint64_t)ri->lo_bits + 7u) / 8u),
                      (size_t)(((uint64_t)ri->sign_bits + 7u) / 8u), 0, 0};
    /* Per component, three tight passes without data-dependent branches: the rANS symbols, the
     * magnitudes (escapes, rare, branch), the signs. Overruns are counted, not branched on, and
     * judged after the row: reads stay inside each stream (pca_raw_component never reads past its bytes; a
     * word index past the end reads word 0 of a one-word dummy). */
    const uint8_t *words = row_words(ri);
    const uint32_t wlast = ri->nwords ? ri->nwords - 1 : 0;
    uint32_t wp = st->wp, ep = 0, big = 0;
    /* rANS over the whole row, N symbols (one per lane, lanes in order) at a time: first the N
     * independent state updates, then the renormalisations, which share the word pointer. Runs of
     * whole steps inside one component (one table) go to the AVX2 loop while N words remain; the
     * rest (steps across two components, the stream's last words) to this loop. */
    const size_t count = (size_t)nl * Tc;
    if (count) {
        const uint8_t *tabs = s->tabs;
        size_t i = stepped ? st->i
                           : pca_rans_dec_row(x, N, g->tb.dec, tabs, Tc, count, (const uint16_t *)words, &wp, ri->nwords,
                                              s->sym);
        uint32_t jc = (uint32_t)(i / Tc), tc = (uint32_t)(i % Tc);
        const uint32_t *DEC = g->tb.dec + (size_t)(jc < nl ? tabs[jc] : 0) * PCA_SLOTS;
        while (i < count) {
            const uint32_t n = count - i < N ? (uint32_t)(count - i) : N;
            for (uint32_t j = 0; j < n; j++) {
                const uint32_t xs = x[j], e = DEC[xs & (PCA_SLOTS - 1u)];
                x[j] = (e >> 20) * (xs >> PROB_BITS) + ((e >> 4) & (PCA_SLOTS - 1u));
                s->sym[i + j] = (uint8_t)(e & 15u);
                if (++tc == Tc) {
                    tc = 0;
                    if (++jc < nl) DEC = g->tb.dec + (size_t)(ri->side[s->live[jc]] & 31u) * PCA_SLOTS;
                }
            }
            for (uint32_t j = 0; j < n; j++) {
                const uint32_t xs = x[j], need = xs < RANS_L;
                const uint32_t w = get_u16(words + 2u * (wp < wlast ? wp : wlast));
                x[j] = xs ^ ((xs ^ ((xs << 16) | w)) & (0u - need)); /* masks: a branch here mispredicts */
                wp += need;
            }
            i += n;
        }
    }
    for (uint32_t j = 0; j < nl; j++) {
        const uint32_t k = s->live[j];
        const int sh = ri->side[k] >> 5;
        const uint8_t *sym = s->sym + (size_t)j * Tc;
        const uint32_t nesc = pca_count_escapes(sym, Tc);
        uint32_t *esc = NULL;
        if (nesc) { /* rare: each escape's extra, per token */
            if ((uint64_t)ep + nesc > ri->nesc) FAIL("a row's escape count does not match its symbols");
            esc = s->mag;
            for (uint32_t t = 0; t < Tc; t++) esc[t] = sym[t] == ESCAPE ? get_u16(ri->esc + 2u * ep++) : 0u;
        }
        int16_t *qk = s->qc + (size_t)k * Tp;
        pca_raw_component(&raw, sh, sym, esc, Tc, qk, s->l1, g->ck->block ? NULL : s->last, k + 1, &big);
        memset(qk + Tc, 0, (Tp - Tc) * sizeof(int16_t)); /* padding tokens */
    }
    /* pair-major for the transform; components not coded are rows of zeros */
    const int16_t *zeros = s->qc + (size_t)C * Tp;
    memset(s->qc + (size_t)C * Tp, 0, Tp * sizeof(int16_t));
    for (uint32_t p = 0; p < C / 2; p++) {
        const int16_t *a = ri->side[2 * p] == ALL_ZERO ? zeros : s->qc + (size_t)(2 * p) * Tp;
        const int16_t *b = ri->side[2 * p + 1] == ALL_ZERO ? zeros : s->qc + (size_t)(2 * p + 1) * Tp;
        pca_interleave(a, b, (uint32_t)Tp, s->q + (size_t)p * Tp * 2);
    }
    if (wp > ri->nwords) FAIL("a row's rANS words end early");
    if (big) FAIL("a coefficient exceeds 32767");
    for (uint32_t n = 0; n < N; n++)
        if (x[n] != RANS_L) FAIL("a row's rANS stream does not end where it began");
    if (wp != ri->nwords) FAIL("a row's rANS stream does not end where it began");
    if (ep != ri->nesc) FAIL("a row's escape count does not match its symbols");
    if (raw.sign_at != ri->sign_bits) FAIL("a row's sign-bit count does not match its coefficients");
    for (uint32_t t = 0; t < Tc; t++)
        if (s->l1[t] > L1_LIMIT) FAIL("a token's coefficients sum past 65536");
    return PCA_OK;
}

/* x = f32(acc) * h + mean (multiply, then add), K turned forward, rounded to the dtype */
static void inverse_rows(const geo *g, uint32_t row, const int32_t *y, size_t ys, uint32_t t0, uint32_t nt,
                         uint8_t *out) {
    const pca_chunk *ck = g->ck;
    const uint32_t C = ck->channels, D = ck->head_dim, H = D / 2;
    const float *h = row_vec(ck->gain, ck, row), *mean = row_vec(ck->mean, ck, row);
    for (uint32_t i = 0; i < nt; i++) {
        const uint32_t t = t0 + i;
        const float *cs = NULL, *sn = NULL;
        if (row < ck->layers) {
            const size_t at = ((size_t)ck->rope_of_layer[row] * g->Tc + t) * H;
            cs = ck->cos + at;
            sn = ck->sin + at;
        }
        uint8_t *dst = out + ((size_t)row * ck->tokens + ck->sinks + t) * C * g->es;
        pca_inverse_token(y + (size_t)i * ys, C, D, h, mean, cs, sn, ck->dtype, dst);
    }
}

/* a row's values from its coefficients (s->q, pair-major, and s->last): the inverse transform and
 * the inverse of the forward step, into out */
static void row_values(const geo *g, uint32_t row, dscratch *s, uint8_t *out) {
    const pca_chunk *ck = g->ck;
    const uint32_t C = ck->channels;
    const int16_t *m2 = ck->m2 + (size_t)row * (C / 2) * ck->cols * 2;
    for (uint32_t b = 0; b < g->Tp / PCA_TB; b++) { /* pairs of components up to the block's last nonzero */
        uint32_t last = 0;
        for (uint32_t t = b * PCA_TB; t < (b + 1) * PCA_TB; t++) last = s->last[t] > last ? s->last[t] : last;
        s->pairs[b] = (last + 1u) / 2u;
    }
    const uint32_t D = ck->block, H = D / 2;
    uint32_t whole[TBLK / PCA_TB]; /* a block-diagonal basis: every pair of a head's block, each token */
    for (uint32_t b = 0; b < TBLK / PCA_TB; b++) whole[b] = H;
    for (uint32_t t0 = 0; t0 < g->Tc; t0 += TBLK) {
        const uint32_t nt = g->Tc - t0 < TBLK ? g->Tc - t0 : TBLK, np = (nt + PCA_TB - 1) / PCA_TB * PCA_TB;
        if (D) /* head h: y[t][hD..] from the components hD.. (pairs hD/2..) and their block of m2 */
            for (uint32_t h = 0; h < C / D; h++)
                pca_matmul((const int32_t *)s->q + (size_t)h * H * g->Tp + t0, g->Tp,
                           m2 + ((size_t)h * H * ck->cols + (size_t)h * D) * 2, ck->cols, D, whole, np,
                           s->y + (size_t)h * D, ck->cols);
        else
            pca_matmul((const int32_t *)s->q + t0, g->Tp, m2, ck->cols, ck->cols, s->pairs + t0 / PCA_TB, np, s->y,
                       ck->cols);
        inverse_rows(g, row, s->y, ck->cols, t0, nt, out);
    }
}

static int decode_row(const geo *g, uint32_t row, const row_in *ri, uint32_t N, dscratch *s, rans_state *st,
                      int stepped, uint8_t *out, char *msg, size_t msglen) {
    int rc = decode_symbols(g, ri, N, s, st, stepped, msg, msglen);
    if (rc != PCA_OK) return rc;
    row_values(g, row, s, out);
    return PCA_OK;
}

/* ------------------------------------------------------------------------ */
/* encoder                                                                   */
typedef struct { uint8_t *buf; size_t len; uint32_t words, lo_bits, sign_bits, nesc; int rc; char msg[96]; } row_out;

typedef struct {
    int16_t *x, *qT;       /* U of a token block, pair-major [C/2][EBLK][2]; q component-major [C][Tc] */
    int16_t *qb;           /* q of a block's tokens of the exact path, token-major [EBLK][C] */
    int32_t *y;            /* Y^T of a token block [cols][EBLK] */
    int32_t *u;            /* [C] one token's U */
    int64_t *acc;          /* [C] its exact transform (the int64 path) */
    uint32_t *l1, *pairs;  /* [EBLK] a token's sum |q|; [cols / PCA_TB] */
    uint8_t *side, *sym;   /* side bytes; the row's symbols in coding order */
    uint16_t *words, *mag, *live;
} escratch;

static inline int16_t quantize(double acc, double r) {
    double v = acc * r;
    v = v > Q_LIMIT ? Q_LIMIT : v < -Q_LIMIT ? -Q_LIMIT : v;
    return (int16_t)pca_rne(v);
}

/* q of every coded token of a row into s->qT (component-major); PCA_ERR_RANGE if a token's sum
 * |q| > 2^16. The product is computed transposed, Y^T[k][t] = sum_c B[c][k] U[t][c] (the basis
 * as the left side, a block of EBLK tokens as the right), so each component's run of tokens comes
 * out contiguous, in the order the entropy coder reads them. */
static int transform_row(const geo *g, uint32_t row, const uint8_t *kv, escratch *s, char *msg, size_t msglen) {
    const pca_chunk *ck = g->ck;
    const uint32_t C = ck->channels, Tc = g->Tc, D = ck->head_dim, rows4 = (C + PCA_TB - 1) / PCA_TB * PCA_TB;
    const int16_t *m2 = ck->m2 + (size_t)row * (C / 2) * ck->cols * 2;
    const int16_t *basis = ck->basis + (size_t)row * C * C;
    const float *mean = row_vec(ck->mean, ck, row), *w = row_vec(ck->weight, ck, row);
    const int64_t limit = ck->sumsq_limit[row];
    const size_t rowstride = (size_t)C * g->es;
    const uint8_t *base = kv + ((size_t)row * ck->tokens + ck->sinks) * rowstride;
    /* every pair of channels (a block-diagonal basis: every pair of the head's block) */
    for (uint32_t b = 0; b < rows4 / PCA_TB; b++) s->pairs[b] = ck->block ? ck->block / 2 : C / 2;
    uint8_t exact[EBLK];
    for (uint32_t t0 = 0; t0 < Tc; t0 += EBLK) {
        const uint32_t nt = Tc - t0 < EBLK ? Tc - t0 : EBLK;
        /* the block's width: its tokens rounded up to the transform's column block (a last,
         * short block costs what it holds), also the stride of x and y */
        const uint32_t xs = (nt + PCA_JB - 1) / PCA_JB * PCA_JB;
        uint32_t nexact = 0;
        for (uint32_t i = 0; i < xs; i++) {
            int16_t *xi = s->x + 2 * (size_t)i; /* channel c of this token at xi[(c/2) 2 xs + c%2] */
            exact[i] = 0;
            s->l1[i] = 0;
            if (i >= nt) {
                for (uint32_t p = 0; p < C / 2; p++) xi[(size_t)p * 2 * xs] = xi[(size_t)p * 2 * xs + 1] = 0;
                continue;
            }
            const float *cs = NULL, *sn = NULL;
            if (row < ck->layers) {
                const size_t at = ((size_t)ck->rope_of_layer[row] * Tc + t0 + i) * (D / 2);
                cs = ck->cos + at;
                sn = ck->sin + at;
            }
            /* int16 path only when |U| < 2^15 and sum U^2 * max_k |B_k|^2 < 2^62: then by
             * Cauchy-Schwarz every partial sum of U . B_k is below 2^31 (exact in int32) */
            int64_t ss;
            const int32_t mx = pca_forward_token(base + (size_t)(t0 + i) * rowstride, ck->dtype, C, D, cs, sn, mean, w,
                                                 s->u, &ss);
            if (mx > 32767 || ss > limit) {
                exact[i] = 1;
                nexact++;
                for (uint32_t p = 0; p < C / 2; p++) xi[(size_t)p * 2 * xs] = xi[(size_t)p * 2 * xs + 1] = 0;
                int16_t *qi = s->qb + (size_t)i * C;
                int64_t l1 = 0;
                pca_exact_token(s->u, basis, C, s->acc);
                for (uint32_t k = 0; k < C; k++) {
                    qi[k] = quantize((double)s->acc[k], ck->r); /* |acc| < 2^50: exact in f64 */
                    l1 += qi[k] < 0 ? -qi[k] : qi[k];
                }
                if (l1 > L1_LIMIT) {
                    snprintf(msg, msglen, "%lld", (long long)l1);
                    return PCA_ERR_RANGE;
                }
            } else {
                for (uint32_t p = 0; p < C / 2; p++) {
                    xi[(size_t)p * 2 * xs] = (int16_t)s->u[2 * p];
                    xi[(size_t)p * 2 * xs + 1] = (int16_t)s->u[2 * p + 1];
                }
            }
        }
        if (ck->block) /* head h: components hD.. from its channels (pairs hD/2..) only */
            for (uint32_t h = 0, B = ck->block; h < C / B; h++)
                pca_matmul((const int32_t *)m2 + (size_t)h * (B / 2) * ck->cols + (size_t)h * B, ck->cols,
                           s->x + (size_t)h * (B / 2) * xs * 2, xs, xs, s->pairs, B, s->y + (size_t)h * B * xs, xs);
        else
            pca_matmul((const int32_t *)m2, ck->cols, s->x, xs, xs, s->pairs, rows4, s->y, xs);
        for (uint32_t k = 0; k < C; k++) pca_quantize(s->y + (size_t)k * xs, nt, ck->r, s->qT + (size_t)k * Tc + t0, s->l1);
        for (uint32_t i = 0; i < nt; i++) {
            if (exact[i]) continue;
            if (s->l1[i] > L1_LIMIT) {
                snprintf(msg, msglen, "%u", s->l1[i]);
                return PCA_ERR_RANGE;
            }
        }
        for (uint32_t i = 0; nexact && i < nt; i++)
            if (exact[i])
                for (uint32_t k = 0; k < C; k++) s->qT[(size_t)k * Tc + t0 + i] = s->qb[(size_t)i * C + k];
    }
    return PCA_OK;
}

/* §6.2: the (table, shift) of fewest bits, ties to the smaller shift, then the smaller table.
 * Shifts past the magnitudes' bit length only add Tc bits each (the symbols stay all 0), so
 * they are not tried. The histograms at every shift come from two: of min(m, 63) (exact for
 * shifts 0..2, whose escapes start below 63, and for all when m < 64) and of min(m >> 3, 127)
 * (shifts 3..6: their escapes start at multiples of 8 up to 960 < 1024). */
static uint8_t choose(const geo *g, const int16_t *q, uint32_t Tc, uint16_t *m) {
    /* prefix sums: a symbol's count at a shift is one difference (symbols below 15 never reach
     * a clamped bin: 15 << 2 = 60 < 63 and 15 << 3 = 120 < 127). PF[v] = #(min(m, 63) < v), by
     * AVX-512 compares where the CPU has them, else from a histogram. */
    uint32_t PF[65], PG[129], maxm = 0;
    PG[0] = 0;
    if (!pca_choose_counts(q, Tc, m, PF, &maxm)) {
        /* four interleaved histograms: one counter bumped back to back waits on its own store */
        uint32_t F4[4][64];
        memset(F4, 0, sizeof F4);
        for (uint32_t t = 0; t < Tc; t++) {
            const uint32_t a = (uint32_t)(q[t] < 0 ? -q[t] : q[t]);
            m[t] = (uint16_t)a;
            maxm = a > maxm ? a : maxm;
        }
        if (maxm == 0) return ALL_ZERO;
        uint32_t t = 0;
        for (; t + 4 <= Tc; t += 4)
            for (int i = 0; i < 4; i++) F4[i][m[t + i] < 63 ? m[t + i] : 63]++;
        for (; t < Tc; t++) F4[0][m[t] < 63 ? m[t] : 63]++;
        PF[0] = 0;
        for (int v = 0; v < 64; v++) PF[v + 1] = PF[v] + F4[0][v] + F4[1][v] + F4[2][v] + F4[3][v];
    }
    if (maxm == 0) return ALL_ZERO;
    if (maxm >= 64) {
        uint32_t G4[4][128];
        memset(G4, 0, sizeof G4);
        uint32_t t = 0;
        for (; t + 4 <= Tc; t += 4)
            for (int i = 0; i < 4; i++) G4[i][(m[t + i] >> 3) < 127 ? (m[t + i] >> 3) : 127]++;
        for (; t < Tc; t++) G4[0][(m[t] >> 3) < 127 ? (m[t] >> 3) : 127]++;
        for (int v = 0; v < 128; v++) PG[v + 1] = PG[v] + G4[0][v] + G4[1][v] + G4[2][v] + G4[3][v];
    }
    int smax = 0;
    while (smax < 6 && (maxm >> smax) != 0) smax++;
    uint64_t best = UINT64_MAX;
    uint8_t side = 0;
    for (int s = 0; s <= smax; s++) {
        /* every cost at shift s is at least its raw bits, 256 s Tc, which grow with s: once they
         * reach the best so far no shift from s on can win (ties go to the smaller shift) */
        if (256u * (uint64_t)s * Tc >= best) break;
        uint64_t h[NSYM];
        /* no symbol below 15 reaches a clamped bin (15 << 2 = 60 < 63 when fine, 15 << 3 = 120 <
         * 127 when not; with maxm < 64 no magnitude is clamped at all), so each is a difference of
         * two prefix sums inside the table, and the escapes are the rest */
        const int fine = s <= 2 || maxm < 64, sh = fine ? s : s - 3;
        const uint32_t *P = fine ? PF : PG;
        if (fine && s > 2) { /* maxm < 64, shifts 3..5: bins past 63 hold nothing */
            for (int j = 0; j < ESCAPE; j++) {
                const int a = j << sh, b = (j + 1) << sh;
                h[j] = P[b < 64 ? b : 64] - P[a < 64 ? a : 64];
            }
        } else
            for (int j = 0; j < ESCAPE; j++) h[j] = P[(j + 1) << sh] - P[j << sh];
        const int first_escape = ESCAPE << sh; /* the escapes: every magnitude from here on */
        h[ESCAPE] = Tc - P[fine && first_escape > 64 ? 64 : first_escape];
        pca_choose_shift(h, s, Tc, (const uint64_t (*)[NTAB])g->tb.cost_t,
                         g->tb.cost16_ok && Tc < (1u << 15) ? &g->tb.cost16[0][0][0] : NULL, &best, &side);
    }
    return side;
}

static int encode_row(const geo *g, uint32_t row, const uint8_t *kv, escratch *s, row_out *o) {
    const pca_chunk *ck = g->ck;
    const uint32_t C = ck->channels, Tc = g->Tc, N = ck->lanes;
    int rc = transform_row(g, row, kv, s, o->msg, sizeof o->msg);
    if (rc != PCA_OK) return rc;
    uint64_t count = 0, lo_bits = 0;
    for (uint32_t k = 0; k < C; k++) {
        s->side[k] = Tc ? choose(g, s->qT + (size_t)k * Tc, Tc, s->mag) : ALL_ZERO;
        if (s->side[k] != ALL_ZERO) { count += Tc; lo_bits += (uint64_t)(s->side[k] >> 5) * Tc; }
    }
    if (lo_bits > 0xFFFFFFFFu) { /* the row table's u32 (the reference's struct.pack refuses it too) */
        snprintf(o->msg, sizeof o->msg, "a row's low bits pass 2^32");
        return PCA_ERR_PARAM;
    }
    /* the raw parts, forward; sizes bounded by count (< 2^31: checked by the caller) */
    const size_t lo_cap = (size_t)(lo_bits + 7) / 8 + 8, sg_cap = (size_t)(count + 7) / 8 + 8;
    uint8_t *lo = (uint8_t *)calloc(lo_cap + sg_cap, 1);
    uint16_t *esc = (uint16_t *)malloc((size_t)count * 2 + 2);
    if (!lo || !esc) { free(lo); free(esc); return PCA_ERR_NOMEM; }
    pca_raw_out raw = {lo, lo + lo_cap, 0, 0, esc, 0};
    uint32_t nl = 0;
    for (uint32_t k = 0; k < C; k++) {
        if (s->side[k] == ALL_ZERO) continue;
        pca_raw_encode(&raw, s->side[k] >> 5, s->qT + (size_t)k * Tc, Tc, s->sym + (size_t)nl * Tc);
        s->live[nl++] = (uint16_t)k;
    }
    const uint32_t nesc = raw.nesc, nsign = (uint32_t)raw.sign_at;
    /* rANS, backwards: symbol i (lane i mod N) from the last to the first; words are written from
     * the end of the buffer back, so they come out in the decoder's reading order. Whole steps of
     * N inside one component go to the AVX2 loop; the rest (a last partial step, steps across
     * two components) to this one, branch-free: a word is always stored one below wp, and wp
     * moves only when it is emitted (8 spare words below words[0] take such stores). */
    uint32_t x[64];
    for (uint32_t n = 0; n < N; n++) x[n] = RANS_L;
    uint16_t *words = s->words + 8;
    size_t wp = (size_t)count;
    uint32_t lane = count ? (uint32_t)((count - 1) % N) : 0;
    uint32_t jc = nl; /* the component of symbol i - 1 is live[jc - 1] */
    const uint32_t *F = NULL, *CU = NULL;
    const uint64_t *R = NULL;
    uint32_t tab = 0;
    for (size_t i = (size_t)count; i > 0;) {
        if ((size_t)(jc - 1) * Tc >= i) jc--; /* symbol i - 1 is in an earlier component */
        if (!F || (s->side[s->live[jc - 1]] & 31u) != tab) {
            tab = s->side[s->live[jc - 1]] & 31u;
            F = g->tb.freq[tab];
            CU = g->tb.cum[tab];
            R = g->tb.rcp[tab];
        }
        if (lane == N - 1) { /* a step's top: whole steps inside this component */
            const size_t run = (i - (size_t)(jc - 1) * Tc) / N;
            const size_t done = run ? pca_rans_enc_steps(x, N, &g->tb.enc[tab], s->sym + i - N, words, &wp, run) : 0;
            if (done) { /* 0: no AVX2, or N not a multiple of 8 */
                i -= N * done;
                continue;
            }
        }
        const uint32_t sym = s->sym[i - 1], f = F[sym];
        uint32_t xs = x[lane];
        const uint32_t emit = xs >= (f << (32 - PROB_BITS));
        words[wp - 1] = (uint16_t)xs;
        wp -= emit;
        xs >>= 16 * emit; /* no branch: emission is a coin toss */
        uint32_t d = (uint32_t)(((uint64_t)xs * R[sym]) >> 32), rem = xs - d * f;
        const uint32_t over = rem >= f;
        d += over;
        rem -= f & (0u - over);
        x[lane] = (d << PROB_BITS) + rem + CU[sym];
        lane = lane ? lane - 1 : N - 1;
        i--;
    }
    const uint32_t nwords = (uint32_t)(count - wp);
    const size_t lob = (size_t)(lo_bits + 7) / 8, sgb = ((size_t)nsign + 7) / 8, eb = 2u * (size_t)nesc;
    const size_t len = C + pad4(C) + 4u * N + 2u * nwords + 2u * (nwords & 1u) + lob + sgb + eb + pad4(lob + sgb + eb);
    uint8_t *buf = (uint8_t *)calloc(len, 1);
    if (!buf) { free(lo); free(esc); return PCA_ERR_NOMEM; }
    uint8_t *p = buf;
    memcpy(p, s->side, C);
    p += C + pad4(C);
    for (uint32_t n = 0; n < N; n++, p += 4) put_u32(p, x[n]);
    memcpy(p, words + wp, 2u * (size_t)nwords);
    p += 2u * nwords + 2u * (nwords & 1u);
    memcpy(p, lo, lob);
    p += lob;
    memcpy(p, lo + lo_cap, sgb);
    p += sgb;
    memcpy(p, esc, eb);
    free(lo);
    free(esc);
    o->buf = buf;
    o->len = len;
    o->words = nwords;
    o->lo_bits = (uint32_t)lo_bits;
    o->sign_bits = nsign;
    o->nesc = nesc;
    return PCA_OK;
}

/* ------------------------------------------------------------------------ */
/* threads                                                                   */
typedef struct {
    const geo *g;
    const uint8_t *src; /* encode: kv; decode: payload */
    uint8_t *dst;       /* decode: out */
    row_out *outs;      /* encode */
    const row_in *ins;  /* decode */
    uint32_t N;
    int next, failed, fail_rc;
    uint32_t fail_row;
    char fail_msg[160];
    pthread_mutex_t mu;
} job;

static void record_failure(job *jb, uint32_t row, int rc, const char *msg) {
    pthread_mutex_lock(&jb->mu);
    if (!jb->failed || row < jb->fail_row) {
        jb->fail_rc = rc;
        jb->fail_row = row;
        snprintf(jb->fail_msg, sizeof jb->fail_msg, "%s", msg);
    }
    __atomic_store_n(&jb->failed, 1, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&jb->mu);
}

static int dscratch_alloc(dscratch *s, const geo *g) {
    const uint32_t C = g->ck->channels;
    s->q = (int16_t *)malloc(((size_t)g->Tp * C + 16) * sizeof(int16_t));
    s->qc = (int16_t *)malloc(((size_t)g->Tp * (C + 1) + 16) * sizeof(int16_t));
    s->y = (int32_t *)malloc((size_t)TBLK * g->ck->cols * sizeof(int32_t));
    s->l1 = (uint32_t *)malloc(((size_t)g->Tp * 3 + 4) * sizeof(uint32_t));
    s->live = (uint16_t *)malloc(C * sizeof(uint16_t));
    s->mag = (uint32_t *)malloc(((size_t)g->Tc + 1) * sizeof(uint32_t));
    s->sym = (uint8_t *)malloc((size_t)C * g->Tc + 1);
    s->tabs = (uint8_t *)malloc(C);
    if (!s->q || !s->qc || !s->y || !s->l1 || !s->live || !s->mag || !s->sym || !s->tabs) return 0;
    s->last = s->l1 + g->Tp;
    s->pairs = s->last + g->Tp;
    return 1;
}

static void dscratch_free(dscratch *s) {
    free(s->q); free(s->qc); free(s->y); free(s->l1); free(s->live); free(s->mag); free(s->sym); free(s->tabs);
}

/* Rows two at a time: their rANS steps together (pca_rans_dec_rows2), then each row's rest. */
static void *decode_worker(void *arg) {
    job *jb = (job *)arg;
    const geo *g = jb->g;
    const uint32_t rows = 2u * g->ck->layers, N = jb->N;
    dscratch s[2];
    memset(s, 0, sizeof s);
    if (!dscratch_alloc(&s[0], g) || !dscratch_alloc(&s[1], g)) {
        record_failure(jb, 0, PCA_ERR_NOMEM, "out of memory");
    } else {
        char msg[2][128];
        rans_state st[2];
        for (int r; (r = __atomic_fetch_add(&jb->next, 2, __ATOMIC_RELAXED)) < (int)rows;) {
            if (__atomic_load_n(&jb->failed, __ATOMIC_RELAXED)) break;
            const int n = rows - (uint32_t)r >= 2 ? 2 : 1;
            int rc[2] = {PCA_OK, PCA_OK}, stepped = 0;
            for (int k = 0; k < n; k++) rc[k] = rans_setup(g, &jb->ins[r + k], N, &s[k], &st[k], msg[k], sizeof msg[k]);
            if (n == 2 && rc[0] == PCA_OK && rc[1] == PCA_OK) {
                pca_rans_row ab[2];
                for (int k = 0; k < 2; k++) {
                    const row_in *ri = &jb->ins[r + k];
                    ab[k] = (pca_rans_row){st[k].x, s[k].tabs, g->Tc, (size_t)st[k].nl * g->Tc,
                                           (const uint16_t *)row_words(ri), 0, ri->nwords, s[k].sym, 0};
                }
                stepped = pca_rans_dec_rows2(N, g->tb.dec, &ab[0], &ab[1]);
                for (int k = 0; stepped && k < 2; k++) {
                    st[k].wp = ab[k].wp;
                    st[k].i = ab[k].done;
                }
            }
            for (int k = 0; k < n; k++) {
                if (rc[k] == PCA_OK)
                    rc[k] = decode_row(g, (uint32_t)(r + k), &jb->ins[r + k], N, &s[k], &st[k], stepped, jb->dst,
                                       msg[k], sizeof msg[k]);
                if (rc[k] != PCA_OK) record_failure(jb, (uint32_t)(r + k), rc[k], msg[k]);
            }
        }
    }
    dscratch_free(&s[0]);
    dscratch_free(&s[1]);
    return NULL;
}

static void *encode_worker(void *arg) {
    job *jb = (job *)arg;
    const geo *g = jb->g;
    const uint32_t C = g->ck->channels, rows = 2u * g->ck->layers;
    escratch s;
    s.x = (int16_t *)malloc((size_t)EBLK * C * sizeof(int16_t));
    s.qb = (int16_t *)malloc((size_t)EBLK * C * sizeof(int16_t));
    s.qT = (int16_t *)malloc(((size_t)C * g->Tc + 1) * sizeof(int16_t));
    s.y = (int32_t *)malloc((size_t)EBLK * g->ck->cols * sizeof(int32_t));
    s.u = (int32_t *)malloc(C * sizeof(int32_t));
    s.acc = (int64_t *)malloc(C * sizeof(int64_t));
    s.l1 = (uint32_t *)malloc(EBLK * sizeof(uint32_t));
    s.pairs = (uint32_t *)malloc(g->ck->cols / PCA_TB * sizeof(uint32_t));
    s.side = (uint8_t *)malloc(C);
    s.words = (uint16_t *)malloc(((size_t)C * g->Tc + 16) * sizeof(uint16_t));
    s.sym = (uint8_t *)malloc((size_t)C * g->Tc + 16);
    s.live = (uint16_t *)malloc(C * sizeof(uint16_t));
    s.mag = (uint16_t *)malloc(((size_t)g->Tc + 1) * sizeof(uint16_t));
    if (!s.x || !s.qb || !s.qT || !s.y || !s.u || !s.acc || !s.l1 || !s.pairs || !s.side || !s.words || !s.mag || !s.sym || !s.live) {
        record_failure(jb, 0, PCA_ERR_NOMEM, "out of memory");
    } else {
        for (int r; (r = __atomic_fetch_add(&jb->next, 1, __ATOMIC_RELAXED)) < (int)rows;) {
            if (__atomic_load_n(&jb->failed, __ATOMIC_RELAXED)) break;
            int rc = encode_row(g, (uint32_t)r, jb->src, &s, &jb->outs[r]);
            if (rc != PCA_OK) record_failure(jb, (uint32_t)r, rc, rc == PCA_ERR_NOMEM ? "out of memory" : jb->outs[r].msg);
        }
    }
    free(s.x); free(s.qb); free(s.qT); free(s.y); free(s.u); free(s.acc); free(s.l1); free(s.pairs); free(s.side); free(s.words); free(s.mag); free(s.sym); free(s.live);
    return NULL;
}

static void run_threads(job *jb, int threads, uint32_t rows, void *(*fn)(void *)) {
    if (threads < 1) threads = 1;
    if ((uint32_t)threads > rows) threads = (int)(rows ? rows : 1);
    if (threads > 256) threads = 256;
    pthread_t tid[256];
    int started = 0;
    pthread_mutex_init(&jb->mu, NULL);
    for (int i = 1; i < threads; i++) {
        if (pthread_create(&tid[started], NULL, fn, jb) != 0) break;
        started++;
    }
    fn(jb);
    for (int i = 0; i < started; i++) pthread_join(tid[i], NULL);
    pthread_mutex_destroy(&jb->mu);
}

/* ------------------------------------------------------------------------ */
/* chunk entry points                                                        */
static int check_chunk(const pca_chunk *ck, geo *g, char *err, size_t errlen) {
    const uint32_t C = ck->channels, D = ck->head_dim;
    if (ck->dtype < PCA_DTYPE_BF16 || ck->dtype > PCA_DTYPE_F32 || ck->layers < 1 || ck->layers > (1u << 16) ||
        C < 2 || C > 4096 || D < 2 || D % 2 || C % D || ck->sinks > ck->tokens || ck->cols < C ||
        ck->cols % PCA_JB || (uint64_t)C * ck->tokens >= (1ull << 31) ||
        (ck->block && (ck->block != D || D % 8))) {
        snprintf(err, errlen, "bad chunk geometry");
        return 0;
    }
    memset(g, 0, sizeof *g);
    g->ck = ck;
    g->Tc = ck->tokens - ck->sinks;
    g->Tp = (g->Tc + PCA_TB - 1) / PCA_TB * PCA_TB;
    g->es = esize(ck->dtype);
    if (!pca_tables_init(&g->tb, ck->freq, ck->cost)) {
        snprintf(err, errlen, "bad frequency tables");
        return 0;
    }
    return 1;
}

int pca_encode_chunk(const void *kv, const pca_chunk *ck, int threads, uint8_t **out, size_t *out_len, char *err,
                     size_t errlen) {
    *out = NULL;
    *out_len = 0;
    geo g;
    if (!check_chunk(ck, &g, err, errlen)) return PCA_ERR_PARAM;
    if (ck->lanes < 1 || ck->lanes > 64) { snprintf(err, errlen, "lanes out of range"); return PCA_ERR_PARAM; }
    const uint32_t L = ck->layers, T = ck->tokens, C = ck->channels, S = ck->sinks, rows = 2u * L;
    const size_t n = (size_t)rows * T * C; /* every value, sinks too, must be finite (as the reference checks) */
    if (ck->dtype == PCA_DTYPE_F32) {
        const uint32_t *v = (const uint32_t *)kv;
        uint32_t bad = 0;
        for (size_t i = 0; i < n; i++) bad |= (v[i] & 0x7F800000u) == 0x7F800000u;
        if (bad) { snprintf(err, errlen, "the KV input holds NaN or infinity"); return PCA_ERR_NONFINITE; }
    } else {
        const uint16_t *v = (const uint16_t *)kv, e = ck->dtype == PCA_DTYPE_BF16 ? 0x7F80u : 0x7C00u;
        uint32_t bad = 0;
        for (size_t i = 0; i < n; i++) bad |= (v[i] & e) == e;
        if (bad) { snprintf(err, errlen, "the KV input holds NaN or infinity"); return PCA_ERR_NONFINITE; }
    }
    job jb;
    memset(&jb, 0, sizeof jb);
    jb.g = &g;
    jb.src = (const uint8_t *)kv;
    jb.outs = (row_out *)calloc(rows, sizeof(row_out));
    if (!jb.outs) { snprintf(err, errlen, "out of memory"); return PCA_ERR_NOMEM; }
    run_threads(&jb, threads, rows, encode_worker);
    int rc = PCA_OK;
    if (jb.failed) {
        rc = jb.fail_rc;
        snprintf(err, errlen, "%s", jb.fail_msg);
    }
    const size_t sink_bytes = (size_t)rows * S * C * g.es;
    size_t total = HEADER + (size_t)ENTRY * rows + sink_bytes + pad4(sink_bytes);
    for (uint32_t r = 0; rc == PCA_OK && r < rows; r++) total += jb.outs[r].len;
    uint8_t *buf = rc == PCA_OK ? (uint8_t *)malloc(total) : NULL;
    if (rc == PCA_OK && !buf) { rc = PCA_ERR_NOMEM; snprintf(err, errlen, "out of memory"); }
    if (rc == PCA_OK) {
        uint8_t *p = buf;
        memcpy(p, "KVPC", 4);
        p[4] = 1;
        p[5] = (uint8_t)ck->dtype;
        p[6] = (uint8_t)ck->lanes;
        p[7] = 0;
        put_u32(p + 8, rows);
        put_u32(p + 12, T);
        put_u32(p + 16, C);
        put_u32(p + 20, S);
        p += HEADER;
        for (uint32_t r = 0; r < rows; r++, p += ENTRY) {
            put_u32(p, jb.outs[r].words);
            put_u32(p + 4, jb.outs[r].lo_bits);
            put_u32(p + 8, jb.outs[r].sign_bits);
            put_u32(p + 12, jb.outs[r].nesc);
        }
        const size_t rowb = (size_t)S * C * g.es;
        for (uint32_t r = 0; r < rows; r++, p += rowb) memcpy(p, (const uint8_t *)kv + (size_t)r * T * C * g.es, rowb);
        memset(p, 0, pad4(sink_bytes));
        p += pad4(sink_bytes);
        for (uint32_t r = 0; r < rows; r++) {
            memcpy(p, jb.outs[r].buf, jb.outs[r].len);
            p += jb.outs[r].len;
        }
        *out = buf;
        *out_len = total;
    }
    for (uint32_t r = 0; r < rows; r++) free(jb.outs[r].buf);
    free(jb.outs);
    return rc;
}

/* The decoder's slot tables (512 KB) of the last few sets of frequencies, built once and kept for
 * the life of the process (never freed: a decode on another thread may be reading them). Every
 * kvtool caller passes the same FREQ, so one set is built; NULL when PCA_KEPT sets are kept
 * already or memory is short (the caller builds its own). */
#define PCA_KEPT 4
static struct { uint32_t freq[NTAB][NSYM]; uint32_t *dec; } g_kept[PCA_KEPT];
static int g_nkept = 0;
static pthread_mutex_t g_kept_mu = PTHREAD_MUTEX_INITIALIZER;

static uint32_t *kept_dec_tables(const tables *tb) {
    uint32_t *dec = NULL;
    pthread_mutex_lock(&g_kept_mu);
    for (int i = 0; i < g_nkept && !dec; i++)
        if (memcmp(g_kept[i].freq, tb->freq, sizeof tb->freq) == 0) dec = g_kept[i].dec;
    if (!dec && g_nkept < PCA_KEPT && (dec = (uint32_t *)malloc(sizeof(uint32_t) * PCA_NTAB * PCA_SLOTS)) != NULL) {
        pca_dec_tables(dec, (const uint32_t (*)[PCA_NSYM])tb->freq, (const uint32_t (*)[PCA_NSYM + 1])tb->cum);
        memcpy(g_kept[g_nkept].freq, tb->freq, sizeof tb->freq);
        g_kept[g_nkept++].dec = dec;
    }
    pthread_mutex_unlock(&g_kept_mu);
    return dec;
}

int pca_decode_chunk(const uint8_t *p, size_t len, const pca_chunk *ck, void *out, int threads, char *err,
                     size_t errlen) {
    geo g;
    if (!check_chunk(ck, &g, err, errlen)) return PCA_ERR_PARAM;
    const uint32_t L = ck->layers, T = ck->tokens, C = ck->channels, rows = 2u * L;
    /* the header and the row table, as reference.parse checks them */
    if (len < HEADER) { snprintf(err, errlen, "payload shorter than its header"); return PCA_ERR_CORRUPT; }
    if (memcmp(p, "KVPC", 4) != 0 || p[4] != 1 || p[7] != 0) {
        snprintf(err, errlen, "not a pca payload of version 1");
        return PCA_ERR_CORRUPT;
    }
    const uint32_t N = p[6], S = get_u32(p + 20);
    if (p[5] != (uint8_t)ck->dtype || get_u32(p + 8) != rows || get_u32(p + 12) != T || get_u32(p + 16) != C ||
        N < 1 || N > 64 || S > T) {
        snprintf(err, errlen, "the payload's header does not match the chunk's shape and dtype");
        return PCA_ERR_CORRUPT;
    }
    if (S != ck->sinks) { snprintf(err, errlen, "sink count differs from the caller's"); return PCA_ERR_PARAM; }
    if (len - HEADER < (uint64_t)ENTRY * rows) { snprintf(err, errlen, "payload shorter than its row table"); return PCA_ERR_CORRUPT; }
    const size_t sink_at = HEADER + (size_t)ENTRY * rows, sink_bytes = (size_t)rows * S * C * g.es;
    row_in *ins = (row_in *)calloc(rows, sizeof(row_in));
    if (!ins) { snprintf(err, errlen, "out of memory"); return PCA_ERR_NOMEM; }
    uint64_t pos = sink_at + sink_bytes + pad4(sink_bytes);
    for (uint32_t r = 0; r < rows; r++) {
        const uint8_t *e = p + HEADER + (size_t)ENTRY * r;
        row_in *ri = &ins[r];
        ri->nwords = get_u32(e);
        ri->lo_bits = get_u32(e + 4);
        ri->sign_bits = get_u32(e + 8);
        ri->nesc = get_u32(e + 12);
        const uint64_t lob = ((uint64_t)ri->lo_bits + 7) / 8, sgb = ((uint64_t)ri->sign_bits + 7) / 8,
                       eb = 2ull * ri->nesc, tail = lob + sgb + eb;
        const uint64_t size = C + pad4(C) + 4ull * N + 2ull * ri->nwords + 2ull * (ri->nwords & 1u) + tail + pad4((size_t)tail);
        if (pos + size > len) { free(ins); snprintf(err, errlen, "payload is %zu bytes, shorter than its tables say", len); return PCA_ERR_CORRUPT; }
        ri->side = p + pos;
        ri->states = ri->side + C + pad4(C);
        ri->words = ri->states + 4u * N;
        ri->lo = ri->words + 2ull * ri->nwords + 2ull * (ri->nwords & 1u);
        ri->sign = ri->lo + lob;
        ri->esc = ri->sign + sgb;
        pos += size;
    }
    if (pos != len) { free(ins); snprintf(err, errlen, "payload is %zu bytes, its tables say %llu", len, (unsigned long long)pos); return PCA_ERR_CORRUPT; }
    /* sinks: the first S tokens of every row, as stored */
    const size_t rowb = (size_t)S * C * g.es;
    for (uint32_t r = 0; r < rows; r++) memcpy((uint8_t *)out + (size_t)r * T * C * g.es, p + sink_at + r * rowb, rowb);
    job jb;
    memset(&jb, 0, sizeof jb);
    jb.g = &g;
    jb.src = p;
    jb.dst = (uint8_t *)out;
    jb.ins = ins;
    jb.N = N;
    uint32_t *own = NULL;
    g.tb.dec = kept_dec_tables(&g.tb);
    if (!g.tb.dec) {
        own = g.tb.dec = (uint32_t *)malloc(sizeof(uint32_t) * PCA_NTAB * PCA_SLOTS);
        if (!own) { free(ins); snprintf(err, errlen, "out of memory"); return PCA_ERR_NOMEM; }
        pca_dec_tables(own, (const uint32_t (*)[PCA_NSYM])g.tb.freq, (const uint32_t (*)[PCA_NSYM + 1])g.tb.cum);
    }
    run_threads(&jb, threads, rows, decode_worker);
    free(own);
    free(ins);
    if (jb.failed) {
        snprintf(err, errlen, "%s", jb.fail_msg);
        return jb.fail_rc;
    }
    return PCA_OK;
}

#include "pca_units.inc" /* bitstream version 2: independent units (format-spec/pca.md §11) */
