/* CPU paged gather/scatter: kvtool._paged_native (connectors/paged_native.py calls it).
 *
 * connectors/paged_native.py reduces every layout to "segments": one per (layer, K/V) tensor, the
 * blob's rows for that tensor in blob order, and where each row lives in the paged tensor. A row
 * is `run` bytes of the blob (a token's H*D channels, or one head's D channels); in the paged
 * tensor it starts at paged + rows[i] * unit and is contiguous (stride 0) or made of elements of
 * `elem` bytes `stride` bytes apart (vLLM's CPU K pages are transposed: one channel every
 * block_size elements). There are no torch headers: tensors come as pointers and byte counts,
 * and every row of every segment is checked against its tensor's extent before anything is
 * copied, so a bad index is an error, never a stray or partial write. Threads take whole
 * segments, the GIL released.
 *
 * A segment: 9 uint64 (paged_ptr, paged_bytes, blob_ptr, nrows, run, rows_ptr, unit, stride, elem),
 * rows_ptr pointing to nrows int64.
 *
 * copy_segments(segments, scatter, threads) -> None
 *   scatter: 1 = blob -> paged, 0 = paged -> blob
 *
 * scatter_checked(segments, payload, threads) -> CRC-32C of payload
 *   The load of a stored chunk straight from its (memory-mapped) bytes: every byte of `payload`
 *   is read once, checksummed as it is copied (crc32c_cpu.c), and the CRC of the whole payload
 *   comes back for the caller to compare with the stored one. The bytes written are the bytes
 *   checked even if the mapping changes meanwhile; a mismatch means the caller refuses the
 *   chunk (its slots then hold no loaded tokens). Segments' blobs lie inside the payload in
 *   ascending order, apart; bytes no segment copies are checksummed only. The payload is split
 *   between threads at segment starts and the parts' CRCs combined.
 *
 * crc32c(buffer) -> CRC-32C;  crc32c_combine(a, b, len_b);  crc32c_hardware() -> bool;
 * crc32c_force_portable(flag): this module's CRC code, for tests.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "crc32c_cpu.h"

typedef struct {
    uint64_t paged, paged_bytes, blob, nrows, run, rows, unit, stride, elem;
} segment_t;

#define MAX_THREADS 64

/* ---- checks ------------------------------------------------------------------------------- */

/* Every row of every segment inside its paged tensor; sane sizes. Rows lists are mostly shared
 * by many segments, so their extremes are computed once per list. */
static int segments_ok(const segment_t *seg, size_t n) {
    uint64_t last_rows = 0;
    int64_t lo = 0, hi = -1;
    for (size_t k = 0; k < n; k++) {
        const segment_t *g = &seg[k];
        if (!g->paged || !g->blob || !g->rows || !g->run || !g->unit) return 0;
        if (g->stride && (!g->elem || g->run % g->elem || g->stride < g->elem)) return 0;
        if (g->rows != last_rows) {
            const int64_t *r = (const int64_t *)(uintptr_t)g->rows;
            lo = 0, hi = -1;
            for (uint64_t i = 0; i < g->nrows; i++) {
                if (i == 0 || r[i] < lo) lo = r[i];
                if (i == 0 || r[i] > hi) hi = r[i];
            }
            last_rows = g->rows;
        }
        if (!g->nrows) continue;
        /* the last byte a row touches, from its start */
        uint64_t reach = g->stride ? (g->run / g->elem - 1) * g->stride + g->elem : g->run;
        if (lo < 0 || reach > g->paged_bytes || (uint64_t)hi > (g->paged_bytes - reach) / g->unit) return 0;
    }
    return 1;
}

/* ---- plain copies ------------------------------------------------------------------------- */

#define COPY_FIXED(N)                                                                   \
    for (size_t i = 0; i < nrows; i++) {                                                \
        char *p = paged + (size_t)rows[i] * unit, *b = blob + i * (N);                  \
        if (scatter) memcpy(p, b, (N)); else memcpy(b, p, (N));                         \
    }
#define COPY_STRIDED(T)                                                                 \
    for (size_t i = 0; i < nrows; i++) {                                                \
        char *p = paged + (size_t)rows[i] * unit, *b = blob + i * run;                  \
        for (size_t j = 0; j < run / sizeof(T); j++)                                    \
            if (scatter) memcpy(p + j * stride, b + j * sizeof(T), sizeof(T));          \
            else memcpy(b + j * sizeof(T), p + j * stride, sizeof(T));                  \
    }

static void copy_segment(const segment_t *g, int scatter) {
    char *paged = (char *)(uintptr_t)g->paged, *blob = (char *)(uintptr_t)g->blob;
    const int64_t *rows = (const int64_t *)(uintptr_t)g->rows;
    size_t nrows = g->nrows, unit = g->unit, run = g->run, stride = g->stride;
    if (stride) {
        switch (g->elem) {
        case 2: COPY_STRIDED(uint16_t); return;
        case 4: COPY_STRIDED(uint32_t); return;
        default:
            for (size_t i = 0; i < nrows; i++)
                for (size_t j = 0; j < run / g->elem; j++) {
                    char *p = paged + (size_t)rows[i] * unit + j * stride, *b = blob + i * run + j * g->elem;
                    if (scatter) memcpy(p, b, g->elem); else memcpy(b, p, g->elem);
                }
            return;
        }
    }
    switch (run) { /* one element per row: a fixed-size copy the compiler inlines */
    case 2: COPY_FIXED(2); return;
    case 4: COPY_FIXED(4); return;
    case 8: COPY_FIXED(8); return;
    default: COPY_FIXED(run); return;
    }
}

typedef struct {
    const segment_t *seg;
    size_t first, last;
    int scatter;
} copy_job;

static void *copy_work(void *arg) {
    copy_job *j = (copy_job *)arg;
    for (size_t k = j->first; k < j->last; k++) copy_segment(&j->seg[k], j->scatter);
    return NULL;
}

/* Run fn over jobs[0..threads) on threads (job 0 on this one), the GIL released by the caller. */
static void run_jobs(void *(*fn)(void *), void *jobs, size_t job_size, int threads) {
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 1; t < threads; t++) {
        void *job = (char *)jobs + (size_t)t * job_size;
        started[t] = pthread_create(&tids[t], NULL, fn, job) == 0;
        if (!started[t]) fn(job); /* no thread: do its share here */
    }
    fn(jobs);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(tids[t], NULL);
}

static int clamp_threads(int threads, size_t n) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if ((size_t)threads > n) threads = n ? (int)n : 1;
    return threads;
}

static PyObject *py_copy_segments(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer segs;
    int scatter, threads;
    if (!PyArg_ParseTuple(args, "y*ii", &segs, &scatter, &threads)) return NULL;
    PyObject *result = NULL;
    size_t n = (size_t)segs.len / sizeof(segment_t);
    const segment_t *seg = (const segment_t *)segs.buf;
    if (segs.len % sizeof(segment_t) || !segments_ok(seg, n)) {
        PyErr_SetString(PyExc_IndexError, "copy_segments: a row index is out of range or a segment is malformed");
        goto done;
    }
    threads = clamp_threads(threads, n);
    copy_job jobs[MAX_THREADS];
    for (int t = 0; t < threads; t++) jobs[t] = (copy_job){seg, n * t / threads, n * (t + 1) / threads, scatter};
    Py_BEGIN_ALLOW_THREADS
    run_jobs(copy_work, jobs, sizeof(copy_job), threads);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&segs);
    return result;
}

/* ---- scatter_checked ---------------------------------------------------------------------- */

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
        crc32c_rows r = {(uint8_t *)(uintptr_t)g->paged, (const int64_t *)(uintptr_t)g->rows, (size_t)g->nrows,
                         (size_t)g->unit, (size_t)g->run, (size_t)g->stride, (size_t)g->elem, blob};
        s = crc32c_scatter_rows(s, &r);
        pos = blob + g->nrows * g->run;
    }
    s = crc32c_update(s, pos, (size_t)(p->end - pos));
    p->crc = crc32c_end(s);
    return NULL;
}

/* Segments' blobs inside [lo, hi), ascending, apart. */
static int inside_payload(const segment_t *seg, size_t n, const uint8_t *lo, const uint8_t *hi) {
    const uint8_t *pos = lo;
    for (size_t k = 0; k < n; k++) {
        const uint8_t *blob = (const uint8_t *)(uintptr_t)seg[k].blob;
        if (blob < pos || blob > hi || seg[k].nrows > (uint64_t)(hi - blob) / seg[k].run) return 0;
        pos = blob + seg[k].nrows * seg[k].run;
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
    if (segs.len % sizeof(segment_t) || !segments_ok(seg, n) || !inside_payload(seg, n, lo, hi)) {
        PyErr_SetString(PyExc_IndexError, "scatter_checked: a segment lies outside the payload, out of order, "
                                          "or has a row index out of range");
        goto done;
    }
    threads = clamp_threads(threads, n);
    part_t parts[MAX_THREADS];
    /* part t starts at the first segment whose start is at or past t/threads of the payload */
    size_t k = 0;
    uint64_t total = (uint64_t)payload.len;
    for (int t = 0; t < threads; t++) {
        const uint8_t *mark = lo + total * (uint64_t)t / (uint64_t)threads;
        while (t > 0 && k < n && (const uint8_t *)(uintptr_t)seg[k].blob < mark) k++;
        const uint8_t *begin = t == 0 ? lo : (k < n ? (const uint8_t *)(uintptr_t)seg[k].blob : hi);
        parts[t] = (part_t){seg, k, n, begin, hi, 0};
        if (t > 0) parts[t - 1].last = k, parts[t - 1].end = begin;
    }
    Py_BEGIN_ALLOW_THREADS
    run_jobs(check_part, parts, sizeof(part_t), threads);
    Py_END_ALLOW_THREADS
    uint32_t crc = parts[0].crc;
    for (int t = 1; t < threads; t++)
        crc = crc32c_combine(crc, parts[t].crc, (uint64_t)(parts[t].end - parts[t].begin));
    result = PyLong_FromUnsignedLong(crc);
done:
    PyBuffer_Release(&segs);
    PyBuffer_Release(&payload);
    return result;
}

/* ---- CRC-32C itself, for tests -------------------------------------------------------------- */

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
    {"copy_segments", py_copy_segments, METH_VARARGS, "Move rows between paged KV tensors and KV_BLOB tensors."},
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
