/* Pipelined writes in C: a message checked and sized, a batch's StoreStream frame, a batch's answer.
 *
 * message_size(message) -> int
 *   message: an mqds.client.Message (anything with its attributes: topic, payload, sender, qos,
 *            retain, properties, message_expiry_s)
 *   The size of its mqds.v1.Message wire form (what mqds.protocol.wire.encode_message makes),
 *   or -1 when the message breaks one of the rules of mqds.protocol.messages (a topic that is
 *   empty, holds NUL or a wildcard, is not UTF-8 or is over 65,535 bytes; qos not 0, 1 or 2; a
 *   sender over 65,535 bytes or not UTF-8; more than 1,024 user properties or more than 64 KiB
 *   of them, or one that is not UTF-8) or holds what this reader does not take (a payload that
 *   is not bytes, properties that are not a tuple of (str, str) pairs, an expiry interval that is not
 *   an int from 0 to 4,294,967,295): the caller then checks
 *   and encodes it in Python, which says what is wrong.
 *
 * store_frame(messages, producer_id, sequence) -> bytes
 *   A StoreStreamRequest carrying StoreBatchRequest(messages, sync=True, producer_id, sequence):
 *   the same bytes as mqds.protocol.wire.store_stream_frame of the messages' encode_message.
 *   Raises ValueError for a message message_size refuses (the caller encodes in Python then).
 *
 * read_answer(data) -> (sequence, timestamps) or None
 *   data: a serialized StoreStreamResponse. For the common answer, every message stored (positions
 *   only, no failures, no message_failures): its sequence and the positions' timestamp_us, a list.
 *   None for any other answer (failures, message failures, a field this reader does not expect,
 *   damaged bytes): the caller parses it with protobuf.
 *
 * Every tag is written and read as the one byte it is, by the name wire_tags.h gives it (proto/generate.py
 * writes that header from the descriptors).
 *
 * tests/client/test_store_frames.py checks each against protobuf and the Python encoder.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "wire_tags.h"

#define MAX_TOPIC_BYTES 65535
#define MAX_SENDER_BYTES 65535
#define MAX_USER_PROPERTIES 1024
#define MAX_USER_PROPERTY_BYTES 65536

static PyObject *s_topic, *s_payload, *s_sender, *s_qos, *s_retain, *s_properties, *s_message_expiry_s;

static inline Py_ssize_t varint_len(uint64_t v) {
    Py_ssize_t n = 1;
    while (v > 0x7F) {
        v >>= 7;
        n++;
    }
    return n;
}

static inline unsigned char *put_varint(unsigned char *p, uint64_t v) {
    while (v > 0x7F) {
        *p++ = (unsigned char)((v & 0x7F) | 0x80);
        v >>= 7;
    }
    *p++ = (unsigned char)v;
    return p;
}

/* A length-delimited field of n bytes: its tag, length and body. */
static inline Py_ssize_t field_len(Py_ssize_t n) {
    return 1 + varint_len((uint64_t)n) + n;
}

typedef struct {
    const char *topic;
    Py_ssize_t topic_n;
    const char *payload;
    Py_ssize_t payload_n;
    const char *sender;
    Py_ssize_t sender_n;
    long qos;
    int retain;
    PyObject *properties; /* a tuple, borrowed from the message while it is held */
    uint64_t expiry;      /* message_expiry_s: MQTT 5's Message Expiry Interval, 0 for none */
    Py_ssize_t size;      /* the message's wire size */
    PyObject *refs[7];    /* the attributes read, released by release() */
} view;

static void release(view *v) {
    for (int i = 0; i < 7; i++)
        Py_CLEAR(v->refs[i]);
}

/* UTF-8 of a str, or NULL (error cleared) for one UTF-8 cannot hold (a lone surrogate). */
static const char *utf8(PyObject *s, Py_ssize_t *n) {
    const char *out = PyUnicode_AsUTF8AndSize(s, n);
    if (out == NULL)
        PyErr_Clear();
    return out;
}

/* Read and check one message; 1 when it is one to encode here, 0 when Python must look at it, -1 on an error. */
static int read_view(PyObject *m, view *v) {
    memset(v, 0, sizeof(*v));
    PyObject **r = v->refs;
    if (!(r[0] = PyObject_GetAttr(m, s_topic)) || !(r[1] = PyObject_GetAttr(m, s_payload)) ||
        !(r[2] = PyObject_GetAttr(m, s_sender)) || !(r[3] = PyObject_GetAttr(m, s_qos)) ||
        !(r[4] = PyObject_GetAttr(m, s_retain)) || !(r[5] = PyObject_GetAttr(m, s_properties)) ||
        !(r[6] = PyObject_GetAttr(m, s_message_expiry_s)))
        return -1;
    if (!PyUnicode_CheckExact(r[0]) || !PyBytes_CheckExact(r[1]) || !PyUnicode_CheckExact(r[2]) ||
        !PyLong_Check(r[3]) || !PyTuple_CheckExact(r[5]) || !PyLong_Check(r[6]))
        return 0;
    if (!(v->topic = utf8(r[0], &v->topic_n)) || v->topic_n == 0 || v->topic_n > MAX_TOPIC_BYTES)
        return 0;
    if (memchr(v->topic, '\0', v->topic_n) || memchr(v->topic, '+', v->topic_n) || memchr(v->topic, '#', v->topic_n))
        return 0;
    v->payload = PyBytes_AS_STRING(r[1]);
    v->payload_n = PyBytes_GET_SIZE(r[1]);
    if (!(v->sender = utf8(r[2], &v->sender_n)) || v->sender_n > MAX_SENDER_BYTES)
        return 0;
    int overflow = 0;
    v->qos = PyLong_AsLongAndOverflow(r[3], &overflow);
    if (overflow || v->qos < 0 || v->qos > 2) {
        PyErr_Clear();
        return 0;
    }
    int retain = PyObject_IsTrue(r[4]);
    if (retain < 0)
        return -1;
    v->retain = retain;
    long long expiry = PyLong_AsLongLongAndOverflow(r[6], &overflow);
    if (overflow || expiry < 0 || expiry > 0xFFFFFFFFLL) {
        PyErr_Clear();
        return 0;
    }
    v->expiry = (uint64_t)expiry;
    v->properties = r[5];
    Py_ssize_t count = PyTuple_GET_SIZE(r[5]);
    if (count > MAX_USER_PROPERTIES)
        return 0;
    Py_ssize_t size = 0, property_bytes = 0;
    if (v->topic_n)
        size += field_len(v->topic_n);
    if (v->payload_n)
        size += field_len(v->payload_n);
    if (v->sender_n)
        size += field_len(v->sender_n);
    if (v->qos)
        size += 2;
    if (v->retain)
        size += 2;
    if (v->expiry)
        size += 1 + varint_len(v->expiry);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *pair = PyTuple_GET_ITEM(r[5], i);
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2)
            return 0;
        PyObject *key = PyTuple_GET_ITEM(pair, 0), *value = PyTuple_GET_ITEM(pair, 1);
        Py_ssize_t kn, vn;
        if (!PyUnicode_CheckExact(key) || !PyUnicode_CheckExact(value) || !utf8(key, &kn) || !utf8(value, &vn))
            return 0;
        property_bytes += kn + vn;
        if (property_bytes > MAX_USER_PROPERTY_BYTES)
            return 0;
        Py_ssize_t entry = (kn ? field_len(kn) : 0) + (vn ? field_len(vn) : 0);
        size += field_len(entry);
    }
    v->size = size;
    return 1;
}

static unsigned char *put_bytes(unsigned char *p, unsigned char tag, const char *data, Py_ssize_t n) {
    *p++ = tag;
    p = put_varint(p, (uint64_t)n);
    memcpy(p, data, (size_t)n);
    return p + n;
}

/* Write a message read_view accepted (its UTF-8 forms are cached in its strings). */
static unsigned char *put_message(unsigned char *p, const view *v) {
    if (v->topic_n)
        p = put_bytes(p, MESSAGE_TOPIC_TAG, v->topic, v->topic_n);
    if (v->payload_n)
        p = put_bytes(p, MESSAGE_PAYLOAD_TAG, v->payload, v->payload_n);
    if (v->sender_n)
        p = put_bytes(p, MESSAGE_SENDER_TAG, v->sender, v->sender_n);
    if (v->qos) {
        *p++ = MESSAGE_QOS_TAG;
        *p++ = (unsigned char)v->qos;
    }
    if (v->retain) {
        *p++ = MESSAGE_RETAIN_TAG;
        *p++ = 0x01; /* true */
    }
    Py_ssize_t count = PyTuple_GET_SIZE(v->properties);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *pair = PyTuple_GET_ITEM(v->properties, i);
        Py_ssize_t kn, vn;
        const char *k = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(pair, 0), &kn);
        const char *val = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(pair, 1), &vn);
        Py_ssize_t entry = (kn ? field_len(kn) : 0) + (vn ? field_len(vn) : 0);
        *p++ = MESSAGE_PROPERTIES_TAG;
        p = put_varint(p, (uint64_t)entry);
        if (kn)
            p = put_bytes(p, USER_PROPERTY_KEY_TAG, k, kn);
        if (vn)
            p = put_bytes(p, USER_PROPERTY_VALUE_TAG, val, vn);
    }
    if (v->expiry) { /* field 9, after the properties: fields in number order, as protobuf writes them */
        *p++ = MESSAGE_MESSAGE_EXPIRY_S_TAG;
        p = put_varint(p, v->expiry);
    }
    return p;
}

static PyObject *message_size(PyObject *self, PyObject *m) {
    view v;
    int ok = read_view(m, &v);
    release(&v);
    if (ok < 0)
        return NULL;
    return PyLong_FromSsize_t(ok ? v.size : -1);
}

static PyObject *store_frame(PyObject *self, PyObject *args) {
    PyObject *messages, *producer;
    unsigned long long sequence;
    if (!PyArg_ParseTuple(args, "O!UK", &PyList_Type, &messages, &producer, &sequence))
        return NULL;
    Py_ssize_t producer_n;
    const char *producer_s = PyUnicode_AsUTF8AndSize(producer, &producer_n);
    if (producer_s == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(messages);
    view stack[16];
    view *views = n <= 16 ? stack : PyMem_Malloc(sizeof(view) * (size_t)n);
    if (views == NULL)
        return PyErr_NoMemory();
    Py_ssize_t read = 0, inner = 0;
    PyObject *out = NULL;
    for (; read < n; read++) {
        int ok = read_view(PyList_GET_ITEM(messages, read), &views[read]);
        if (ok <= 0) {
            if (ok == 0)
                PyErr_Format(PyExc_ValueError, "message %zd is not one to encode here", read);
            read++;
            goto done;
        }
        inner += field_len(views[read].size);
    }
    inner += 2; /* sync = true */
    if (producer_n)
        inner += field_len(producer_n);
    if (sequence)
        inner += 1 + varint_len(sequence);
    out = PyBytes_FromStringAndSize(NULL, field_len(inner));
    if (out == NULL)
        goto done;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    *p++ = STORE_STREAM_REQUEST_BATCH_TAG;
    p = put_varint(p, (uint64_t)inner);
    for (Py_ssize_t i = 0; i < n; i++) {
        *p++ = STORE_BATCH_REQUEST_MESSAGES_TAG;
        p = put_varint(p, (uint64_t)views[i].size);
        p = put_message(p, &views[i]);
    }
    *p++ = STORE_BATCH_REQUEST_SYNC_TAG;
    *p++ = 0x01; /* true */
    if (producer_n)
        p = put_bytes(p, STORE_BATCH_REQUEST_PRODUCER_ID_TAG, producer_s, producer_n);
    if (sequence) {
        *p++ = STORE_BATCH_REQUEST_SEQUENCE_TAG;
        p = put_varint(p, sequence);
    }
done:
    for (Py_ssize_t i = 0; i < read; i++)
        release(&views[i]);
    if (views != stack)
        PyMem_Free(views);
    return out;
}

/* -- answers ---------------------------------------------------------------------------------------------------- */

typedef struct {
    const unsigned char *p, *end;
} cursor;

static int get_varint(cursor *c, uint64_t *out) {
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

static int get_len(cursor *c, cursor *body) {
    uint64_t n;
    if (get_varint(c, &n) < 0 || n > (uint64_t)(c->end - c->p))
        return -1;
    body->p = c->p;
    body->end = c->p + n;
    c->p += n;
    return 0;
}

/* One MessagePosition's timestamp_us (its shard is the batch's, checked by the caller's rules). */
static int position_timestamp(cursor body, uint64_t *ts) {
    *ts = 0;
    while (body.p < body.end) {
        uint64_t tag, value;
        if (get_varint(&body, &tag) < 0 || (tag & 7) != 0 || get_varint(&body, &value) < 0)
            return -1;
        if (tag == MESSAGE_POSITION_TIMESTAMP_US_TAG)
            *ts = value;
        else if (tag != MESSAGE_POSITION_SHARD_TAG)
            return -1;
    }
    return 0;
}

static PyObject *read_answer(PyObject *self, PyObject *arg) {
    Py_buffer buf;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    cursor c = {buf.buf, (const unsigned char *)buf.buf + buf.len};
    uint64_t sequence = 0;
    cursor result = {NULL, NULL};
    int seen_result = 0;
    PyObject *stamps = NULL, *out = NULL;
    while (c.p < c.end) {
        uint64_t tag;
        if (get_varint(&c, &tag) < 0)
            goto other;
        if (tag == STORE_STREAM_RESPONSE_SEQUENCE_TAG) {
            if (get_varint(&c, &sequence) < 0)
                goto other;
        } else if (tag == STORE_STREAM_RESPONSE_RESULT_TAG && !seen_result) {
            if (get_len(&c, &result) < 0)
                goto other;
            seen_result = 1;
        } else {
            goto other; /* a second result (protobuf merges them), or a field not expected */
        }
    }
    stamps = PyList_New(0);
    if (stamps == NULL)
        goto done;
    while (seen_result && result.p < result.end) {
        uint64_t tag, ts;
        cursor body;
        if (get_varint(&result, &tag) < 0 || tag != STORE_BATCH_RESPONSE_POSITIONS_TAG || get_len(&result, &body) < 0 ||
            position_timestamp(body, &ts) < 0)
            goto other; /* failures, message failures, or anything else: protobuf reads it */
        PyObject *value = PyLong_FromUnsignedLongLong(ts);
        if (value == NULL || PyList_Append(stamps, value) < 0) {
            Py_XDECREF(value);
            goto done;
        }
        Py_DECREF(value);
    }
    out = Py_BuildValue("(KO)", (unsigned long long)sequence, stamps);
    goto done;
other:
    out = Py_NewRef(Py_None);
done:
    Py_XDECREF(stamps);
    PyBuffer_Release(&buf);
    return out;
}

static PyMethodDef methods[] = {
    {"message_size", message_size, METH_O,
     "message_size(message) -> int: its wire size, or -1 when Python must check and encode it"},
    {"store_frame", store_frame, METH_VARARGS,
     "store_frame(messages, producer_id, sequence) -> bytes: a StoreStreamRequest of the messages"},
    {"read_answer", read_answer, METH_O,
     "read_answer(data) -> (sequence, timestamps) for an answer that stored every message, else None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "mqds.client.core._store_frames", "Pipelined writes in C (see mqds.client.core.store_frames).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__store_frames(void) {
    if (!(s_topic = PyUnicode_InternFromString("topic")) || !(s_payload = PyUnicode_InternFromString("payload")) ||
        !(s_sender = PyUnicode_InternFromString("sender")) || !(s_qos = PyUnicode_InternFromString("qos")) ||
        !(s_retain = PyUnicode_InternFromString("retain")) ||
        !(s_properties = PyUnicode_InternFromString("properties")) ||
        !(s_message_expiry_s = PyUnicode_InternFromString("message_expiry_s")))
        return NULL;
    return PyModule_Create(&module);
}
