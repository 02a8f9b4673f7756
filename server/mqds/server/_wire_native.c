/* The node's wire work in C: the read path's answer encoding (mqds.server.wire.encode_rows without
 * Python per message), and the store path's check for fields a stored message must not hold.
 *
 * encode_rows(tag, rows, tail) -> (body, stamps)
 *   tag:   the repeated field's tag byte(s), e.g. mqds.server.wire.NEXT_RESPONSE_MESSAGES_TAG
 *   rows:  a list of (data key, stored message bytes) tuples, as the storage layer read them;
 *          a data key is b"D" + stream (4 bytes) + timestamp (8 bytes big-endian)
 *   tail:  the encoded shard field appended to every message
 * body:   for each row, tag + varint(size) + stored + Message.timestamp_us's tag + timestamp (fixed64) + tail
 * stamps: each row's timestamp, 8 bytes little-endian (NextResponse.timestamps' content)
 *
 * The tags of the fields this file reads or writes itself come from wire_tags.h, which proto/generate.py
 * writes from the descriptors.
 *
 * Exactly the bytes of the Python implementation (tests/server/node/test_wire_native.py checks them
 * against each other). The copy runs without the GIL, over a tuple of the rows taken first: it
 * holds every row, rows are tuples and bytes never change, so nothing it reads can change or
 * be freed meanwhile, whatever other threads do to the list.
 *
 * unknown_fields(request, message_types, property_field, property_types) -> list or None
 *   request:        a serialized StoreBatchRequest that parsed (the store path's raw bytes)
 *   message_types:  per field number of mqds.v1.Message, the wire type it must come as (0xFF:
 *                   no such field), built from the descriptor by mqds.server.wire
 *   property_field: the number of Message's repeated UserProperty field
 *   property_types: the same table for mqds.v1.UserProperty
 * For each message (StoreBatchRequest.messages) holding a field its table does not have, or one of another wire
 * type (protobuf keeps either as an unknown field, which the node would store), one tuple
 * (index, property, field, wire type): its first such field, or when its own fields are all
 * known, property (1-based) is the first user property holding one and field is that one's.
 * [] for the common request; None where the request holds a group (wire type 3) beside its
 * messages, which this scan does not skip (the caller asks protobuf instead); ValueError for
 * bytes that do not parse. Tag-level only: a payload is skipped by its length, never read.
 *
 * message_expiry(stored) -> int
 *   The Message Expiry Interval of a stored mqds.v1.Message (0: none), by the same scan of its tags: what
 *   offline fetches and push subscriptions check per message (mqds.server.wire.message_expiry_s).
 * expiry_intervals(values) -> [(index, interval)]
 *   For a list of stored messages' bytes (a stored batch), those that hold an interval: what the store
 *   path indexes for removal (mqds.server.wire.expiry_intervals), in one call for the batch.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "wire_tags.h"

#define KEY_SIZE 13 /* b"D" + u32 stream + u64 timestamp */

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
        *out++ = (char)MESSAGE_TIMESTAMP_US_TAG;
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

/* ---- unknown_fields ------------------------------------------------------------------- */

typedef struct {
    const unsigned char *p;
    const unsigned char *end;
} cursor;

/* 0, or -1 where the varint runs past the end or past 10 bytes. */
static inline int read_varint(cursor *c, uint64_t *out) {
    if (c->p < c->end && *c->p < 0x80) { /* most tags and lengths */
        *out = *c->p++;
        return 0;
    }
    uint64_t v = 0;
    for (int shift = 0; shift < 64 && c->p < c->end; shift += 7) {
        unsigned char b = *c->p++;
        v |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return -1;
}

/* Skip the value of a field of wire type 0, 1, 2 or 5 (the start of its body in `body` for 2):
 * 0, or -1 where it runs past the end (or the wire type is another). */
static inline int skip_value(cursor *c, unsigned wire, cursor *body) {
    uint64_t n;
    switch (wire) {
    case 0:
        return read_varint(c, &n);
    case 1:
    case 5:
        n = wire == 1 ? 8 : 4;
        break;
    case 2:
        if (read_varint(c, &n) < 0)
            return -1;
        break;
    default:
        return -1;
    }
    if (n > (uint64_t)(c->end - c->p))
        return -1;
    if (body != NULL) {
        body->p = c->p;
        body->end = c->p + n;
    }
    c->p += n;
    return 0;
}

typedef struct {
    const unsigned char *types;
    Py_ssize_t n_types;
} table;

static unsigned expected_wire(table t, uint64_t field) { return field < (uint64_t)t.n_types ? t.types[field] : 0xFF; }

/* The first field of `c` its table does not have as it came: 1 and (field, wire), 0 if none, -1 if malformed. */
static int first_unknown(cursor c, table t, uint64_t *field, unsigned *wire) {
    while (c.p < c.end) {
        uint64_t tag;
        if (read_varint(&c, &tag) < 0)
            return -1;
        *field = tag >> 3;
        *wire = (unsigned)(tag & 7);
        if (expected_wire(t, *field) != *wire)
            return 1;
        if (skip_value(&c, *wire, NULL) < 0)
            return -1;
    }
    return 0;
}

/* One message's tuple where it holds an unknown field (appended to `out`): 0, or -1 with an exception set. */
static int check_message(cursor c, Py_ssize_t index, table message, uint64_t property_field, table property,
                         PyObject *out) {
    Py_ssize_t properties = 0, property_at = 0;
    uint64_t field, property_unknown = 0;
    unsigned wire, property_wire = 0;
    while (c.p < c.end) {
        uint64_t tag;
        if (read_varint(&c, &tag) < 0)
            goto malformed;
        field = tag >> 3;
        wire = (unsigned)(tag & 7);
        if (expected_wire(message, field) != wire) {
            property_at = 0;
            goto found;
        }
        cursor body = {NULL, NULL};
        if (skip_value(&c, wire, &body) < 0)
            goto malformed;
        if (field == property_field) {
            properties++;
            if (!property_at) {
                int r = first_unknown(body, property, &property_unknown, &property_wire);
                if (r < 0)
                    goto malformed;
                if (r)
                    property_at = properties;
            }
        }
    }
    if (!property_at)
        return 0;
    field = property_unknown;
    wire = property_wire;
found:;
    PyObject *item = Py_BuildValue("(nnKI)", index, property_at, (unsigned long long)field, wire);
    if (item == NULL)
        return -1;
    int r = PyList_Append(out, item);
    Py_DECREF(item);
    return r;
malformed:
    PyErr_Format(PyExc_ValueError, "message %zd of the request does not parse", index);
    return -1;
}

static PyObject *unknown_fields(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer request;
    const char *message_types, *property_types;
    Py_ssize_t n_message_types, n_property_types;
    unsigned long long property_field;
    if (!PyArg_ParseTuple(args, "y*y#Ky#:unknown_fields", &request, &message_types, &n_message_types, &property_field,
                          &property_types, &n_property_types))
        return NULL;
    table message = {(const unsigned char *)message_types, n_message_types};
    table property = {(const unsigned char *)property_types, n_property_types};
    PyObject *out = PyList_New(0);
    if (out == NULL)
        goto done;
    cursor c = {(const unsigned char *)request.buf, (const unsigned char *)request.buf + request.len};
    Py_ssize_t index = 0;
    while (c.p < c.end) {
        uint64_t tag;
        cursor body = {NULL, NULL};
        if (read_varint(&c, &tag) < 0)
            goto malformed;
        unsigned wire = (unsigned)(tag & 7);
        if (wire == 3 || wire == 4) { /* a group beside the messages: protobuf skips it, not this scan */
            Py_DECREF(out);
            out = Py_None;
            Py_INCREF(out);
            goto done;
        }
        if (skip_value(&c, wire, &body) < 0)
            goto malformed;
        if (tag == STORE_BATCH_REQUEST_MESSAGES_TAG &&
            check_message(body, index++, message, property_field, property, out) < 0)
            goto fail;
    }
    goto done;
malformed:
    PyErr_SetString(PyExc_ValueError, "the request does not parse");
fail:
    Py_CLEAR(out);
done:
    PyBuffer_Release(&request);
    return out;
}

/* ---- message_expiry, expiry_intervals ------------------------------------------------------ */

/* The Message Expiry Interval (mqds.v1.Message.message_expiry_s) a stored message holds, 0 where it has none;
 * as protobuf reads it, the last one where the field comes more than once. A scan of the tags, skipping every
 * value by its length (the payload is never read); 0 for bytes that do not parse (a stored message always
 * does: the store path parsed it). */
static uint64_t scan_expiry(const char *data, Py_ssize_t size) {
    cursor c = {(const unsigned char *)data, (const unsigned char *)data + size};
    uint64_t found = 0;
    while (c.p < c.end) {
        uint64_t tag, value;
        if (read_varint(&c, &tag) < 0)
            return 0;
        if (tag == MESSAGE_MESSAGE_EXPIRY_S_TAG) {
            if (read_varint(&c, &value) < 0)
                return 0;
            found = (uint32_t)value; /* a uint32 field: protobuf keeps the low 32 bits */
            continue;
        }
        if (skip_value(&c, (unsigned)(tag & 7), NULL) < 0)
            return 0;
    }
    return found;
}

static PyObject *message_expiry(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "message_expiry takes the stored message's bytes");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong((unsigned long long)scan_expiry(PyBytes_AS_STRING(arg), PyBytes_GET_SIZE(arg)));
}

static PyObject *expiry_intervals(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyList_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "expiry_intervals takes a list of stored messages' bytes");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(arg); i++) {
        PyObject *value = PyList_GET_ITEM(arg, i);
        if (!PyBytes_Check(value)) {
            PyErr_Format(PyExc_TypeError, "message %zd is not bytes", i);
            Py_DECREF(out);
            return NULL;
        }
        uint64_t expiry = scan_expiry(PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value));
        if (!expiry)
            continue;
        PyObject *item = Py_BuildValue("(nK)", i, (unsigned long long)expiry);
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"encode_rows", encode_rows, METH_VARARGS,
     "encode_rows(tag, rows, tail) -> (body, stamps): stored rows as a repeated mqds.v1.Message field."},
    {"unknown_fields", unknown_fields, METH_VARARGS,
     "unknown_fields(request, message_types, property_field, property_types) -> [(index, property, field, wire)] "
     "or None: the messages of a StoreBatchRequest holding fields mqds.v1.Message does not have as they came."},
    {"message_expiry", message_expiry, METH_O,
     "message_expiry(stored) -> int: the Message Expiry Interval a stored mqds.v1.Message holds (0: none)."},
    {"expiry_intervals", expiry_intervals, METH_O,
     "expiry_intervals(values) -> [(index, interval)]: the stored messages of a list that hold an interval."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_wire_native", "The node's wire work in C: read answers, store requests' fields, expiry intervals.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__wire_native(void) { return PyModule_Create(&module); }
