/* Span attributes in protobuf wire format, in C: the agent encodes every span's attributes (and
 * the collector every request's enrichment) through here, where Python spends a function call
 * per varint and a bytes object per field.
 *
 * Each function has a Python twin that gives the same answers (tokentrace.agent.span_encoding);
 * `attributes` returns None where its input leaves the fast path (the twin then answers, or
 * raises its error), never raises for odd input, and the tests compare the two on generated
 * input. Nothing here calls back into Python code, so the inputs cannot change under it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Field tags of opentelemetry/proto/{trace,common}/v1/*.proto (as in span_encoding.py). */
#define TAG_ATTRIBUTE 0x4a   /* Span.attributes = 9 */
#define TAG_KEY 0x0a         /* KeyValue.key = 1 */
#define TAG_VALUE 0x12       /* KeyValue.value = 2 */
#define TAG_STRING 0x0a      /* AnyValue.string_value = 1 */
#define TAG_BOOL 0x10        /* AnyValue.bool_value = 2 */
#define TAG_INT 0x18         /* AnyValue.int_value = 3 */
#define TAG_DOUBLE 0x21      /* AnyValue.double_value = 4 (fixed64) */
#define TAG_ARRAY 0x2a       /* AnyValue.array_value = 5 */
#define TAG_ARRAY_VALUE 0x0a /* ArrayValue.values = 1 */
#define MAX_DEPTH 32         /* nested arrays deeper than this take the Python path */
#define OUTSIDE (-1)         /* a size for input the fast path does not take */

static Py_ssize_t varint_size(uint64_t value) {
    Py_ssize_t size = 1;
    while (value >= 0x80) {
        value >>= 7;
        size++;
    }
    return size;
}

static unsigned char *put_varint(unsigned char *out, uint64_t value) {
    while (value >= 0x80) {
        *out++ = (unsigned char)(value | 0x80);
        value >>= 7;
    }
    *out++ = (unsigned char)value;
    return out;
}

/* A field's size from its content's: tag, length, content. */
static Py_ssize_t field_size(Py_ssize_t content) { return 1 + varint_size((uint64_t)content) + content; }

static unsigned char *put_field_head(unsigned char *out, unsigned char tag, Py_ssize_t content) {
    *out++ = tag;
    return put_varint(out, (uint64_t)content);
}

/* An int64 field's varint (two's complement); 0 when the int does not fit int64. */
static int int64_wire(PyObject *value, uint64_t *wire) {
    int overflow = 0;
    long long number = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow || (number == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    *wire = (uint64_t)number;
    return 1;
}

static const char *utf8_of(PyObject *text, Py_ssize_t *size) {
    const char *data = PyUnicode_AsUTF8AndSize(text, size); /* cached in the str object */
    if (data == NULL) {
        PyErr_Clear(); /* e.g. a lone surrogate: the twin raises its UnicodeEncodeError */
    }
    return data;
}

static Py_ssize_t any_value_size(PyObject *value, int depth);

/* The content of an ArrayValue: every element an AnyValue field. `ints_only`: the elements
 * must be ints (a list attribute is an int array: anything else is the twin's error). */
static Py_ssize_t array_content_size(PyObject *sequence, int depth, int ints_only) {
    if (depth > MAX_DEPTH) {
        return OUTSIDE;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(sequence);
    PyObject **items = PySequence_Fast_ITEMS(sequence);
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t element;
        if (ints_only) {
            uint64_t wire;
            if (!PyLong_Check(items[i]) || !int64_wire(items[i], &wire)) {
                return OUTSIDE;
            }
            element = 1 + varint_size(wire);
        } else {
            element = any_value_size(items[i], depth);
            if (element < 0) {
                return OUTSIDE;
            }
        }
        total += field_size(element);
    }
    return total;
}

/* The size of an AnyValue's content for `value`, as span_encoding._any_value writes it. */
static Py_ssize_t any_value_size(PyObject *value, int depth) {
    if (PyBool_Check(value)) { /* before int: bool is an int */
        return 2;
    }
    if (PyLong_Check(value)) {
        uint64_t wire;
        return int64_wire(value, &wire) ? 1 + varint_size(wire) : OUTSIDE;
    }
    if (PyFloat_Check(value)) {
        return 9;
    }
    if (PyUnicode_Check(value)) {
        Py_ssize_t size;
        return utf8_of(value, &size) != NULL ? field_size(size) : OUTSIDE;
    }
    if (PyList_Check(value) || PyTuple_Check(value)) {
        Py_ssize_t content = array_content_size(value, depth + 1, 0);
        return content < 0 ? OUTSIDE : field_size(content);
    }
    return OUTSIDE;
}

/* Writers: the sizes were checked by the size functions, so these cannot fail. */
static unsigned char *put_any_value(unsigned char *out, PyObject *value, int depth);

static unsigned char *put_array_content(unsigned char *out, PyObject *sequence, int depth,
                                        int ints_only) {
    Py_ssize_t count = PySequence_Fast_GET_SIZE(sequence);
    PyObject **items = PySequence_Fast_ITEMS(sequence);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (ints_only) {
            uint64_t wire = 0;
            int64_wire(items[i], &wire);
            out = put_field_head(out, TAG_ARRAY_VALUE, 1 + varint_size(wire));
            *out++ = TAG_INT;
            out = put_varint(out, wire);
        } else {
            out = put_field_head(out, TAG_ARRAY_VALUE, any_value_size(items[i], depth));
            out = put_any_value(out, items[i], depth);
        }
    }
    return out;
}

static unsigned char *put_any_value(unsigned char *out, PyObject *value, int depth) {
    if (PyBool_Check(value)) {
        *out++ = TAG_BOOL;
        *out++ = value == Py_True ? 1 : 0;
    } else if (PyLong_Check(value)) {
        uint64_t wire = 0;
        int64_wire(value, &wire);
        *out++ = TAG_INT;
        out = put_varint(out, wire);
    } else if (PyFloat_Check(value)) {
        *out++ = TAG_DOUBLE;
        PyFloat_Pack8(PyFloat_AS_DOUBLE(value), (char *)out, 1);
        out += 8;
    } else if (PyUnicode_Check(value)) {
        Py_ssize_t size = 0;
        const char *data = utf8_of(value, &size);
        out = put_field_head(out, TAG_STRING, size);
        memcpy(out, data, (size_t)size);
        out += size;
    } else { /* a list or a tuple */
        out = put_field_head(out, TAG_ARRAY, array_content_size(value, depth + 1, 0));
        out = put_array_content(out, value, depth + 1, 0);
    }
    return out;
}

/* The next (key, value) of a dict or of a list/tuple of 2-tuples: 1, 0 at the end, -1 for an
 * entry that is not a 2-tuple. */
static int next_pair(PyObject *items, Py_ssize_t *position, PyObject **key, PyObject **value) {
    if (PyDict_Check(items)) {
        return PyDict_Next(items, position, key, value);
    }
    if (*position >= PySequence_Fast_GET_SIZE(items)) {
        return 0;
    }
    PyObject *pair = PySequence_Fast_GET_ITEM(items, *position);
    (*position)++;
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        return -1;
    }
    *key = PyTuple_GET_ITEM(pair, 0);
    *value = PyTuple_GET_ITEM(pair, 1);
    return 1;
}

/* A top-level value: an exact list is an int array (span_encoding's `list` branch). */
static Py_ssize_t attribute_value_size(PyObject *value) {
    if (PyList_CheckExact(value)) {
        Py_ssize_t content = array_content_size(value, 1, 1);
        return content < 0 ? OUTSIDE : field_size(content);
    }
    return any_value_size(value, 0);
}

static Py_ssize_t key_value_size(Py_ssize_t key_size, Py_ssize_t value_size) {
    return field_size(key_size) + field_size(value_size);
}

/* attributes(items) -> bytes | None
 *
 * Every (key, value) of `items` (a dict, or a list or tuple of 2-tuples) as a Span.attributes
 * entry, tag included, in order; None when a key is not a str or a value is not one the twin
 * encodes (its error then), an int is beyond int64, a string is not encodable as UTF-8 or
 * arrays nest deeper than MAX_DEPTH.
 */
static PyObject *attributes(PyObject *module, PyObject *items) {
    (void)module;
    if (!PyDict_Check(items) && !PyList_Check(items) && !PyTuple_Check(items)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t total = 0;
    Py_ssize_t position = 0;
    PyObject *key;
    PyObject *value;
    int more;
    while ((more = next_pair(items, &position, &key, &value)) == 1) {
        Py_ssize_t key_size;
        if (!PyUnicode_Check(key) || utf8_of(key, &key_size) == NULL) {
            Py_RETURN_NONE;
        }
        Py_ssize_t value_size = attribute_value_size(value);
        if (value_size < 0) {
            Py_RETURN_NONE;
        }
        total += field_size(key_value_size(key_size, value_size));
    }
    if (more < 0) {
        Py_RETURN_NONE;
    }
    PyObject *result = PyBytes_FromStringAndSize(NULL, total);
    if (result == NULL) {
        return NULL;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
    position = 0;
    while (next_pair(items, &position, &key, &value) == 1) {
        Py_ssize_t key_size = 0;
        const char *key_data = utf8_of(key, &key_size);
        Py_ssize_t value_size = attribute_value_size(value);
        out = put_field_head(out, TAG_ATTRIBUTE, key_value_size(key_size, value_size));
        out = put_field_head(out, TAG_KEY, key_size);
        memcpy(out, key_data, (size_t)key_size);
        out += key_size;
        out = put_field_head(out, TAG_VALUE, value_size);
        if (PyList_CheckExact(value)) {
            out = put_field_head(out, TAG_ARRAY, array_content_size(value, 1, 1));
            out = put_array_content(out, value, 1, 1);
        } else {
            out = put_any_value(out, value, 0);
        }
    }
    return result;
}

/* length_delimited(tag: bytes, payload: bytes) -> bytes: tag, the payload's length, payload. */
static PyObject *length_delimited(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2 || !PyBytes_Check(args[0]) || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "length_delimited takes two bytes arguments");
        return NULL;
    }
    Py_ssize_t tag_size = PyBytes_GET_SIZE(args[0]);
    Py_ssize_t payload_size = PyBytes_GET_SIZE(args[1]);
    PyObject *result = PyBytes_FromStringAndSize(
        NULL, tag_size + varint_size((uint64_t)payload_size) + payload_size);
    if (result == NULL) {
        return NULL;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
    memcpy(out, PyBytes_AS_STRING(args[0]), (size_t)tag_size);
    out = put_varint(out + tag_size, (uint64_t)payload_size);
    memcpy(out, PyBytes_AS_STRING(args[1]), (size_t)payload_size);
    return result;
}

static PyMethodDef wire_methods[] = {
    {"attributes", attributes, METH_O,
     "attributes(items: dict | list | tuple of (str, value)) -> bytes | None"},
    {"length_delimited", (PyCFunction)(void (*)(void))length_delimited, METH_FASTCALL,
     "length_delimited(tag: bytes, payload: bytes) -> bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef wire_module = {
    PyModuleDef_HEAD_INIT, "_wire", "Span attributes in protobuf wire format, in C.", -1,
    wire_methods,
};

PyMODINIT_FUNC PyInit__wire(void) { return PyModule_Create(&wire_module); }
