/* Next answers read in C: their envelope without the messages, and the messages as columns.
 *
 * envelope(answer) -> (count, iterator, end_of_stream, timestamps, streams_done)
 *   answer:     a serialized mqds.v1.NextResponse (any bytes-like object)
 *   count:      how many messages (field 1) it holds; each one's framing is checked
 *   iterator:   the serialized IteratorToken (field 2; every occurrence joined, which is
 *               protobuf's merge of a message field given twice), b"" when absent
 *   end_of_stream, timestamps, streams_done: fields 3, 4 and 5 (the last occurrence wins, as in
 *               protobuf; streams_done keeps its low 32 bits, a uint32)
 *
 * columns(answers, want) -> tuple of 15 items (None for a column not wanted)
 *   answers: a list of serialized NextResponses; their messages, in order, are the rows
 *   want:    a bit mask of the columns to build (the WANT_* values below, which
 *            mqds.client.wire_columns gives Python)
 *   (n, topic_offsets, topic_data, payload_offsets, payload_data, sender_offsets, sender_data,
 *    qos, retain, property_offsets, key_offsets, key_data, value_offsets, value_data, timestamps)
 *   Each *_offsets is n + 1 int32 values (Arrow's string / binary layout); qos is n int32;
 *   retain is a bitmap of n bits (Arrow's boolean layout); property_offsets is n + 1 int32
 *   offsets into the key / value arrays (Arrow's map layout); timestamps is n int64 (Message
 *   field 7). All in the machine's byte order, as Arrow's buffers are.
 *   User properties follow mqds.spark's map: a name given twice keeps its first place and its
 *   last value.
 *
 * Both raise ValueError for bytes that are not such a message (truncated, a bad wire type, a
 * length past the end) and OverflowError for columns past Arrow's 2 GiB int32 offsets; neither
 * reads outside the buffers. Strings are not checked for UTF-8 here: the caller validates
 * (pyarrow's full validation), so a damaged answer is refused, not passed on.
 *
 * The same values as parsing with protobuf and reading the fields
 * (tests/unit/test_wire_columns.py checks them against each other with hypothesis).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum {
    WANT_TOPIC = 1,
    WANT_PAYLOAD = 2,
    WANT_SENDER = 4,
    WANT_QOS = 8,
    WANT_RETAIN = 16,
    WANT_PROPERTIES = 32,
    WANT_TIMESTAMP = 64,
};

typedef struct {
    const unsigned char *p;
    const unsigned char *end;
} cursor;

typedef struct {
    const unsigned char *p;
    Py_ssize_t n;
} span;

static int bad(const char *what) {
    PyErr_Format(PyExc_ValueError, "malformed Next answer: %s", what);
    return -1;
}

static int read_varint(cursor *c, uint64_t *out) {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (c->p >= c->end)
            return bad("a varint runs past the end");
        unsigned char b = *c->p++;
        v |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return bad("a varint is longer than 10 bytes");
}

/* A field's tag: its number (1 to 2^29 - 1, as protobuf allows; 0 is refused where it is read) and wire type. */
static int read_tag(cursor *c, uint64_t *tag) {
    if (read_varint(c, tag) < 0)
        return -1;
    if ((*tag >> 3) > 0x1FFFFFFF)
        return bad("a field number past 2^29 - 1");
    return 0;
}

static int read_len(cursor *c, span *out) {
    uint64_t n;
    if (read_varint(c, &n) < 0)
        return -1;
    if (n > (uint64_t)(c->end - c->p))
        return bad("a length runs past the end");
    out->p = c->p;
    out->n = (Py_ssize_t)n;
    c->p += n;
    return 0;
}

/* Skip a field of wire type `wire` whose tag was read. */
static int skip_field(cursor *c, unsigned wire) {
    uint64_t ignored;
    span s;
    switch (wire) {
    case 0:
        return read_varint(c, &ignored);
    case 1:
        if (c->end - c->p < 8)
            return bad("a fixed64 runs past the end");
        c->p += 8;
        return 0;
    case 2:
        return read_len(c, &s);
    case 5:
        if (c->end - c->p < 4)
            return bad("a fixed32 runs past the end");
        c->p += 4;
        return 0;
    default:
        return bad("an unsupported wire type");
    }
}

/* The next length-delimited field numbered `field` after the cursor, in a buffer whose framing was
 * already checked: 1 and its content in `out`, or 0 at the end. */
static int next_len_field(cursor *c, unsigned field, span *out) {
    while (c->p < c->end) {
        uint64_t tag = 0;
        read_varint(c, &tag);
        if ((tag >> 3) == field && (tag & 7) == 2) {
            read_len(c, out);
            return 1;
        }
        skip_field(c, (unsigned)(tag & 7));
    }
    return 0;
}

/* One Message's fields. Properties are not kept here: they are walked again when written. */
typedef struct {
    span topic, payload, sender;
    uint64_t qos, retain, timestamp;
    Py_ssize_t n_properties;
} message;

/* The key and value of one UserProperty. */
static int read_property(span body, span *key, span *value) {
    cursor c = {body.p, body.p + body.n};
    key->p = value->p = body.p;
    key->n = value->n = 0;
    while (c.p < c.end) {
        uint64_t tag = 0;
        if (read_tag(&c, &tag) < 0)
            return -1;
        unsigned field = (unsigned)(tag >> 3), wire = (unsigned)(tag & 7);
        if ((field == 1 || field == 2) && wire == 2) {
            if (read_len(&c, field == 1 ? key : value) < 0)
                return -1;
        } else if (field == 1 || field == 2 || field == 0) {
            return bad("a user property field has the wrong wire type");
        } else if (skip_field(&c, wire) < 0) {
            return -1;
        }
    }
    return 0;
}

static int read_message(span body, message *m) {
    cursor c = {body.p, body.p + body.n};
    memset(m, 0, sizeof(*m));
    m->topic.p = m->payload.p = m->sender.p = body.p;
    while (c.p < c.end) {
        uint64_t tag = 0;
        if (read_tag(&c, &tag) < 0)
            return -1;
        unsigned field = (unsigned)(tag >> 3), wire = (unsigned)(tag & 7);
        span s;
        int r;
        switch (field) {
        case 1:
        case 2:
        case 3:
            if (wire != 2)
                return bad("a message's topic, payload or sender has the wrong wire type");
            r = read_len(&c, field == 1 ? &m->topic : field == 2 ? &m->payload : &m->sender);
            break;
        case 4:
        case 5:
            if (wire != 0)
                return bad("a message's qos or retain has the wrong wire type");
            r = read_varint(&c, field == 4 ? &m->qos : &m->retain);
            break;
        case 6:
            if (wire != 2)
                return bad("a message's user property has the wrong wire type");
            r = read_len(&c, &s);
            m->n_properties++;
            break;
        case 7:
            if (wire != 1)
                return bad("a message's timestamp has the wrong wire type");
            if (c.end - c.p < 8)
                return bad("a fixed64 runs past the end");
            m->timestamp = 0;
            for (int i = 7; i >= 0; i--) /* fixed64 is little-endian on the wire */
                m->timestamp = (m->timestamp << 8) | c.p[i];
            c.p += 8;
            r = 0;
            break;
        case 0:
            return bad("field number 0");
        default:
            r = skip_field(&c, wire);
        }
        if (r < 0)
            return -1;
    }
    return 0;
}

/* Calls `each(ctx, body)` for every message (field 1) of a NextResponse; other fields skipped. */
typedef int (*message_fn)(void *ctx, span body);

static int walk_answer(span answer, message_fn each, void *ctx) {
    cursor c = {answer.p, answer.p + answer.n};
    while (c.p < c.end) {
        uint64_t tag = 0;
        span s;
        if (read_tag(&c, &tag) < 0)
            return -1;
        unsigned field = (unsigned)(tag >> 3), wire = (unsigned)(tag & 7);
        if (field == 0)
            return bad("field number 0");
        if (field == 1) {
            if (wire != 2)
                return bad("a message has the wrong wire type");
            if (read_len(&c, &s) < 0 || each(ctx, s) < 0)
                return -1;
        } else if (skip_field(&c, wire) < 0) {
            return -1;
        }
    }
    return 0;
}

/* ---- envelope -------------------------------------------------------------------------- */

static PyObject *envelope(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    cursor c = {(const unsigned char *)view.buf, (const unsigned char *)view.buf + view.len};
    Py_ssize_t count = 0, iterator_len = 0;
    uint64_t end_of_stream = 0, streams_done = 0;
    span stamps = {c.p, 0};
    PyObject *iterator = NULL, *result = NULL;
    /* First pass: count, check the framing, size the iterator. */
    while (c.p < c.end) {
        uint64_t tag = 0;
        span s;
        if (read_tag(&c, &tag) < 0)
            goto done;
        unsigned field = (unsigned)(tag >> 3), wire = (unsigned)(tag & 7);
        if (field == 0) {
            bad("field number 0");
            goto done;
        }
        if (field == 1 || field == 2 || field == 4) {
            if (wire != 2) {
                bad("a message, iterator or timestamps field has the wrong wire type");
                goto done;
            }
            if (read_len(&c, &s) < 0)
                goto done;
            if (field == 1)
                count++;
            else if (field == 2)
                iterator_len += s.n;
            else
                stamps = s;
        } else if (field == 3 || field == 5) {
            if (wire != 0) {
                bad("end_of_stream or streams_done has the wrong wire type");
                goto done;
            }
            if (read_varint(&c, field == 3 ? &end_of_stream : &streams_done) < 0)
                goto done;
        } else if (skip_field(&c, wire) < 0) {
            goto done;
        }
    }
    iterator = PyBytes_FromStringAndSize(NULL, iterator_len);
    if (iterator == NULL)
        goto done;
    if (iterator_len) {
        /* Second pass: join the iterator's occurrences (the framing was checked above). */
        char *out = PyBytes_AS_STRING(iterator);
        span s;
        c.p = (const unsigned char *)view.buf;
        while (next_len_field(&c, 2, &s)) {
            memcpy(out, s.p, (size_t)s.n);
            out += s.n;
        }
    }
    result = Py_BuildValue("nOOy#k", count, iterator, end_of_stream ? Py_True : Py_False, (const char *)stamps.p,
                           stamps.n, (unsigned long)(uint32_t)streams_done);
done:
    Py_XDECREF(iterator);
    PyBuffer_Release(&view);
    return result;
}

/* ---- columns --------------------------------------------------------------------------- */

typedef struct {
    int want;
    Py_ssize_t n;
    Py_ssize_t topic_bytes, payload_bytes, sender_bytes, n_properties, key_bytes, value_bytes;
} sizes;

static int size_one(void *ctx, span body) {
    sizes *z = ctx;
    message m;
    if (read_message(body, &m) < 0)
        return -1;
    z->n++;
    z->topic_bytes += m.topic.n;
    z->payload_bytes += m.payload.n;
    z->sender_bytes += m.sender.n;
    if (m.n_properties && (z->want & WANT_PROPERTIES)) {
        /* An upper bound: a name given twice is counted each time. */
        cursor c = {body.p, body.p + body.n};
        span s, key, value;
        while (next_len_field(&c, 6, &s)) {
            if (read_property(s, &key, &value) < 0)
                return -1;
            z->n_properties++;
            z->key_bytes += key.n;
            z->value_bytes += value.n;
        }
    }
    return 0;
}

typedef struct {
    char *data;
    int32_t *offsets;
    int32_t at;
} strings;

static void put_string(strings *s, Py_ssize_t row, span v) {
    memcpy(s->data + s->at, v.p, (size_t)v.n);
    s->at += (int32_t)v.n;
    s->offsets[row + 1] = s->at;
}

typedef struct {
    int want;
    Py_ssize_t row;
    strings topic, payload, sender, key, value;
    int32_t *qos;
    unsigned char *retain;
    int32_t *property_offsets;
    int32_t n_properties;
    int64_t *timestamps;
    span *pairs; /* one message's properties: key, value, key, value, ... */
    Py_ssize_t pairs_cap;
} filling;

static int put_properties(filling *f, span body, Py_ssize_t count) {
    if (count * 2 > f->pairs_cap) {
        span *grown = realloc(f->pairs, (size_t)count * 2 * sizeof(span));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        f->pairs = grown;
        f->pairs_cap = count * 2;
    }
    Py_ssize_t k = 0;
    cursor c = {body.p, body.p + body.n};
    span s;
    while (next_len_field(&c, 6, &s)) {
        read_property(s, &f->pairs[2 * k], &f->pairs[2 * k + 1]); /* checked when sized */
        k++;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        span key = f->pairs[2 * i], value = f->pairs[2 * i + 1];
        int seen = 0;
        for (Py_ssize_t j = 0; j < i && !seen; j++)
            seen = f->pairs[2 * j].n == key.n && memcmp(f->pairs[2 * j].p, key.p, (size_t)key.n) == 0;
        if (seen)
            continue; /* written at its first place, with its last value */
        for (Py_ssize_t j = i + 1; j < k; j++)
            if (f->pairs[2 * j].n == key.n && memcmp(f->pairs[2 * j].p, key.p, (size_t)key.n) == 0)
                value = f->pairs[2 * j + 1];
        put_string(&f->key, f->n_properties, key);
        put_string(&f->value, f->n_properties, value);
        f->n_properties++;
    }
    return 0;
}

static int fill_one(void *ctx, span body) {
    filling *f = ctx;
    message m;
    Py_ssize_t row = f->row++;
    read_message(body, &m); /* checked when sized */
    if (f->want & WANT_TOPIC)
        put_string(&f->topic, row, m.topic);
    if (f->want & WANT_PAYLOAD)
        put_string(&f->payload, row, m.payload);
    if (f->want & WANT_SENDER)
        put_string(&f->sender, row, m.sender);
    if (f->want & WANT_QOS)
        f->qos[row] = (int32_t)(uint32_t)m.qos; /* a uint32 field: protobuf keeps its low 32 bits */
    if ((f->want & WANT_RETAIN) && m.retain)
        f->retain[row >> 3] |= (unsigned char)(1u << (row & 7));
    if (f->want & WANT_TIMESTAMP)
        f->timestamps[row] = (int64_t)m.timestamp;
    if (f->want & WANT_PROPERTIES) {
        if (m.n_properties && put_properties(f, body, m.n_properties) < 0)
            return -1;
        f->property_offsets[row + 1] = f->n_properties;
    }
    return 0;
}

/* A new bytes object of `size` bytes, zeroed (Arrow wants defined padding and a clear bitmap). */
static PyObject *zeroed(Py_ssize_t size) {
    PyObject *b = PyBytes_FromStringAndSize(NULL, size);
    if (b != NULL)
        memset(PyBytes_AS_STRING(b), 0, (size_t)size);
    return b;
}

static PyObject *columns(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *answers, *held = NULL, *result = NULL;
    int want;
    enum { N_OUT = 14 };
    PyObject *out[N_OUT] = {NULL};
    Py_buffer *views = NULL;
    Py_ssize_t n_views = 0;
    filling f;
    memset(&f, 0, sizeof(f));
    if (!PyArg_ParseTuple(args, "O!i:columns", &PyList_Type, &answers, &want))
        return NULL;
    held = PyList_AsTuple(answers); /* the list may change meanwhile; this tuple does not */
    if (held == NULL)
        return NULL;
    Py_ssize_t n_answers = PyTuple_GET_SIZE(held);
    views = PyMem_Calloc((size_t)(n_answers ? n_answers : 1), sizeof(Py_buffer));
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; n_views < n_answers; n_views++)
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(held, n_views), &views[n_views], PyBUF_SIMPLE) < 0)
            goto done;
    sizes z;
    memset(&z, 0, sizeof(z));
    z.want = want;
    for (Py_ssize_t i = 0; i < n_answers; i++) {
        span answer = {views[i].buf, views[i].len};
        if (walk_answer(answer, size_one, &z) < 0)
            goto done;
    }
    if (z.topic_bytes > INT32_MAX || z.payload_bytes > INT32_MAX || z.sender_bytes > INT32_MAX ||
        z.key_bytes > INT32_MAX || z.value_bytes > INT32_MAX || z.n_properties > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "the answers' columns exceed Arrow's 2 GiB int32 offsets");
        goto done;
    }
    Py_ssize_t offsets_size = (z.n + 1) * (Py_ssize_t)sizeof(int32_t);
    struct {
        int bit;
        strings *s;
        Py_ssize_t bytes;
        int slot;
    } text[] = {
        {WANT_TOPIC, &f.topic, z.topic_bytes, 0},
        {WANT_PAYLOAD, &f.payload, z.payload_bytes, 2},
        {WANT_SENDER, &f.sender, z.sender_bytes, 4},
    };
    for (size_t i = 0; i < sizeof(text) / sizeof(text[0]); i++) {
        if (!(want & text[i].bit))
            continue;
        if ((out[text[i].slot] = zeroed(offsets_size)) == NULL || (out[text[i].slot + 1] = zeroed(text[i].bytes)) == NULL)
            goto done;
        text[i].s->offsets = (int32_t *)PyBytes_AS_STRING(out[text[i].slot]);
        text[i].s->data = PyBytes_AS_STRING(out[text[i].slot + 1]);
    }
    if (want & WANT_QOS) {
        if ((out[6] = zeroed(z.n * (Py_ssize_t)sizeof(int32_t))) == NULL)
            goto done;
        f.qos = (int32_t *)PyBytes_AS_STRING(out[6]);
    }
    if (want & WANT_RETAIN) {
        if ((out[7] = zeroed((z.n + 7) / 8)) == NULL)
            goto done;
        f.retain = (unsigned char *)PyBytes_AS_STRING(out[7]);
    }
    if (want & WANT_PROPERTIES) {
        Py_ssize_t entries = (z.n_properties + 1) * (Py_ssize_t)sizeof(int32_t);
        if ((out[8] = zeroed(offsets_size)) == NULL || (out[9] = zeroed(entries)) == NULL ||
            (out[10] = zeroed(z.key_bytes)) == NULL || (out[11] = zeroed(entries)) == NULL ||
            (out[12] = zeroed(z.value_bytes)) == NULL)
            goto done;
        f.property_offsets = (int32_t *)PyBytes_AS_STRING(out[8]);
        f.key.offsets = (int32_t *)PyBytes_AS_STRING(out[9]);
        f.key.data = PyBytes_AS_STRING(out[10]);
        f.value.offsets = (int32_t *)PyBytes_AS_STRING(out[11]);
        f.value.data = PyBytes_AS_STRING(out[12]);
    }
    if (want & WANT_TIMESTAMP) {
        if ((out[13] = zeroed(z.n * (Py_ssize_t)sizeof(int64_t))) == NULL)
            goto done;
        f.timestamps = (int64_t *)PyBytes_AS_STRING(out[13]);
    }
    f.want = want;
    for (Py_ssize_t i = 0; i < n_answers; i++) {
        span answer = {views[i].buf, views[i].len};
        if (walk_answer(answer, fill_one, &f) < 0)
            goto done;
    }
    result = PyTuple_New(N_OUT + 1);
    if (result == NULL)
        goto done;
    PyTuple_SET_ITEM(result, 0, PyLong_FromSsize_t(z.n));
    if (PyTuple_GET_ITEM(result, 0) == NULL) {
        Py_CLEAR(result);
        goto done;
    }
    for (int i = 0; i < N_OUT; i++) {
        PyObject *item = out[i] ? out[i] : Py_None;
        Py_INCREF(item);
        PyTuple_SET_ITEM(result, i + 1, item);
    }
done:
    for (int i = 0; i < N_OUT; i++)
        Py_XDECREF(out[i]);
    for (Py_ssize_t i = 0; i < n_views; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    free(f.pairs);
    Py_XDECREF(held);
    return result;
}

static PyMethodDef methods[] = {
    {"envelope", envelope, METH_O,
     "envelope(answer) -> (count, iterator, end_of_stream, timestamps, streams_done): a NextResponse without its "
     "messages"},
    {"columns", columns, METH_VARARGS,
     "columns(answers, want) -> (n, topic_offsets, topic_data, ..., timestamps): the answers' messages as "
     "Arrow buffers"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "mqds.client._wire_columns", "Next answers read in C (see mqds.client.wire_columns).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__wire_columns(void) {
    return PyModule_Create(&module);
}
