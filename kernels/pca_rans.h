/* rANS kernels of the pca CPU coder (format-spec/pca.md §6.3): the decoder's symbol table and
 * its AVX2 lane loop, and the encoder's (table, shift) cost sums. Each has a portable twin in
 * pca_cpu.c or here; both give the same states, words and symbols (integer arithmetic only). */
#ifndef KVTOOL_PCA_RANS_H
#define KVTOOL_PCA_RANS_H

#include <stddef.h>
#include <stdint.h>

#define PCA_NSYM 16
#define PCA_NTAB 32
#define PCA_SLOTS 4096 /* 2^12: the frequencies' total */

/* One decode entry per slot: f << 20 | (slot - cum[s]) << 4 | s. A single load gives the symbol
 * and both numbers of the state update x = f (x >> 12) + slot - cum (f < 4096: 16 frequencies of
 * at least 1 sum to 4096; slot - cum < f). */
static inline uint32_t pca_dec_entry(uint32_t f, uint32_t bias, uint32_t s) { return f << 20 | bias << 4 | s; }

/* dec[t][slot] for the 32 tables, from freq [32][16] and cum [32][17] (checked by the caller) */
void pca_dec_tables(uint32_t *dec, const uint32_t (*freq)[PCA_NSYM], const uint32_t (*cum)[PCA_NSYM + 1]);

/* SIMD (AVX-512 or AVX2): the row's rANS steps of N lanes (N a multiple of 8 up to 64, Tc >= N)
 * from the first, while a whole step remains and at least N words remain at *wp (so every load is
 * inside the stream and no step ends early). Symbol i belongs to live component i / Tc, coded with
 * table tabs[i / Tc]; dec holds the 32 tables. Symbols to sym[0 .. done). Returns the symbols
 * done, a multiple of N (0 without SIMD or when N, Tc do not fit); the caller goes on with its
 * portable loop, whose arithmetic this repeats. */
size_t pca_rans_dec_row(uint32_t *x, uint32_t N, const uint32_t *dec, const uint8_t *tabs, uint32_t Tc, size_t count,
                        const uint16_t *words, uint32_t *wp, uint32_t nwords, uint8_t *sym);

/* One row's rANS stream for pca_rans_dec_rows2: x its N states, wp the word it reads next; done
 * (out) the symbols decoded. */
typedef struct {
    uint32_t *x;
    const uint8_t *tabs;
    uint32_t Tc;
    size_t count;
    const uint16_t *words;
    uint32_t wp, nwords;
    uint8_t *sym;
    size_t done;
} pca_rans_row;

/* pca_rans_dec_row for two rows at once (their steps interleaved: one row's chain of state
 * updates leaves the core idle); the same states, words and symbols as two calls. Returns 1 when
 * it ran (AVX2 or AVX-512, N a multiple of 8 up to 32, both rows fit), else 0 and nothing changes. */
int pca_rans_dec_rows2(uint32_t N, const uint32_t *dec, pca_rans_row *a, pca_rans_row *b);

/* The choice's magnitudes and prefix counts (AVX-512, Tc <= 1024): m[t] = |q[t]|, *maxm their
 * maximum and, when it is not 0, P[v] = #(m[t] < v) for v = 0, 64 and every v in 1..63 the
 * choice reads (the rest of P is not written). Returns 0 (nothing done) on other CPUs. */
int pca_choose_counts(const int16_t *q, uint32_t Tc, uint16_t *m, uint32_t P[65], uint32_t *maxm);

/* §6.2 for one histogram h at shift s: cost[t] = sum_j h[j] COST[t][j] + 256 (s Tc + 16 h[15])
 * for the 32 tables; the least goes to *best / *side when strictly below *best (tables in order,
 * so ties keep the smaller shift, then table). cost_t is COST transposed ([16][32]); cost16, when
 * not NULL, the same as int16 pairs [8][32][2] (symbols 2i, 2i+1 of each table), which the caller
 * passes only when Tc < 2^15 and every cost <= 4096 (then every sum stays below 2^31). */
void pca_choose_shift(const uint64_t h[PCA_NSYM], int s, uint64_t Tc, const uint64_t (*cost_t)[PCA_NTAB],
                      const int16_t *cost16, uint64_t *best, uint8_t *side);

/* Bitstream version 2 (§11.3): one unit's rANS for pca_rans_dec_units. Its stream's byte i is
 * payload[at + dir * i] (dir +1 or -1), len bytes; its n symbols start at token tc of live
 * component jc. In: x, the state read from the stream's first 4 bytes, and p = 4. Out: x the end
 * state, p the stream bytes read, over 1 when a renormalisation needed a word past len (the unit
 * is corrupt: its state and symbols then mean nothing), and the symbols in sym[0 .. n). */
typedef struct {
    int64_t at;
    int32_t dir;
    uint32_t len, n, jc, tc, x, p, over;
    uint8_t *sym;
} pca_unit_rans;

/* The rANS of `count` units of one row, 16 a vector with AVX-512, 8 with AVX2 alone (the loop of
 * pca_units.inc's rans_step, lane by lane). tab_off[j] = 4096 * the table of live component j, for j <= the row's
 * live count (the entry after the last, any table); tmp: 72 * 4096 bytes (the symbols, then each
 * step's turn masks).
 * Returns 1 when it ran, 0 (nothing done) on other CPUs, a payload of 2^31 bytes or more, or (AVX2
 * alone) a row with a unit whose reads could leave the payload. */
int pca_rans_dec_units(pca_unit_rans *u, uint32_t count, const uint32_t *dec, const uint8_t *payload, size_t len,
                       const int32_t *tab_off, uint32_t Tc, uint8_t *tmp);

#endif

/* The raw parts of one component (§6.4) as the decoder reads them: positions in bits, reads never
 * past a stream's bytes (past them: zero bits; the caller judges the counts after the row). */
typedef struct {
    const uint8_t *lo, *sign;
    size_t lo_len, sign_len;  /* bytes */
    uint64_t lo_at, sign_at;  /* bits read so far */
} pca_raw_in;

/* For t < n: m[t] = sym[t] + esc[t] (esc NULL: no escapes) becomes m = m << sh | lo, q[t] = m or
 * -m (its sign bit read when m != 0), l1[t] += m, last[t] = k1 when m != 0 (last NULL: not
 * kept, a block-diagonal basis multiplies every pair of a head); *big |= m > 32767. q
 * is the component's row (contiguous). The AVX2 path does whole blocks of 8, the rest portably. */
void pca_raw_component(pca_raw_in *r, int sh, const uint8_t *sym, const uint32_t *esc, uint32_t n, int16_t *q,
                       uint32_t *l1, uint32_t *last, uint32_t k1, uint32_t *big);

/* the number of escape symbols (15) among sym[0 .. n) */
uint32_t pca_count_escapes(const uint8_t *sym, uint32_t n);

/* Pair-major copy of rows a and b of n int16 (n a multiple of 4): out[2t] = a[t], out[2t+1] = b[t],
 * the layout of the transform's input (pca_matmul's xp). */
void pca_interleave(const int16_t *a, const int16_t *b, uint32_t n, int16_t *out);

/* One table as the AVX2 encoder reads it: f, cum and floor((2^32 - 1) / f) of its 16 symbols */
typedef struct { uint32_t f[PCA_NSYM], cum[PCA_NSYM], rcp[PCA_NSYM]; } pca_enc_table;

/* SIMD encoder (AVX-512 for N a multiple of 16 up to 64 where the CPU has it, else AVX2):
 * `steps` full steps of N lanes (N a multiple of 8), backwards: step s (s = 0 first)
 * codes symbols sym[-s N .. -s N + N) of one table, lanes from N-1 down, the words of a step's
 * lanes stored below words[*wp] in ascending lane order (the decoder's reading order). Stores
 * may touch the 8 words below the final *wp (the caller leaves room). Returns the steps done
 * (0 when AVX2 is off or N % 8 != 0). */
size_t pca_rans_enc_steps(uint32_t *x, uint32_t N, const pca_enc_table *tb, const uint8_t *sym, uint16_t *words,
                          size_t *wp, size_t steps);

/* The writer's raw parts of one component (§6.4), appended at bit positions lo_at / sign_at of
 * zeroed buffers (each with 8 bytes to spare past its last bit); the symbols min(m >> sh, 15) to
 * sym, the escapes to esc. */
typedef struct {
    uint8_t *lo, *sign;
    uint64_t lo_at, sign_at;
    uint16_t *esc;
    uint32_t nesc;
} pca_raw_out;

void pca_raw_encode(pca_raw_out *o, int sh, const int16_t *q, uint32_t n, uint8_t *sym);

/* Bitstream version 2's writer (§11.3, informative): one unit's rANS for pca_rans_enc_units. Its
 * n symbols sym[0 .. n), the last at token tc of live component jc; x its initial state
 * (2^31 | its first 31 raw bits). Its words go below words[woff + wp] (wp = n in: the words of
 * symbol n - 1 first, each one place lower), the u16 below the last one written touched too. Out:
 * x the final state, wp where its words start. */
typedef struct {
    uint32_t x, n, jc, tc, wp;
    int32_t woff;
    const uint8_t *sym;
} pca_unit_enc;

/* The rANS of `count` units of one row, 16 a vector (AVX-512) or 8 (AVX2). tabs[j]: the table of live
 * component j (j < nl); tb the 32 tables; tmp: 64 * 4096 + 4 * nl bytes.
 * Returns 1 when it ran, 0 (nothing done) on other CPUs. */
int pca_rans_enc_units(pca_unit_enc *u, uint32_t count, const pca_enc_table *tb, const uint8_t *tabs, uint32_t nl,
                       uint32_t Tc, uint16_t *words, uint8_t *tmp);

