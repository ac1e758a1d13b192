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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

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

static PyMethodDef methods[] = {
    {"copy_rows", py_copy_rows, METH_VARARGS, "Move rows between paged KV tensors and KV_BLOB tensors."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_paged_native",
                                    "CPU paged gather/scatter (connectors/paged_native.py)", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__paged_native(void) { return PyModule_Create(&moddef); }
