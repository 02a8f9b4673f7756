/* The store path's per-message loop in C: mqds.server.storage.writes.put_batch_python without
 * Python bytecode per message.
 *
 * put_batch(put, handle, topics, values, first, routes) -> streams
 *   put:    the write batch's put (rocksdict WriteBatch.put), called as put(key, value, handle)
 *   handle: the generation's column family handle
 *   topics: a list of str, message i's topic
 *   values: a list of bytes, message i's stored bytes (as long as topics)
 *   first:  message i's timestamp is first + i (first + len - 1 must fit in 64 bits)
 *   routes: a dict topic -> (data key prefix: bytes, index key prefixes: tuple of bytes, stream: int);
 *           every topic must be in it (the caller learns new topics first)
 * streams: the streams of the messages, each once, in the order they first appear
 *
 * It puts, in this order:
 * - for each message i: data prefix + u64 big-endian (first + i) -> values[i];
 * - for each index key prefix, in the order it first appears (messages in order, a route's
 *   prefixes in order): prefix + u64 big-endian (timestamp of its first message) -> its posting
 *   list: b"" for one message, else version 1, the first position (u32 little-endian), every
 *   position (u32 little-endian each); positions count from the batch's first message.
 *
 * Exactly the calls of the Python implementation (tests/server/storage/test_store_native.py checks them
 * against each other). It calls put, Python code, so it holds the GIL, reads the topics and
 * values from tuples it took first, and uses nothing of a route (borrowed from the dict) after
 * the put that follows its lookup: a put cannot change or free what it reads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define POSTINGS_V1 1

static void put_be64(char *out, uint64_t v) {
    for (int i = 7; i >= 0; i--) {
        out[i] = (char)(v & 0xFF);
        v >>= 8;
    }
}

static void put_le32(char *out, uint32_t v) {
    for (int i = 0; i < 4; i++) {
        out[i] = (char)(v & 0xFF);
        v >>= 8;
    }
}

/* prefix + u64 big-endian ts, as a new bytes object. */
static PyObject *stamped(PyObject *prefix, uint64_t ts) {
    Py_ssize_t n = PyBytes_GET_SIZE(prefix);
    PyObject *key = PyBytes_FromStringAndSize(NULL, n + 8);
    if (key == NULL)
        return NULL;
    char *out = PyBytes_AS_STRING(key);
    memcpy(out, PyBytes_AS_STRING(prefix), (size_t)n);
    put_be64(out + n, ts);
    return key;
}

static int call_put(PyObject *put, PyObject *key, PyObject *value, PyObject *handle) {
    PyObject *args[3] = {key, value, handle};
    PyObject *done = PyObject_Vectorcall(put, args, 3, NULL);
    if (done == NULL)
        return -1;
    Py_DECREF(done);
    return 0;
}

/* One index key prefix's messages: a chain of entries through `next`, head to tail. */
typedef struct {
    Py_ssize_t head, tail, count;
} Slot;

/* A message under one index key prefix. */
typedef struct {
    Py_ssize_t position; /* the message's place in the batch */
    Py_ssize_t next;     /* the next entry of the same slot, -1 at the end */
} Entry;

typedef struct {
    Entry *entries;
    Py_ssize_t used, size;
    Slot *slots;
    Py_ssize_t n_slots, slots_size;
} Postings;

/* Make room for `want` items in `*array` (of `*size`, each `item` bytes), doubling. */
static int grow(void **array, Py_ssize_t *size, Py_ssize_t want, size_t item) {
    if (want <= *size)
        return 0;
    Py_ssize_t bigger = *size ? *size * 2 : 64;
    while (bigger < want)
        bigger *= 2;
    void *moved = PyMem_Realloc(*array, (size_t)bigger * item);
    if (moved == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *array = moved;
    *size = bigger;
    return 0;
}

static int add_entry(Postings *p, Py_ssize_t slot, Py_ssize_t position) {
    if (grow((void **)&p->entries, &p->size, p->used + 1, sizeof(Entry)) < 0)
        return -1;
    Py_ssize_t e = p->used++;
    p->entries[e].position = position;
    p->entries[e].next = -1;
    Slot *s = &p->slots[slot];
    if (s->count == 0)
        s->head = e;
    else
        p->entries[s->tail].next = e;
    s->tail = e;
    s->count++;
    return 0;
}

/* The posting list of a slot with more than one message. */
static PyObject *encode_postings(const Postings *p, const Slot *s) {
    PyObject *value = PyBytes_FromStringAndSize(NULL, 5 + 4 * s->count);
    if (value == NULL)
        return NULL;
    char *out = PyBytes_AS_STRING(value);
    out[0] = POSTINGS_V1;
    put_le32(out + 1, (uint32_t)p->entries[s->head].position);
    out += 5;
    for (Py_ssize_t e = s->head; e >= 0; e = p->entries[e].next) {
        put_le32(out, (uint32_t)p->entries[e].position);
        out += 4;
    }
    return value;
}

static PyObject *put_batch(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *put, *handle, *topic_list, *value_list, *first_int, *routes;
    if (!PyArg_ParseTuple(args, "OOO!O!O!O!:put_batch", &put, &handle, &PyList_Type, &topic_list, &PyList_Type,
                          &value_list, &PyLong_Type, &first_int, &PyDict_Type, &routes))
        return NULL;
    unsigned long long first = PyLong_AsUnsignedLongLong(first_int); /* OverflowError if < 0 or >= 2**64 */
    if (first == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    PyObject *topics = PyList_AsTuple(topic_list);
    PyObject *values = topics == NULL ? NULL : PyList_AsTuple(value_list);
    PyObject *slots_of = PyDict_New();   /* index key prefix -> slot number */
    PyObject *seen_streams = PySet_New(NULL);
    PyObject *streams = PyList_New(0);
    PyObject *slot_prefixes = PyList_New(0); /* slot number -> its prefix */
    Postings p = {0};
    PyObject *result = NULL;
    if (values == NULL || slots_of == NULL || seen_streams == NULL || streams == NULL || slot_prefixes == NULL)
        goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(topics);
    if (PyTuple_GET_SIZE(values) != n) {
        PyErr_Format(PyExc_ValueError, "%zd topics but %zd values", n, PyTuple_GET_SIZE(values));
        goto done;
    }
    if (n > 0 && (first + (unsigned long long)(n - 1) < first || (unsigned long long)n > UINT32_MAX)) {
        PyErr_SetString(PyExc_OverflowError, "the batch's timestamps (or positions) do not fit");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *topic = PyTuple_GET_ITEM(topics, i), *value = PyTuple_GET_ITEM(values, i);
        if (!PyBytes_Check(value)) {
            PyErr_Format(PyExc_TypeError, "value %zd is not bytes", i);
            goto done;
        }
        PyObject *route = PyDict_GetItemWithError(routes, topic); /* borrowed */
        if (route == NULL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_KeyError, "topic %R has no route: learn it first", topic);
            goto done;
        }
        if (!PyTuple_Check(route) || PyTuple_GET_SIZE(route) != 3 || !PyBytes_Check(PyTuple_GET_ITEM(route, 0)) ||
            !PyTuple_Check(PyTuple_GET_ITEM(route, 1))) {
            PyErr_Format(PyExc_TypeError, "the route of %R is not (bytes, tuple of bytes, stream)", topic);
            goto done;
        }
        PyObject *stream = PyTuple_GET_ITEM(route, 2);
        int known = PySet_Contains(seen_streams, stream);
        if (known < 0 || (!known && (PySet_Add(seen_streams, stream) < 0 || PyList_Append(streams, stream) < 0)))
            goto done;
        PyObject *prefixes = PyTuple_GET_ITEM(route, 1);
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(prefixes); j++) {
            PyObject *prefix = PyTuple_GET_ITEM(prefixes, j);
            if (!PyBytes_Check(prefix)) {
                PyErr_Format(PyExc_TypeError, "the route of %R has an index key prefix that is not bytes", topic);
                goto done;
            }
            PyObject *known_slot = PyDict_GetItemWithError(slots_of, prefix);
            Py_ssize_t slot;
            if (known_slot != NULL) {
                slot = PyLong_AsSsize_t(known_slot);
            } else {
                if (PyErr_Occurred())
                    goto done;
                slot = p.n_slots;
                Py_ssize_t size = p.slots_size;
                if (grow((void **)&p.slots, &size, slot + 1, sizeof(Slot)) < 0)
                    goto done;
                p.slots_size = size;
                p.slots[slot].count = 0;
                p.n_slots++;
                PyObject *number = PyLong_FromSsize_t(slot);
                if (number == NULL)
                    goto done;
                int stored = PyDict_SetItem(slots_of, prefix, number);
                Py_DECREF(number);
                if (stored < 0 || PyList_Append(slot_prefixes, prefix) < 0)
                    goto done;
            }
            if (add_entry(&p, slot, i) < 0)
                goto done;
        }
        /* Last: put runs Python code, which might change routes; nothing of the route is used after it. */
        PyObject *key = stamped(PyTuple_GET_ITEM(route, 0), first + (unsigned long long)i);
        if (key == NULL)
            goto done;
        int failed = call_put(put, key, value, handle);
        Py_DECREF(key);
        if (failed < 0)
            goto done;
    }
    for (Py_ssize_t s = 0; s < p.n_slots; s++) {
        Slot *slot = &p.slots[s];
        PyObject *key = stamped(PyList_GET_ITEM(slot_prefixes, s), first + (unsigned long long)p.entries[slot->head].position);
        if (key == NULL)
            goto done;
        PyObject *value = slot->count == 1 ? PyBytes_FromStringAndSize("", 0) : encode_postings(&p, slot);
        if (value == NULL) {
            Py_DECREF(key);
            goto done;
        }
        int failed = call_put(put, key, value, handle);
        Py_DECREF(key);
        Py_DECREF(value);
        if (failed < 0)
            goto done;
    }
    result = streams;
    Py_INCREF(result);
done:
    PyMem_Free(p.entries);
    PyMem_Free(p.slots);
    Py_XDECREF(topics);
    Py_XDECREF(values);
    Py_XDECREF(slots_of);
    Py_XDECREF(seen_streams);
    Py_XDECREF(streams);
    Py_XDECREF(slot_prefixes);
    return result;
}

static PyMethodDef methods[] = {
    {"put_batch", put_batch, METH_VARARGS,
     "put_batch(put, handle, topics, values, first, routes) -> streams: a stored batch's data and index "
     "keys put into a write batch (writes.put_batch_python in C)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_store_native", "The store path's per-message loop in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__store_native(void) { return PyModule_Create(&module); }
