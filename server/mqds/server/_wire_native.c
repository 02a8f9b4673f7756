/* The read path's answer encoding in C: mqds.server.wire.encode_rows without Python per message.
 *
 * encode_rows(tag, rows, tail) -> (body, stamps)
 *   tag:   the repeated field's tag byte(s), e.g. b"\x0a" (NextResponse.messages)
 *   rows:  a list of (data key, stored message bytes) tuples, as the storage layer read them;
 *          a data key is b"D" + stream (4 bytes) + timestamp (8 bytes big-endian)
 *   tail:  the encoded shard field appended to every message
 * body:   for each row, tag + varint(size) + stored + b"\x39" + timestamp (fixed64) + tail
 * stamps: each row's timestamp, 8 bytes little-endian (NextResponse.timestamps' content)
 *
 * Exactly the bytes of the Python implementation (tests/unit/test_wire_native.py checks them
 * against each other). The copy runs without the GIL, over a tuple of the rows taken first: it
 * holds every row, rows are tuples and bytes never change, so nothing it reads can change or
 * be freed meanwhile, whatever other threads do to the list.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define KEY_SIZE 13   /* b"D" + u32 stream + u64 timestamp */
#define TS_TAG 0x39   /* Message.timestamp_us, field 7, fixed64 */

static Py_ssize_t varint_size(unsigned long long v) {
    Py_ssize_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static char *put_varint(char *out, unsigned long long v) {
    while (v >= 0x80) {
        *out++ = (char)((v & 0x7F) | 0x80);
        v >>= 7;
    }
    *out++ = (char)v;
    return out;
}

static PyObject *encode_rows(PyObject *self, PyObject *args) {
    (void)self;
    const char *tag, *tail;
    Py_ssize_t tag_len, tail_len;
    PyObject *rows;
    if (!PyArg_ParseTuple(args, "y#O!y#:encode_rows", &tag, &tag_len, &PyList_Type, &rows, &tail, &tail_len))
        return NULL;
    PyObject *held = PyList_AsTuple(rows);
    if (held == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(held);
    Py_ssize_t extra = 1 + 8 + tail_len;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyTuple_GET_ITEM(held, i);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 2) {
            PyErr_Format(PyExc_TypeError, "row %zd is not a (key, value) tuple", i);
            goto fail;
        }
        PyObject *key = PyTuple_GET_ITEM(row, 0), *value = PyTuple_GET_ITEM(row, 1);
        if (!PyBytes_Check(key) || !PyBytes_Check(value)) {
            PyErr_Format(PyExc_TypeError, "row %zd: key and value must be bytes", i);
            goto fail;
        }
        if (PyBytes_GET_SIZE(key) != KEY_SIZE) {
            PyErr_Format(PyExc_ValueError, "row %zd: a data key is %d bytes, not %zd", i, KEY_SIZE,
                         PyBytes_GET_SIZE(key));
            goto fail;
        }
        Py_ssize_t item = PyBytes_GET_SIZE(value) + extra;
        total += tag_len + varint_size((unsigned long long)item) + item;
    }
    PyObject *body = PyBytes_FromStringAndSize(NULL, total);
    if (body == NULL)
        goto fail;
    PyObject *stamps = PyBytes_FromStringAndSize(NULL, 8 * n);
    if (stamps == NULL) {
        Py_DECREF(body);
        goto fail;
    }
    char *out = PyBytes_AS_STRING(body), *stamp = PyBytes_AS_STRING(stamps);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyTuple_GET_ITEM(held, i);
        const char *key = PyBytes_AS_STRING(PyTuple_GET_ITEM(row, 0));
        PyObject *value = PyTuple_GET_ITEM(row, 1);
        Py_ssize_t size = PyBytes_GET_SIZE(value);
        memcpy(out, tag, (size_t)tag_len);
        out = put_varint(out + tag_len, (unsigned long long)(size + extra));
        memcpy(out, PyBytes_AS_STRING(value), (size_t)size);
        out += size;
        *out++ = (char)TS_TAG;
        for (int b = 0; b < 8; b++)
            stamp[b] = key[KEY_SIZE - 1 - b];
        memcpy(out, stamp, 8);
        out += 8;
        stamp += 8;
        memcpy(out, tail, (size_t)tail_len);
        out += tail_len;
    }
    Py_END_ALLOW_THREADS
    Py_DECREF(held);
    PyObject *result = PyTuple_Pack(2, body, stamps);
    Py_DECREF(body);
    Py_DECREF(stamps);
    return result;
fail:
    Py_DECREF(held);
    return NULL;
}

static PyMethodDef methods[] = {
    {"encode_rows", encode_rows, METH_VARARGS,
     "encode_rows(tag, rows, tail) -> (body, stamps): stored rows as a repeated mqds.v1.Message field."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_wire_native", "The read path's answer encoding in C.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__wire_native(void) { return PyModule_Create(&module); }
