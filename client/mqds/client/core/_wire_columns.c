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
 * columns(answers, want) -> tuple of 16 items (None for a column not wanted)
 *   answers: a list of serialized NextResponses; their messages, in order, are the rows
 *   want:    a bit mask of the columns to build (the WANT_* values below, which
 *            mqds.client.core.wire_columns gives Python)
 *   (n, topic_offsets, topic_data, payload_offsets, payload_data, sender_offsets, sender_data,
 *    qos, retain, property_offsets, key_offsets, key_data, value_offsets, value_data, timestamps,
 *    skipped)
 *   Each *_offsets is n + 1 int32 values (Arrow's string / binary layout); qos is n int32;
 *   retain is a bitmap of n bits (Arrow's boolean layout); property_offsets is n + 1 int32
 *   offsets into the key / value arrays (Arrow's map layout); timestamps is n int64 (Message
 *   field 7). All in the machine's byte order, as Arrow's buffers are.
 *   User properties follow mqds.spark's map: a name given twice keeps its first place and its
 *   last value.
 *   skipped: the messages that are not rows because protobuf could not parse them (a value
 *   running past the message's end, a bad wire type, a string that is not UTF-8): one damaged
 *   message costs its row, never the answer. n counts the others.
 *
 * A field read as protobuf reads it: one of a known number but of another wire type is an
 * unknown field, skipped (the field keeps what it had), like any field the reader does not know.
 * Strings are checked as UTF-8 as protobuf checks them (once, when the columns are sized), so a
 * caller need not validate them again.
 *
 * Both raise ValueError for bytes whose framing is not such an answer's (a message's length
 * past the answer's end, a truncated field between the messages) and OverflowError for columns
 * past Arrow's 2 GiB int32 offsets; neither reads outside the buffers.
 *
 * Fields are told by their tags, named in wire_tags.h (proto/generate.py writes it from the descriptors).
 *
 * The same values as parsing with protobuf and reading the fields
 * (tests/client/test_wire_columns.py checks them against each other with hypothesis).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wire_tags.h"

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

static inline int read_len(cursor *c, span *out) {
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

/* Groups nested deeper than this are refused, as protobuf refuses messages nested deeper. */
#define MAX_GROUP_DEPTH 100

/* Rare (no node writes a group): kept out of line, so the common fields' skip stays small. */
#if defined(__GNUC__)
__attribute__((noinline))
#endif
static int skip_group(cursor *c, uint64_t field, int depth);

/* Skip a field numbered `field` of wire type `wire` whose tag was read. */
static int skip_field(cursor *c, uint64_t field, unsigned wire) {
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
    case 3:
        return skip_group(c, field, 1);
    case 5:
        if (c->end - c->p < 4)
            return bad("a fixed32 runs past the end");
        c->p += 4;
        return 0;
    default:
        return bad("an unsupported wire type");
    }
}

/* Skip a group's fields up to its end-group tag (protobuf keeps such a field as an unknown one). */
static int skip_group(cursor *c, uint64_t field, int depth) {
    if (depth > MAX_GROUP_DEPTH)
        return bad("groups nested too deep");
    while (c->p < c->end) {
        uint64_t tag;
        if (read_tag(c, &tag) < 0)
            return -1;
        unsigned wire = (unsigned)(tag & 7);
        if ((tag >> 3) == 0)
            return bad("field number 0");
        if (wire == 4)
            return (tag >> 3) == field ? 0 : bad("a group ends with another field's number");
        if (wire == 3 ? skip_group(c, tag >> 3, depth + 1) < 0 : skip_field(c, tag >> 3, wire) < 0)
            return -1;
    }
    return bad("a group runs past the end");
}

/* Whether `s` is ASCII: eight bytes at a time (the last eight overlapping), no branch per byte. */
static inline int is_ascii(span s) {
    uint64_t high = 0, word;
    if (s.n >= 8) {
        for (Py_ssize_t i = 0; i + 8 <= s.n; i += 8) {
            memcpy(&word, s.p + i, 8);
            high |= word;
        }
        memcpy(&word, s.p + s.n - 8, 8);
        high |= word;
    } else {
        for (Py_ssize_t i = 0; i < s.n; i++)
            high |= s.p[i];
    }
    return !(high & 0x8080808080808080ULL);
}

/* Whether `s` is UTF-8, as protobuf checks a string field: no overlong forms, no surrogates,
 * nothing past U+10FFFF. Most strings are ASCII, told without decoding. */
static int is_utf8(span s) {
    if (is_ascii(s))
        return 1;
    const unsigned char *p = s.p, *end = s.p + s.n;
    while (p < end) {
        unsigned char b = *p;
        if (b < 0x80) {
            p++;
            continue;
        }
        int size;
        uint32_t code;
        if (b >= 0xC2 && b <= 0xDF)
            size = 2, code = b & 0x1F;
        else if (b >= 0xE0 && b <= 0xEF)
            size = 3, code = b & 0x0F;
        else if (b >= 0xF0 && b <= 0xF4)
            size = 4, code = b & 0x07;
        else
            return 0;
        if (end - p < size)
            return 0;
        for (int k = 1; k < size; k++) {
            if ((p[k] & 0xC0) != 0x80)
                return 0;
            code = (code << 6) | (p[k] & 0x3F);
        }
        if ((size == 3 && (code < 0x800 || (code >= 0xD800 && code <= 0xDFFF))) ||
            (size == 4 && (code < 0x10000 || code > 0x10FFFF)))
            return 0;
        p += size;
    }
    return 1;
}

/* The next length-delimited field whose tag is `want` after the cursor, in a buffer whose framing was
 * already checked: 1 and its content in `out`, or 0 at the end. */
static int next_len_field(cursor *c, uint64_t want, span *out) {
    while (c->p < c->end) {
        uint64_t tag = 0;
        read_varint(c, &tag);
        if (tag == want) {
            read_len(c, out);
            return 1;
        }
        skip_field(c, tag >> 3, (unsigned)(tag & 7));
    }
    return 0;
}

/* One Message's fields. Properties are not kept here: they are walked again when written. */
typedef struct {
    span topic, payload, sender;
    uint64_t qos, retain, timestamp;
    Py_ssize_t n_properties;
} message;

/* The key and value of one UserProperty (with `check`, each occurrence of either checked as UTF-8). */
static int read_property(span body, span *key, span *value, int check) {
    cursor c = {body.p, body.p + body.n};
    key->p = value->p = body.p;
    key->n = value->n = 0;
    while (c.p < c.end) {
        uint64_t tag = 0;
        if (read_tag(&c, &tag) < 0)
            return -1;
        uint64_t field = tag >> 3;
        unsigned wire = (unsigned)(tag & 7);
        if (field == 0)
            return bad("field number 0");
        if (tag == USER_PROPERTY_KEY_TAG || tag == USER_PROPERTY_VALUE_TAG) {
            span *s = tag == USER_PROPERTY_KEY_TAG ? key : value;
            if (read_len(&c, s) < 0)
                return -1;
            if (check && !is_utf8(*s))
                return bad("a user property is not UTF-8");
        } else if (skip_field(&c, field, wire) < 0) {
            return -1;
        }
    }
    return 0;
}

/* One message's fields, read as protobuf reads them. With `check`, also what protobuf checks that a
 * read does not need (strings as UTF-8, the user properties' bodies): -1 (a ValueError set) for a
 * message protobuf could not parse, the caller's cue to skip its row. Without it, for a message
 * checked before: its fields, the user properties only counted. */
static int read_message(span body, message *m, int check) {
    cursor c = {body.p, body.p + body.n};
    memset(m, 0, sizeof(*m));
    m->topic.p = m->payload.p = m->sender.p = body.p;
    while (c.p < c.end) {
        uint64_t tag = 0;
        if (read_tag(&c, &tag) < 0)
            return -1;
        span s, key, value;
        int r;
        switch (tag) {
        case MESSAGE_TOPIC_TAG:
        case MESSAGE_SENDER_TAG:
            r = read_len(&c, tag == MESSAGE_TOPIC_TAG ? &m->topic : &m->sender);
            if (check && r == 0 && !is_utf8(tag == MESSAGE_TOPIC_TAG ? m->topic : m->sender))
                return bad("a message's topic or sender is not UTF-8");
            break;
        case MESSAGE_PAYLOAD_TAG:
            r = read_len(&c, &m->payload);
            break;
        case MESSAGE_QOS_TAG:
        case MESSAGE_RETAIN_TAG:
            r = read_varint(&c, tag == MESSAGE_QOS_TAG ? &m->qos : &m->retain);
            break;
        case MESSAGE_PROPERTIES_TAG:
            r = read_len(&c, &s);
            if (check && r == 0)
                r = read_property(s, &key, &value, 1);
            m->n_properties++;
            break;
        case MESSAGE_TIMESTAMP_US_TAG:
            if (c.end - c.p < 8)
                return bad("a fixed64 runs past the end");
            m->timestamp = 0;
            for (int i = 7; i >= 0; i--) /* fixed64 is little-endian on the wire */
                m->timestamp = (m->timestamp << 8) | c.p[i];
            c.p += 8;
            r = 0;
            break;
        default:
            /* Not a field the reader reads, or one of another wire type: an unknown field to protobuf. */
            if ((tag >> 3) == 0)
                return bad("field number 0");
            r = skip_field(&c, tag >> 3, (unsigned)(tag & 7));
        }
        if (r < 0)
            return -1;
    }
    return 0;
}

/* Calls `each(ctx, body)` for every message (NextResponse.messages); other fields skipped. */
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
        if (tag == NEXT_RESPONSE_MESSAGES_TAG) {
            if (read_len(&c, &s) < 0 || each(ctx, s) < 0)
                return -1;
        } else if (skip_field(&c, field, wire) < 0) { /* of another wire type: an unknown field, as in protobuf */
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
        if (tag == NEXT_RESPONSE_MESSAGES_TAG || tag == NEXT_RESPONSE_ITERATOR_TAG || tag == NEXT_RESPONSE_TIMESTAMPS_TAG) {
            if (read_len(&c, &s) < 0)
                goto done;
            if (tag == NEXT_RESPONSE_MESSAGES_TAG)
                count++;
            else if (tag == NEXT_RESPONSE_ITERATOR_TAG)
                iterator_len += s.n;
            else
                stamps = s;
        } else if (tag == NEXT_RESPONSE_END_OF_STREAM_TAG || tag == NEXT_RESPONSE_STREAMS_DONE_TAG) {
            if (read_varint(&c, tag == NEXT_RESPONSE_END_OF_STREAM_TAG ? &end_of_stream : &streams_done) < 0)
                goto done;
        } else if (skip_field(&c, field, wire) < 0) { /* another wire type too: an unknown field */
            goto done;
        }
    }
    iterator = PyBytes_FromStringAndSize(NULL, iterator_len);
    if (iterator == NULL)
        goto done;
    if (iterator_len) {
        /* Second pass: join the iterator's occurrences (the framing was checked above). */
        char *out = PyBytes_AS_STRING(iterator);
        span s = {NULL, 0};
        c.p = (const unsigned char *)view.buf;
        while (next_len_field(&c, NEXT_RESPONSE_ITERATOR_TAG, &s)) {
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

/* The messages that are no row (protobuf could not parse them), by their place among the answers'
 * messages: found when the columns are sized, skipped when they are filled without checking again. */
typedef struct {
    Py_ssize_t *at;
    Py_ssize_t n, cap;
} skips;

typedef struct {
    int want;
    Py_ssize_t n, seen;
    skips skipped;
    Py_ssize_t topic_bytes, payload_bytes, sender_bytes, n_properties, key_bytes, value_bytes;
} sizes;

static int size_one(void *ctx, span body) {
    sizes *z = ctx;
    message m;
    Py_ssize_t place = z->seen++;
    if (read_message(body, &m, 1) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_ValueError))
            return -1;
        PyErr_Clear(); /* no row: the others are read */
        skips *k = &z->skipped;
        if (k->n == k->cap) {
            Py_ssize_t cap = k->cap ? 2 * k->cap : 16;
            Py_ssize_t *grown = realloc(k->at, (size_t)cap * sizeof(Py_ssize_t));
            if (grown == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            k->at = grown;
            k->cap = cap;
        }
        k->at[k->n++] = place;
        return 0;
    }
    z->n++;
    z->topic_bytes += m.topic.n;
    z->payload_bytes += m.payload.n;
    z->sender_bytes += m.sender.n;
    if (m.n_properties && (z->want & WANT_PROPERTIES)) {
        /* An upper bound: a name given twice is counted each time. */
        cursor c = {body.p, body.p + body.n};
        span s, key, value;
        while (next_len_field(&c, MESSAGE_PROPERTIES_TAG, &s)) {
            read_property(s, &key, &value, 0); /* checked by read_message */
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
    Py_ssize_t row, seen, skip;
    const skips *skipped;
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
    while (next_len_field(&c, MESSAGE_PROPERTIES_TAG, &s)) {
        read_property(s, &f->pairs[2 * k], &f->pairs[2 * k + 1], 0); /* checked when sized */
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
    Py_ssize_t place = f->seen++;
    if (f->skip < f->skipped->n && f->skipped->at[f->skip] == place) {
        f->skip++;
        return 0;
    }
    read_message(body, &m, 0); /* checked when sized */
    Py_ssize_t row = f->row++;
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
    sizes z;
    memset(&z, 0, sizeof(z));
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
    f.skipped = &z.skipped;
    for (Py_ssize_t i = 0; i < n_answers; i++) {
        span answer = {views[i].buf, views[i].len};
        if (walk_answer(answer, fill_one, &f) < 0)
            goto done;
    }
    result = PyTuple_New(N_OUT + 2);
    if (result == NULL)
        goto done;
    PyTuple_SET_ITEM(result, 0, PyLong_FromSsize_t(z.n));
    PyTuple_SET_ITEM(result, N_OUT + 1, PyLong_FromSsize_t(z.skipped.n));
    if (PyTuple_GET_ITEM(result, 0) == NULL || PyTuple_GET_ITEM(result, N_OUT + 1) == NULL) {
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
    free(z.skipped.at);
    Py_XDECREF(held);
    return result;
}

static PyMethodDef methods[] = {
    {"envelope", envelope, METH_O,
     "envelope(answer) -> (count, iterator, end_of_stream, timestamps, streams_done): a NextResponse without its "
     "messages"},
    {"columns", columns, METH_VARARGS,
     "columns(answers, want) -> (n, topic_offsets, topic_data, ..., timestamps, skipped): the answers' messages as "
     "Arrow buffers"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "mqds.client.core._wire_columns", "Next answers read in C (see mqds.client.core.wire_columns).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__wire_columns(void) {
    return PyModule_Create(&module);
}
