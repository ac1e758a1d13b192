/* CPU paged gather/scatter: kvtool._paged_native (connectors/paged_native.py calls it).
 *
 * The torch reference (connectors/paged_torch.py) reduces every layout to "rows": a tensor's
 * storage seen as [num_rows, run] elements, and the list of row indices a batch of tokens
 * touches. This kernel moves those rows with memcpy, for many (layer, K/V) tensors that share
 * one row list, on a few threads, with the GIL released. It has no torch headers: tensors come as
 * (data pointer, number of rows) pairs from the caller, and every row index is checked against
 * every tensor's row count before anything is copied, so a bad index is an error, never a stray
 * or partial write.
 *
 * copy_rows(pairs, rows, run_bytes, scatter, threads) -> None
 *   pairs: bytes of uint64 quadruples (paged_ptr, paged_rows, blob_ptr, blob_rows), one per tensor
 *   rows:  a contiguous buffer of int64 row indices into the paged tensor (one per blob row)
 *   scatter: 1 = blob -> paged rows, 0 = paged rows -> blob
 *
 * scatter_checked(segments, payload, threads) -> CRC-32C of payload
 *   The load of a stored chunk straight from its (memory-mapped) bytes: every byte of `payload`
 *   is read once, checksummed as it is copied (crc32c_cpu.c), and the CRC of the whole payload
 *   comes back for the caller to compare with the stored one. The bytes written are the bytes
 *   checked even if the mapping changes meanwhile; a mismatch means the caller refuses the
 *   chunk (its slots then hold no loaded tokens). Bytes of the payload that no segment copies
 *   are checksummed only.
 *   segments: bytes of uint64 sextuples (paged_ptr, paged_rows, blob_ptr, nrows, run_bytes,
 *     rows_ptr): blob rows i < nrows (run_bytes each, from blob_ptr) go to paged rows rows[i]
 *     (int64 at rows_ptr). Segments lie inside the payload in ascending order, apart; every row
 *     index is checked before anything is copied. The payload is split between threads at
 *     segment starts and the parts' CRCs combined.
 *
 * crc32c(buffer, threads) -> CRC-32C;  crc32c_hardware() -> bool;  crc32c_force_portable(flag)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "crc32c_cpu.h"

typedef struct {
    const uint64_t *pairs; /* quadruples */
    size_t first, last;    /* pair range of this worker */
    const int64_t *rows;
    size_t nrows;
    size_t run;
    int scatter;
} job_t;

#define copy_fixed(paged, blob, j, N)                                           \
    do {                                                                        \
        if ((j)->scatter)                                                       \
            for (size_t i = 0; i < (j)->nrows; i++)                             \
                memcpy((paged) + (size_t)(j)->rows[i] * (N), (blob) + i * (N), (N)); \
        else                                                                    \
            for (size_t i = 0; i < (j)->nrows; i++)                             \
                memcpy((blob) + i * (N), (paged) + (size_t)(j)->rows[i] * (N), (N)); \
    } while (0)

static void *work(void *arg) {
    job_t *j = (job_t *)arg;
    for (size_t p = j->first; p < j->last; p++) {
        char *paged = (char *)(uintptr_t)j->pairs[4 * p];
        char *blob = (char *)(uintptr_t)j->pairs[4 * p + 2];
        /* one element per row (a transposed K page): a fixed-size copy the compiler inlines */
        switch (j->run) {
        case 2: copy_fixed(paged, blob, j, 2); break;
        case 4: copy_fixed(paged, blob, j, 4); break;
        case 8: copy_fixed(paged, blob, j, 8); break;
        default:
            for (size_t i = 0; i < j->nrows; i++) {
                char *pr = paged + (size_t)j->rows[i] * j->run;
                char *br = blob + i * j->run;
                if (j->scatter) memcpy(pr, br, j->run);
                else memcpy(br, pr, j->run);
            }
        }
    }
    return NULL;
}

static PyObject *py_copy_rows(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer pairs, rows;
    Py_ssize_t run;
    int scatter, threads;
    if (!PyArg_ParseTuple(args, "y*y*nii", &pairs, &rows, &run, &scatter, &threads)) return NULL;
    PyObject *result = NULL;
    if (pairs.len % 32 || rows.len % 8 || run <= 0) {
        PyErr_SetString(PyExc_ValueError, "copy_rows: pairs must be uint64 quadruples, rows int64, run > 0");
        goto done;
    }
    size_t npairs = (size_t)pairs.len / 32, nrows = (size_t)rows.len / 8;
    const uint64_t *pq = (const uint64_t *)pairs.buf;
    const int64_t *rv = (const int64_t *)rows.buf;
    int64_t lo = 0, hi = -1;
    for (size_t i = 0; i < nrows; i++) {
        if (i == 0 || rv[i] < lo) lo = rv[i];
        if (i == 0 || rv[i] > hi) hi = rv[i];
    }
    for (size_t p = 0; p < npairs; p++)
        if (lo < 0 || (nrows && (uint64_t)hi >= pq[4 * p + 1]) || pq[4 * p + 3] < nrows || !pq[4 * p] || !pq[4 * p + 2]) {
            PyErr_SetString(PyExc_IndexError, "copy_rows: a row index or a blob is out of range");
            goto done;
        }
    if (threads < 1) threads = 1;
    if ((size_t)threads > npairs) threads = npairs ? (int)npairs : 1;
    if (threads > 64) threads = 64;
    job_t jobs[64];
    pthread_t tids[64];
    int started[64] = {0};
    Py_BEGIN_ALLOW_THREADS
    for (int t = 0; t < threads; t++) {
        jobs[t] = (job_t){pq, npairs * t / threads, npairs * (t + 1) / threads, rv, nrows, (size_t)run, scatter};
        if (t > 0) started[t] = pthread_create(&tids[t], NULL, work, &jobs[t]) == 0;
        if (t > 0 && !started[t]) work(&jobs[t]); /* no thread: do its share here */
    }
    work(&jobs[0]);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(tids[t], NULL);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&pairs);
    PyBuffer_Release(&rows);
    return result;
}

/* ---- scatter_checked ------------------------------------------------------------------------ */

typedef struct {
    uint64_t paged, paged_rows, blob, nrows, run, rows;
} segment_t;

typedef struct {
    const segment_t *seg;
    size_t first, last;          /* segments [first, last) */
    const uint8_t *begin, *end;  /* this part of the payload */
    uint32_t crc;
} part_t;

static void *check_part(void *arg) {
    part_t *p = (part_t *)arg;
    crc32c_state s = crc32c_begin();
    const uint8_t *pos = p->begin;
    for (size_t k = p->first; k < p->last; k++) {
        const segment_t *g = &p->seg[k];
        const uint8_t *blob = (const uint8_t *)(uintptr_t)g->blob;
        s = crc32c_update(s, pos, (size_t)(blob - pos)); /* bytes between segments */
        s = crc32c_scatter_rows(s, (uint8_t *)(uintptr_t)g->paged, (const int64_t *)(uintptr_t)g->rows,
                                (size_t)g->nrows, (size_t)g->run, blob);
        pos = blob + g->nrows * g->run;
    }
    s = crc32c_update(s, pos, (size_t)(p->end - pos));
    p->crc = crc32c_end(s);
    return NULL;
}

static int segments_ok(const segment_t *seg, size_t n, const uint8_t *lo, const uint8_t *hi) {
    const uint8_t *pos = lo;
    const uint64_t *last_rows = NULL;
    int64_t rmin = 0, rmax = -1;
    for (size_t k = 0; k < n; k++) {
        const segment_t *g = &seg[k];
        const uint8_t *blob = (const uint8_t *)(uintptr_t)g->blob;
        if (!g->paged || !g->rows || g->run == 0 || blob < pos || g->nrows > (uint64_t)(hi - blob) / g->run)
            return 0;
        pos = blob + g->nrows * g->run;
        if ((const uint64_t *)(uintptr_t)g->rows != last_rows) { /* segments mostly share one row list */
            const int64_t *r = (const int64_t *)(uintptr_t)g->rows;
            rmin = 0, rmax = -1;
            for (uint64_t i = 0; i < g->nrows; i++) {
                if (i == 0 || r[i] < rmin) rmin = r[i];
                if (i == 0 || r[i] > rmax) rmax = r[i];
            }
            last_rows = (const uint64_t *)(uintptr_t)g->rows;
        }
        if (g->nrows && (rmin < 0 || (uint64_t)rmax >= g->paged_rows)) return 0;
    }
    return 1;
}

static PyObject *py_scatter_checked(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer segs, payload;
    int threads;
    if (!PyArg_ParseTuple(args, "y*y*i", &segs, &payload, &threads)) return NULL;
    PyObject *result = NULL;
    size_t n = (size_t)segs.len / sizeof(segment_t);
    const segment_t *seg = (const segment_t *)segs.buf;
    const uint8_t *lo = (const uint8_t *)payload.buf, *hi = lo + payload.len;
    if (segs.len % sizeof(segment_t) || !segments_ok(seg, n, lo, hi)) {
        PyErr_SetString(PyExc_IndexError, "scatter_checked: a segment lies outside the payload, out of order, "
                                          "or has a row index out of range");
        goto done;
    }
    uint64_t total = (uint64_t)payload.len;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    if ((size_t)threads > n) threads = n ? (int)n : 1;
    part_t parts[64];
    pthread_t tids[64];
    int started[64] = {0};
    /* part t starts at the first segment whose start is past t/threads of the payload */
    size_t k = 0;
    for (int t = 0; t < threads; t++) {
        const uint8_t *mark = lo + total * (uint64_t)t / (uint64_t)threads;
        while (t > 0 && k < n && (const uint8_t *)(uintptr_t)seg[k].blob < mark) k++;
        parts[t] = (part_t){seg, k, n, t == 0 ? lo : (k < n ? (const uint8_t *)(uintptr_t)seg[k].blob : hi), hi, 0};
        if (t > 0) parts[t - 1].last = k, parts[t - 1].end = parts[t].begin;
    }
    Py_BEGIN_ALLOW_THREADS
    for (int t = 1; t < threads; t++) {
        started[t] = pthread_create(&tids[t], NULL, check_part, &parts[t]) == 0;
        if (!started[t]) check_part(&parts[t]);
    }
    check_part(&parts[0]);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(tids[t], NULL);
    Py_END_ALLOW_THREADS
    uint32_t crc = parts[0].crc;
    for (int t = 1; t < threads; t++) crc = crc32c_combine(crc, parts[t].crc, (uint64_t)(parts[t].end - parts[t].begin));
    result = PyLong_FromUnsignedLong(crc);
done:
    PyBuffer_Release(&segs);
    PyBuffer_Release(&payload);
    return result;
}

static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
    crc32c_state s = crc32c_begin();
    Py_BEGIN_ALLOW_THREADS
    s = crc32c_update(s, data.buf, (size_t)data.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(crc32c_end(s));
}

static PyObject *py_crc32c_combine(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long a, b;
    unsigned long long len;
    if (!PyArg_ParseTuple(args, "kkK", &a, &b, &len)) return NULL;
    return PyLong_FromUnsignedLong(crc32c_combine((uint32_t)a, (uint32_t)b, len));
}

static PyObject *py_crc32c_hardware(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    return PyBool_FromLong(crc32c_hardware());
}

static PyObject *py_crc32c_force_portable(PyObject *self, PyObject *args) {
    (void)self;
    int flag;
    if (!PyArg_ParseTuple(args, "p", &flag)) return NULL;
    crc32c_init(flag);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_rows", py_copy_rows, METH_VARARGS, "Move rows between paged KV tensors and KV_BLOB tensors."},
    {"scatter_checked", py_scatter_checked, METH_VARARGS,
     "Scatter rows of a stored payload into paged tensors, CRC-32C-checksumming it as it is copied."},
    {"crc32c", py_crc32c, METH_VARARGS, "CRC-32C of a buffer (this module's code; tests compare)."},
    {"crc32c_combine", py_crc32c_combine, METH_VARARGS, "crc(A||B) from crc(A), crc(B), len(B)."},
    {"crc32c_hardware", py_crc32c_hardware, METH_NOARGS, "Whether CRC-32C runs on the crc32 instruction."},
    {"crc32c_force_portable", py_crc32c_force_portable, METH_VARARGS,
     "Use the table path (True) or the best path (False): for tests."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_paged_native",
                                    "CPU paged gather/scatter (connectors/paged_native.py)", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__paged_native(void) {
    crc32c_init(0);
    return PyModule_Create(&moddef);
}
