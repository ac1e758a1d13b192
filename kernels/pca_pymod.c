/* CPython binding of the pca CPU coder: kvtool._pca_native. Buffers only (no numpy or torch
 * headers): kvtool/codecs/pca/native.py prepares the calibration's arrays and the RoPE tables and
 * passes them as C-contiguous buffers, whose sizes are checked here. The GIL is released while
 * coding. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "pca_cpu.h"
#include "pca_kernels.h"

static PyObject *CorruptError, *NonFiniteError, *RangeError;

static PyObject *raise_rc(int rc, const char *msg) {
    if (rc == PCA_ERR_NONFINITE) PyErr_SetString(NonFiniteError, msg);
    else if (rc == PCA_ERR_CORRUPT) PyErr_SetString(CorruptError, msg);
    else if (rc == PCA_ERR_RANGE) PyErr_SetString(RangeError, msg);
    else if (rc == PCA_ERR_UNIT) PyErr_SetString(PyExc_OverflowError, msg);
    else if (rc == PCA_ERR_NOMEM) PyErr_NoMemory();
    else PyErr_SetString(PyExc_ValueError, msg);
    return NULL;
}

#define NBUF 16
typedef struct { Py_buffer v[NBUF]; int n; } bufs;

static void release(bufs *b) {
    for (int i = 0; i < b->n; i++) PyBuffer_Release(&b->v[i]);
    b->n = 0;
}

/* a C-contiguous buffer of exactly `size` bytes (writable if asked) */
static const void *take(bufs *b, PyObject *obj, unsigned long long size, int writable, const char *name) {
    Py_buffer *v = &b->v[b->n];
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return NULL;
    b->n++;
    if ((unsigned long long)v->len != size) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %llu", name, v->len, size);
        return NULL;
    }
    return v->buf;
}

/* the buffers both directions share; sizes from the geometry in ck */
static int take_common(bufs *b, pca_chunk *ck, PyObject *mean, PyObject *m2, PyObject *cos, PyObject *sin,
                       PyObject *rope_map, PyObject *freq, PyObject *cost, PyObject *slot) {
    const unsigned long long L = ck->layers, C = ck->channels, Tc = ck->tokens - ck->sinks, U = ck->nrope;
    if (!(ck->rope_of_layer = (const int32_t *)take(b, rope_map, 4ull * L, 0, "rope_map"))) return 0;
    for (unsigned long long l = 0; l < L; l++)
        if (ck->rope_of_layer[l] < 0 || (unsigned long long)ck->rope_of_layer[l] >= U) {
            PyErr_SetString(PyExc_ValueError, "rope_map: a table index out of range");
            return 0;
        }
    if (!(ck->mean = (const float *)take(b, mean, 4ull * 2 * L * C, 0, "mean"))) return 0;
    if (!(ck->m2 = (const int16_t *)take(b, m2, 2ull * 2 * L * C * ck->cols, 0, "m2"))) return 0;
    if (!(ck->cos = (const float *)take(b, cos, 4ull * U * Tc * (ck->head_dim / 2), 0, "cos"))) return 0;
    if (!(ck->sin = (const float *)take(b, sin, 4ull * U * Tc * (ck->head_dim / 2), 0, "sin"))) return 0;
    if (!(ck->freq = (const int32_t *)take(b, freq, 4ull * 32 * 16, 0, "freq"))) return 0;
    if (!(ck->cost = (const int32_t *)take(b, cost, 4ull * 32 * 16, 0, "cost"))) return 0;
    if (!(ck->slot_sym = (const uint8_t *)take(b, slot, 32ull * 4096, 0, "slot_sym"))) return 0;
    return 1;
}

static int geometry_ok(const pca_chunk *ck) {
    if (ck->dtype < 0 || ck->dtype > 2 || ck->sinks > ck->tokens || ck->channels < 2 || ck->channels > 4096 ||
        ck->head_dim < 2 || ck->channels % ck->head_dim || ck->cols < ck->channels || ck->layers < 1) {
        PyErr_SetString(PyExc_ValueError, "pca native: bad geometry");
        return 0;
    }
    return 1;
}

static unsigned long long elem(int dtype) { return dtype == PCA_DTYPE_F32 ? 4u : 2u; }

/* encode(kv, dtype, L, T, C, D, sinks, lanes, cols, block, r, mean, weight, m2, basis, sumsq_limit, nrope, cos, sin,
 *        rope_map, freq, cost, slot_sym, threads) -> bytes */
static PyObject *py_encode(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *kv, *mean, *weight, *m2, *basis, *lim, *cos, *sin, *rmap, *freq, *cost, *slot;
    pca_chunk ck;
    memset(&ck, 0, sizeof ck);
    int threads;
    if (!PyArg_ParseTuple(args, "OiIIIIIIIIdOOOOOIOOOOOOi", &kv, &ck.dtype, &ck.layers, &ck.tokens, &ck.channels,
                          &ck.head_dim, &ck.sinks, &ck.lanes, &ck.cols, &ck.block, &ck.r, &mean, &weight, &m2, &basis, &lim,
                          &ck.nrope, &cos, &sin, &rmap, &freq, &cost, &slot, &threads))
        return NULL;
    if (!geometry_ok(&ck)) return NULL;
    bufs b = {.n = 0};
    const unsigned long long L = ck.layers, C = ck.channels;
    const void *src = take(&b, kv, 2ull * L * ck.tokens * C * elem(ck.dtype), 0, "kv");
    if (!src || !take_common(&b, &ck, mean, m2, cos, sin, rmap, freq, cost, slot) ||
        !(ck.weight = (const float *)take(&b, weight, 4ull * 2 * L * C, 0, "weight")) ||
        !(ck.basis = (const int16_t *)take(&b, basis, 2ull * 2 * L * C * C, 0, "basis")) ||
        !(ck.sumsq_limit = (const int64_t *)take(&b, lim, 8ull * 2 * L, 0, "sumsq_limit"))) {
        release(&b);
        return NULL;
    }
    uint8_t *out = NULL;
    size_t out_len = 0;
    char err[256] = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pca_encode_chunk(src, &ck, threads, &out, &out_len, err, sizeof err);
    Py_END_ALLOW_THREADS
    release(&b);
    if (rc != PCA_OK) return raise_rc(rc, err);
    PyObject *res = PyBytes_FromStringAndSize((const char *)out, (Py_ssize_t)out_len);
    free(out);
    return res;
}

/* decode(payload, out, dtype, L, T, C, D, sinks, cols, block, mean, gain, m2, nrope, cos, sin, rope_map, freq, cost,
 *        slot_sym, threads) -> None */
static PyObject *py_decode(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *payload, *out, *mean, *gain, *m2, *cos, *sin, *rmap, *freq, *cost, *slot;
    pca_chunk ck;
    memset(&ck, 0, sizeof ck);
    int threads;
    if (!PyArg_ParseTuple(args, "OOiIIIIIIIOOOIOOOOOOi", &payload, &out, &ck.dtype, &ck.layers, &ck.tokens,
                          &ck.channels, &ck.head_dim, &ck.sinks, &ck.cols, &ck.block, &mean, &gain, &m2, &ck.nrope, &cos, &sin,
                          &rmap, &freq, &cost, &slot, &threads))
        return NULL;
    if (!geometry_ok(&ck)) return NULL;
    bufs b = {.n = 0};
    Py_buffer *pl = &b.v[b.n];
    if (PyObject_GetBuffer(payload, pl, PyBUF_SIMPLE) < 0) return NULL;
    b.n++;
    const unsigned long long L = ck.layers, C = ck.channels;
    void *dst = (void *)take(&b, out, 2ull * L * ck.tokens * C * elem(ck.dtype), 1, "out");
    if (!dst || !take_common(&b, &ck, mean, m2, cos, sin, rmap, freq, cost, slot) ||
        !(ck.gain = (const float *)take(&b, gain, 4ull * 2 * L * C, 0, "gain"))) {
        release(&b);
        return NULL;
    }
    char err[256] = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pca_decode_chunk((const uint8_t *)pl->buf, (size_t)pl->len, &ck, dst, threads, err, sizeof err);
    Py_END_ALLOW_THREADS
    release(&b);
    if (rc != PCA_OK) return raise_rc(rc, err);
    Py_RETURN_NONE;
}

/* the payload's bytes object, made where the coder asks for it (the GIL taken for that moment): the
 * coder lays the payload out in it, one copy */
typedef struct { PyObject *bytes; } bytes_out;

static uint8_t *alloc_bytes(void *ctx, size_t n) {
    bytes_out *o = (bytes_out *)ctx;
    PyGILState_STATE st = PyGILState_Ensure();
    o->bytes = n <= PY_SSIZE_T_MAX ? PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n) : NULL;
    if (!o->bytes) PyErr_Clear(); /* the coder reports PCA_ERR_NOMEM */
    PyGILState_Release(st);
    return o->bytes ? (uint8_t *)PyBytes_AS_STRING(o->bytes) : NULL;
}

/* encode2(kv, dtype, L, T, C, D, sinks, unit, cols, block, r, mean, weight, m2, basis, sumsq_limit, nrope, cos,
 * sin, rope_map, freq, cost, slot_sym, threads, head, sink_bytes) -> bytes: the whole version-2 payload,
 * head (its header) and sink_bytes (its sinks) as given (pca_cpu.h); OverflowError when a pair of
 * units exceeds 65535 bytes */
static PyObject *py_encode2(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *kv, *head, *sink_bytes, *mean, *weight, *m2, *basis, *lim, *cos, *sin, *rmap, *freq, *cost, *slot;
    pca_chunk ck;
    memset(&ck, 0, sizeof ck);
    int threads;
    unsigned int unit;
    if (!PyArg_ParseTuple(args, "OiIIIIIIIIdOOOOOIOOOOOOiOO", &kv, &ck.dtype, &ck.layers, &ck.tokens, &ck.channels,
                          &ck.head_dim, &ck.sinks, &unit, &ck.cols, &ck.block, &ck.r, &mean, &weight, &m2, &basis, &lim,
                          &ck.nrope, &cos, &sin, &rmap, &freq, &cost, &slot, &threads, &head, &sink_bytes))
        return NULL;
    if (!geometry_ok(&ck)) return NULL;
    bufs b = {.n = 0};
    const unsigned long long L = ck.layers, C = ck.channels;
    const void *src = take(&b, kv, 2ull * L * ck.tokens * C * elem(ck.dtype), 0, "kv");
    if (!src || !take_common(&b, &ck, mean, m2, cos, sin, rmap, freq, cost, slot) ||
        !(ck.weight = (const float *)take(&b, weight, 4ull * 2 * L * C, 0, "weight")) ||
        !(ck.basis = (const int16_t *)take(&b, basis, 2ull * 2 * L * C * C, 0, "basis")) ||
        !(ck.sumsq_limit = (const int64_t *)take(&b, lim, 8ull * 2 * L, 0, "sumsq_limit"))) {
        release(&b);
        return NULL;
    }
    Py_buffer *hb = &b.v[b.n];
    if (PyObject_GetBuffer(head, hb, PyBUF_SIMPLE) < 0) { release(&b); return NULL; }
    b.n++;
    const uint8_t *sinks = (const uint8_t *)take(&b, sink_bytes, 2ull * L * ck.sinks * C * elem(ck.dtype), 0,
                                                 "sink_bytes");
    if (!sinks) {
        release(&b);
        return NULL;
    }
    bytes_out o = {NULL};
    char err[256] = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pca_encode_chunk_v2(src, &ck, unit, threads, (const uint8_t *)hb->buf, (size_t)hb->len, sinks,
                             2ull * L * ck.sinks * C * elem(ck.dtype), alloc_bytes, &o, err, sizeof err);
    Py_END_ALLOW_THREADS
    release(&b);
    if (rc != PCA_OK) {
        Py_XDECREF(o.bytes);
        return raise_rc(rc, err);
    }
    return o.bytes;
}

/* decode2(payload, out, dtype, L, T, C, D, sinks, cols, block, mean, gain, m2, nrope, cos, sin, rope_map, freq,
 * cost, slot_sym, units, row_units, consumed, threads): bitstream version 2 (pca_units.inc); units int64
 * [n][6] (row, first symbol, count, stream's first byte, direction, length), row_units int32 [2L + 1],
 * consumed int64 [n] (out: each unit's stream bytes used); the sinks are the caller's */
static PyObject *py_decode2(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *payload, *out, *mean, *gain, *m2, *cos, *sin, *rmap, *freq, *cost, *slot, *units, *row_units, *consumed;
    pca_chunk ck;
    memset(&ck, 0, sizeof ck);
    int threads;
    if (!PyArg_ParseTuple(args, "OOiIIIIIIIOOOIOOOOOOOOOi", &payload, &out, &ck.dtype, &ck.layers, &ck.tokens,
                          &ck.channels, &ck.head_dim, &ck.sinks, &ck.cols, &ck.block, &mean, &gain, &m2, &ck.nrope, &cos,
                          &sin, &rmap, &freq, &cost, &slot, &units, &row_units, &consumed, &threads))
        return NULL;
    if (!geometry_ok(&ck)) return NULL;
    bufs b = {.n = 0};
    Py_buffer *pl = &b.v[b.n];
    if (PyObject_GetBuffer(payload, pl, PyBUF_SIMPLE) < 0) return NULL;
    b.n++;
    const unsigned long long L = ck.layers, C = ck.channels;
    Py_buffer *ub = &b.v[b.n];
    if (PyObject_GetBuffer(units, ub, PyBUF_C_CONTIGUOUS) < 0) { release(&b); return NULL; }
    b.n++;
    const unsigned long long n = (unsigned long long)ub->len / 48;
    void *dst = (void *)take(&b, out, 2ull * L * ck.tokens * C * elem(ck.dtype), 1, "out");
    const int32_t *ru = dst ? (const int32_t *)take(&b, row_units, 4ull * (2 * L + 1), 0, "row_units") : NULL;
    int64_t *used = ru ? (int64_t *)take(&b, consumed, 8ull * n, 1, "consumed") : NULL;
    if (!used || (unsigned long long)ub->len != 48 * n || n >= (1ull << 31) ||
        !take_common(&b, &ck, mean, m2, cos, sin, rmap, freq, cost, slot) ||
        !(ck.gain = (const float *)take(&b, gain, 4ull * 2 * L * C, 0, "gain"))) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "units: not [n][6] int64");
        release(&b);
        return NULL;
    }
    char err[256] = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pca_decode_chunk_v2((const uint8_t *)pl->buf, (size_t)pl->len, &ck, (const int64_t *)ub->buf, (uint32_t)n, ru,
                             used, dst, threads, err, sizeof err);
    Py_END_ALLOW_THREADS
    release(&b);
    if (rc != PCA_OK) return raise_rc(rc, err);
    Py_RETURN_NONE;
}

/* f32_to_f16(bytes of float32) -> bytes of float16 bits: the decoder's rounding, for the tests */
static PyObject *py_f32_to_f16(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer v;
    if (PyObject_GetBuffer(arg, &v, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    const Py_ssize_t n = v.len / 4;
    PyObject *res = PyBytes_FromStringAndSize(NULL, 2 * n);
    if (res) {
        uint8_t *o = (uint8_t *)PyBytes_AS_STRING(res);
        for (Py_ssize_t i = 0; i < n; i++) {
            float f;
            memcpy(&f, (const uint8_t *)v.buf + 4 * i, 4);
            const uint16_t h = pca_f32_to_f16(f);
            memcpy(o + 2 * i, &h, 2);
        }
    }
    PyBuffer_Release(&v);
    return res;
}

static PyObject *py_simd(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(pca_simd_avx512() ? "avx512" : pca_simd_avx2() ? "avx2" : "portable");
}

static PyObject *py_units_gather(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(pca_simd_avx512() && pca_units_gather());
}

static PyMethodDef methods[] = {
    {"encode", py_encode, METH_VARARGS, "encode one chunk (see kvtool/codecs/pca/native.py)"},
    {"decode", py_decode, METH_VARARGS, "decode one chunk into a buffer (see kvtool/codecs/pca/native.py)"},
    {"encode2", py_encode2, METH_VARARGS, "encode one chunk's version-2 units (see kvtool/codecs/pca/native.py)"},
    {"decode2", py_decode2, METH_VARARGS, "decode one chunk of bitstream version 2 into a buffer (native.py)"},
    {"f32_to_f16", py_f32_to_f16, METH_O, "float32 bytes -> float16 bits as numpy rounds them"},
    {"simd", py_simd, METH_NOARGS, "the coder's widest code path: 'avx512', 'avx2' or 'portable'"},
    {"units_gather", py_units_gather, METH_NOARGS,
     "whether version 2's AVX-512 unit decoder reads by gathers (else by scalar loads; KVTOOL_PCA_GATHER)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_pca_native", "Native pca coder (format-spec/pca.md)",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__pca_native(void) {
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    CorruptError = PyErr_NewException("kvtool._pca_native.CorruptError", PyExc_ValueError, NULL);
    NonFiniteError = PyErr_NewException("kvtool._pca_native.NonFiniteError", PyExc_ValueError, NULL);
    RangeError = PyErr_NewException("kvtool._pca_native.RangeError", PyExc_ValueError, NULL);
    if (!CorruptError || !NonFiniteError || !RangeError) return NULL;
    Py_INCREF(CorruptError);
    Py_INCREF(NonFiniteError);
    Py_INCREF(RangeError);
    PyModule_AddObject(m, "CorruptError", CorruptError);
    PyModule_AddObject(m, "NonFiniteError", NonFiniteError);
    PyModule_AddObject(m, "RangeError", RangeError);
    PyModule_AddIntConstant(m, "FORMAT_VERSION", 1);
    return m;
}
