/* CPython binding of the CacheGen CPU coder: kvtool._cachegen_native.
 * Works on buffers only (no torch headers): bytes-like in, bytes / a writable
 * buffer out. The GIL is released while coding. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

#include "cachegen_cpu.h"

static PyObject *CorruptError;
static PyObject *NonFiniteError;

static PyObject *raise_rc(int rc, const char *msg) {
    if (rc == CG_ERR_NONFINITE) PyErr_SetString(NonFiniteError, msg);
    else if (rc == CG_ERR_CORRUPT) PyErr_SetString(CorruptError, msg);
    else if (rc == CG_ERR_NOMEM) PyErr_NoMemory();
    else PyErr_SetString(PyExc_ValueError, msg);
    return NULL;
}

/* bins: bytes-like of `layers` little-endian uint16 bin counts */
static uint16_t *read_bins(PyObject *obj, uint32_t layers) {
    Py_buffer v;
    if (PyObject_GetBuffer(obj, &v, PyBUF_SIMPLE) < 0) return NULL;
    if ((uint64_t)v.len != 2ull * layers || layers == 0) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "bins must hold one uint16 per layer");
        return NULL;
    }
    uint16_t *b = (uint16_t *)malloc(2u * (size_t)layers);
    if (!b) { PyBuffer_Release(&v); PyErr_NoMemory(); return NULL; }
    memcpy(b, v.buf, 2u * (size_t)layers);
    PyBuffer_Release(&v);
    return b;
}

static size_t elem_size(int dtype) { return dtype == 2 ? 4u : 2u; }

/* encode(kv, dtype_code, layers, tokens, channels, bins_u16, prob_bits, lanes, threads) -> bytes */
static PyObject *py_encode(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *kvobj, *binsobj;
    int dtype, prob_bits, lanes, threads;
    unsigned int layers, tokens, channels;
    if (!PyArg_ParseTuple(args, "OiIIIOiii", &kvobj, &dtype, &layers, &tokens, &channels, &binsobj,
                          &prob_bits, &lanes, &threads))
        return NULL;
    uint16_t *bins = read_bins(binsobj, layers);
    if (!bins) return NULL;
    Py_buffer kv;
    if (PyObject_GetBuffer(kvobj, &kv, PyBUF_C_CONTIGUOUS) < 0) { free(bins); return NULL; }
    if ((uint64_t)kv.len != (uint64_t)layers * tokens * channels * elem_size(dtype)) {
        PyBuffer_Release(&kv);
        free(bins);
        PyErr_SetString(PyExc_ValueError, "kv buffer size does not match layers*tokens*channels*itemsize");
        return NULL;
    }
    cg_chunk ck = {dtype, layers, tokens, channels, bins, prob_bits, lanes};
    uint8_t *out = NULL;
    size_t out_len = 0;
    char err[256] = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = cg_encode_chunk(kv.buf, &ck, threads, &out, &out_len, err, sizeof err);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&kv);
    free(bins);
    if (rc != CG_OK) return raise_rc(rc, err);
    PyObject *res = PyBytes_FromStringAndSize((const char *)out, (Py_ssize_t)out_len);
    free(out);
    return res;
}

/* decode(payload, out, dtype_code, layers, tokens, channels, bins_u16, threads) -> (prob_bits, lanes) */
static PyObject *py_decode(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *pobj, *oobj, *binsobj;
    int dtype, threads;
    unsigned int layers, tokens, channels;
    if (!PyArg_ParseTuple(args, "OOiIIIOi", &pobj, &oobj, &dtype, &layers, &tokens, &channels, &binsobj,
                          &threads))
        return NULL;
    uint16_t *bins = read_bins(binsobj, layers);
    if (!bins) return NULL;
    Py_buffer pl, ob;
    if (PyObject_GetBuffer(pobj, &pl, PyBUF_SIMPLE) < 0) { free(bins); return NULL; }
    if (PyObject_GetBuffer(oobj, &ob, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&pl);
        free(bins);
        return NULL;
    }
    if ((uint64_t)ob.len != (uint64_t)layers * tokens * channels * elem_size(dtype)) {
        PyBuffer_Release(&pl);
        PyBuffer_Release(&ob);
        free(bins);
        PyErr_SetString(PyExc_ValueError, "output buffer size does not match layers*tokens*channels*itemsize");
        return NULL;
    }
    cg_chunk ck = {dtype, layers, tokens, channels, bins, 0, 0};
    char err[256] = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = cg_decode_chunk((const uint8_t *)pl.buf, (size_t)pl.len, &ck, ob.buf, threads, err, sizeof err);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&pl);
    PyBuffer_Release(&ob);
    free(bins);
    if (rc != CG_OK) return raise_rc(rc, err);
    return Py_BuildValue("(ii)", ck.prob_bits, ck.lanes);
}

static PyMethodDef methods[] = {
    {"encode", py_encode, METH_VARARGS,
     "encode(kv, dtype_code, layers, tokens, channels, bins_u16, prob_bits, lanes, threads) -> bytes"},
    {"decode", py_decode, METH_VARARGS,
     "decode(payload, out, dtype_code, layers, tokens, channels, bins_u16, threads) -> (prob_bits, lanes)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_cachegen_native",
                                    "Native CacheGen coder (format-spec/cachegen.md)", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cachegen_native(void) {
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    CorruptError = PyErr_NewException("kvtool._cachegen_native.CorruptError", PyExc_ValueError, NULL);
    NonFiniteError = PyErr_NewException("kvtool._cachegen_native.NonFiniteError", PyExc_ValueError, NULL);
    if (!CorruptError || !NonFiniteError) return NULL;
    Py_INCREF(CorruptError);
    Py_INCREF(NonFiniteError);
    PyModule_AddObject(m, "CorruptError", CorruptError);
    PyModule_AddObject(m, "NonFiniteError", NonFiniteError);
    PyModule_AddIntConstant(m, "FORMAT_VERSION", 1);
    return m;
}
