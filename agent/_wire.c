/* OTLP protobuf wire format in C, both ways:
 *
 * - written: span attributes. The agent encodes every span's attributes (and the collector every
 *   request's enrichment) through here, where Python spends a function call per varint and a
 *   bytes object per field. Each function has a Python twin that gives the same answers
 *   (tokentrace.agent.span_encoding); `attributes` returns None where its input leaves the fast
 *   path (the twin then answers, or raises its error).
 * - read: received export requests (tokentrace.collector.receivers.wire): each span's own bytes,
 *   and the receiver's cheap checks over them. None where the walk does not take the input (the
 *   receiver then works from the parsed message, as without C).
 *
 * - and one that is not wire format but has the same reason to be C: `tcp_info`, the two
 *   TCP_INFO facts of a connection's descriptor (tokentrace.agent.tcp_info), which the HTTP
 *   server span reads once per request on the serving thread. uvloop's socket stand-in builds
 *   and detaches a Python socket object for every getsockopt (~2 us there; this: one syscall).
 *
 * Nothing here raises for odd input or calls back into Python code (the inputs cannot change
 * under it); the tests compare every function with its Python counterpart on generated input.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_varint.h"

#ifdef __linux__
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stddef.h>
#include <sys/socket.h>
#endif

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

/* --- span attributes written ------------------------------------------------------------- */

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

static unsigned char *put_attribute_value(unsigned char *out, PyObject *value) {
    if (PyList_CheckExact(value)) {
        out = put_field_head(out, TAG_ARRAY, array_content_size(value, 1, 1));
        return put_array_content(out, value, 1, 1);
    }
    return put_any_value(out, value, 0);
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
        out = put_attribute_value(out, value);
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

/* --- export requests read ---------------------------------------------------------------- */

/* Walks an ExportTraceServiceRequest's resource_spans -> scope_spans -> spans the way the
 * protobuf parser counts them (a field of another wire type than its declared one is an unknown
 * field, skipped), for the spans' own bytes and the receiver's cheap checks. */

#define SPAN_ENTRY_TAG 0x12 /* ScopeSpans.spans = 2 */

typedef struct {
    PyObject *entries;      /* span_entries: the list being built */
    PyObject *unclean;      /* unclean_spans: the positions being listed */
    Py_ssize_t fast_bytes;  /* the receiver's fast-path size bound */
    uint64_t min_time_ns;
    uint64_t max_time_ns;
    Py_ssize_t position[3]; /* the current (resource_spans, scope_spans, span) indices */
} SpanScan;

static int all_zero(const unsigned char *bytes, Py_ssize_t size) {
    for (Py_ssize_t i = 0; i < size; i++) {
        if (bytes[i]) {
            return 0;
        }
    }
    return 1;
}

static uint64_t read_fixed64(const unsigned char *bytes) {
    uint64_t value = 0;
    for (int i = 7; i >= 0; i--) {
        value = value << 8 | bytes[i];
    }
    return value;
}

/* 1 when the span [start, stop) passes validate.sanitize's per-span loop without its slow
 * branch: ids of the right lengths and not zero, an 8-byte non-zero parent or none, times in
 * order and range, no events or links, at most fast_bytes long. 0 when it does not (or when a
 * checked field comes with an unexpected wire type: sanitize decides then); -1 malformed. */
static int span_is_clean(const unsigned char *data, Py_ssize_t start, Py_ssize_t stop,
                         const SpanScan *scan) {
    Py_ssize_t pos = start, field_start = 0, field_stop = 0;
    Py_ssize_t trace_id = -1, trace_id_size = 0, span_id = -1, span_id_size = 0;
    Py_ssize_t parent = -1, parent_size = 0;
    uint64_t start_ns = 0, end_ns = 0;
    int clean = stop - start <= scan->fast_bytes;
    while (pos < stop) {
        uint32_t number;
        int wire_type;
        if (!next_field(data, stop, &pos, &number, &wire_type, &field_start, &field_stop)) {
            return -1;
        }
        switch (number) {
        case 1: /* trace_id: the last occurrence wins, as in the parser */
        case 2: /* span_id */
        case 4: /* parent_span_id */
            if (wire_type != WIRE_LEN) {
                clean = 0;
            } else if (number == 1) {
                trace_id = field_start, trace_id_size = field_stop - field_start;
            } else if (number == 2) {
                span_id = field_start, span_id_size = field_stop - field_start;
            } else {
                parent = field_start, parent_size = field_stop - field_start;
            }
            break;
        case 7: /* start_time_unix_nano */
        case 8: /* end_time_unix_nano */
            if (wire_type != WIRE_I64) {
                clean = 0;
            } else if (number == 7) {
                start_ns = read_fixed64(data + field_start);
            } else {
                end_ns = read_fixed64(data + field_start);
            }
            break;
        case 11: /* events */
        case 13: /* links */
            clean = 0;
            break;
        default:
            break;
        }
    }
    return clean && trace_id >= 0 && trace_id_size == 16 && !all_zero(data + trace_id, 16) &&
           span_id >= 0 && span_id_size == 8 && !all_zero(data + span_id, 8) &&
           (parent < 0 || parent_size == 0 || (parent_size == 8 && !all_zero(data + parent, 8))) &&
           scan->min_time_ns <= start_ns && start_ns <= end_ns && end_ns < scan->max_time_ns;
}

/* One span: its ScopeSpans.spans entry appended, or its checks. 1 ok, 0 malformed, -1 error. */
static int scan_span(const unsigned char *data, Py_ssize_t start, Py_ssize_t stop,
                     SpanScan *scan) {
    if (scan->entries == NULL) {
        int clean = span_is_clean(data, start, stop, scan);
        if (clean != 0) {
            return clean > 0 ? 1 : 0;
        }
        PyObject *where = Py_BuildValue("(nnn)", scan->position[0], scan->position[1],
                                        scan->position[2]);
        if (where == NULL) {
            return -1;
        }
        int appended = PyList_Append(scan->unclean, where);
        Py_DECREF(where);
        return appended == 0 ? 1 : -1;
    }
    Py_ssize_t size = stop - start;
    unsigned char head[11];
    Py_ssize_t head_size = put_field_head(head, SPAN_ENTRY_TAG, size) - head;
    PyObject *entry = PyBytes_FromStringAndSize(NULL, head_size + size);
    if (entry == NULL) {
        return -1;
    }
    memcpy(PyBytes_AS_STRING(entry), head, (size_t)head_size);
    memcpy(PyBytes_AS_STRING(entry) + head_size, data + start, (size_t)size);
    int appended = PyList_Append(scan->entries, entry);
    Py_DECREF(entry);
    return appended == 0 ? 1 : -1;
}

/* The fields numbered `field` (LEN) of the message [start, stop), each passed to `inner`
 * with its index among them at scan->position[depth]. */
typedef int (*FieldVisitor)(const unsigned char *, Py_ssize_t, Py_ssize_t, SpanScan *);

static int visit_fields(const unsigned char *data, Py_ssize_t start, Py_ssize_t stop,
                        uint32_t field, int depth, FieldVisitor inner, SpanScan *scan) {
    Py_ssize_t pos = start, field_start = 0, field_stop = 0, index = 0;
    while (pos < stop) {
        uint32_t number;
        int wire_type;
        if (!next_field(data, stop, &pos, &number, &wire_type, &field_start, &field_stop)) {
            return 0;
        }
        if (number == field && wire_type == WIRE_LEN) {
            scan->position[depth] = index++;
            int visited = inner(data, field_start, field_stop, scan);
            if (visited != 1) {
                return visited;
            }
        }
    }
    return 1;
}

static int scan_scope_spans(const unsigned char *data, Py_ssize_t start, Py_ssize_t stop,
                            SpanScan *scan) {
    return visit_fields(data, start, stop, 2, 2, scan_span, scan); /* ScopeSpans.spans */
}

static int scan_resource_spans(const unsigned char *data, Py_ssize_t start, Py_ssize_t stop,
                               SpanScan *scan) {
    return visit_fields(data, start, stop, 2, 1, scan_scope_spans, scan); /* .scope_spans */
}

static int scan_request(PyObject *request, SpanScan *scan) {
    const unsigned char *data = (const unsigned char *)PyBytes_AS_STRING(request);
    /* ExportTraceServiceRequest.resource_spans = 1 */
    return visit_fields(data, 0, PyBytes_GET_SIZE(request), 1, 0, scan_resource_spans, scan);
}

/* span_entries(request: bytes) -> list[bytes] | None
 *
 * Each span of a serialised ExportTraceServiceRequest as its ScopeSpans.spans entry (tag,
 * length, the span's bytes as received), in the order the protobuf parser lists them; None
 * for input this walk does not take (malformed, groups).
 */
static PyObject *span_entries(PyObject *module, PyObject *request) {
    (void)module;
    if (!PyBytes_Check(request)) {
        Py_RETURN_NONE;
    }
    SpanScan scan = {PyList_New(0), NULL, 0, 0, 0, {0, 0, 0}};
    if (scan.entries == NULL) {
        return NULL;
    }
    int scanned = scan_request(request, &scan);
    if (scanned == 1) {
        return scan.entries;
    }
    Py_DECREF(scan.entries);
    if (scanned < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* unclean_spans(request: bytes, fast_path_bytes: int, min_time_ns: int, max_time_ns: int)
 *     -> list[tuple[int, int, int]] | None
 *
 * The (resource_spans, scope_spans, span) indices of the spans of a serialised
 * ExportTraceServiceRequest that do not pass the receiver's cheap checks (span_is_clean), in
 * order: only those need validate's own; None for input this walk does not take or bounds
 * beyond 64 bits.
 */
static PyObject *unclean_spans(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "unclean_spans takes 4 arguments");
        return NULL;
    }
    if (!PyBytes_Check(args[0])) {
        Py_RETURN_NONE;
    }
    SpanScan scan = {NULL, NULL, PyLong_AsSsize_t(args[1]), PyLong_AsUnsignedLongLong(args[2]),
                     PyLong_AsUnsignedLongLong(args[3]), {0, 0, 0}};
    if (PyErr_Occurred()) {
        PyErr_Clear(); /* a negative or huge bound: the Python checks apply */
        Py_RETURN_NONE;
    }
    scan.unclean = PyList_New(0);
    if (scan.unclean == NULL) {
        return NULL;
    }
    int scanned = scan_request(args[0], &scan);
    if (scanned == 1) {
        return scan.unclean;
    }
    Py_DECREF(scan.unclean);
    if (scanned < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* --- assembled traces written ------------------------------------------------------------ */

/* trace_request(refs: list[SpanRef], appended: dict[bytes, bytes] | None) -> bytes | None
 *
 * collector.encoding.encode_trace_request in one pass over sizes and one write: the spans
 * grouped by their resource and scope objects (identity, in the order each first appears), each
 * span's ScopeSpans.spans entry as received (SpanRef.wire) with appended[its span id] added to
 * its end. None where that fast path does not apply (a span without its received bytes, a
 * resource or scope without theirs, more groups than the tables below hold, input of other
 * types): the twin answers then. A span's id is read from its bytes as the parser reads it (the
 * last span_id field; none is b""). */

#define MAX_RESOURCE_GROUPS 16
#define MAX_SCOPE_GROUPS 64
#define MAX_LINEAR_APPENDED 8 /* more appended entries than this: one dict look-up per span */

/* A resource (parent -1) or a scope (parent: its resource's group) and the spans under it. The
 * objects in these tables are held (a reference each): a ref's attribute look-up could run code
 * that drops its own. */
typedef struct {
    Py_ssize_t parent;
    PyObject *object; /* identity is the group */
    PyObject *wire;   /* its serialisation, from the group's first ref */
    Py_ssize_t content; /* the ResourceSpans / ScopeSpans content size */
} Group;

typedef struct {
    Py_ssize_t scope; /* index into the scope groups */
    PyObject *wire;   /* the span's entry */
    Py_ssize_t body;  /* where the span's own bytes start in the entry */
    PyObject *extra;  /* bytes to append, or NULL */
} RefEntry;

typedef struct {
    RefEntry *entries;
    Py_ssize_t entry_count;
    Group resources[MAX_RESOURCE_GROUPS];
    Py_ssize_t resource_count;
    Group scopes[MAX_SCOPE_GROUPS];
    Py_ssize_t scope_count;
} TracePlan;

static void release_groups(Group *groups, Py_ssize_t count) {
    for (Py_ssize_t g = 0; g < count; g++) {
        Py_DECREF(groups[g].object);
        Py_DECREF(groups[g].wire);
    }
}

static void release_plan(TracePlan *plan) {
    for (Py_ssize_t i = 0; i < plan->entry_count; i++) {
        Py_DECREF(plan->entries[i].wire);
        Py_XDECREF(plan->entries[i].extra);
    }
    release_groups(plan->resources, plan->resource_count);
    release_groups(plan->scopes, plan->scope_count);
    PyMem_Free(plan->entries);
}

static PyObject *name_resource, *name_scope, *name_wire, *name_resource_wire, *name_scope_wire;

/* The SpanRef attribute names, made once: 1, or 0 with MemoryError set (tried again next call). */
static int intern_names(void) {
    if (name_scope_wire != NULL) { /* the last one made */
        return 1;
    }
    name_resource = name_resource ? name_resource : PyUnicode_InternFromString("resource");
    name_scope = name_scope ? name_scope : PyUnicode_InternFromString("scope");
    name_wire = name_wire ? name_wire : PyUnicode_InternFromString("wire");
    name_resource_wire =
        name_resource_wire ? name_resource_wire : PyUnicode_InternFromString("resource_wire");
    if (name_resource == NULL || name_scope == NULL || name_wire == NULL ||
        name_resource_wire == NULL) {
        return 0;
    }
    name_scope_wire = PyUnicode_InternFromString("scope_wire");
    return name_scope_wire != NULL;
}

/* The span's own bytes in an entry (tag 0x12, length, span): where they start; 0 when the entry
 * is not one. */
static Py_ssize_t entry_body(PyObject *entry) {
    const unsigned char *data = (const unsigned char *)PyBytes_AS_STRING(entry);
    Py_ssize_t size = PyBytes_GET_SIZE(entry), pos = 1;
    uint64_t length;
    if (size < 2 || data[0] != SPAN_ENTRY_TAG || !read_varint(data, size, &pos, &length) ||
        length != (uint64_t)(size - pos)) {
        return 0;
    }
    return pos;
}

/* The span id (Span.span_id = 2: the last one, which the parser keeps; none is empty) of the
 * span bytes [start, stop): 1, or 0 when malformed. */
static int span_id_of(const unsigned char *data, Py_ssize_t start, Py_ssize_t stop,
                      Py_ssize_t *id_start, Py_ssize_t *id_size) {
    Py_ssize_t pos = start, field_start = 0, field_stop = 0;
    *id_start = start;
    *id_size = 0;
    while (pos < stop) {
        uint32_t number;
        int wire_type;
        if (!next_field(data, stop, &pos, &number, &wire_type, &field_start, &field_stop)) {
            return 0;
        }
        if (number == 2 && wire_type == WIRE_LEN) {
            *id_start = field_start;
            *id_size = field_stop - field_start;
        }
    }
    return 1;
}

/* appended[the entry's span id] as a new reference, or NULL: absent (*failed 0), outside the
 * fast path (*failed 1: a malformed span, a key or value that is not bytes) or an error
 * (*failed -1). */
static PyObject *appended_for(PyObject *appended, PyObject *entry, Py_ssize_t body,
                              int *failed) {
    const unsigned char *data = (const unsigned char *)PyBytes_AS_STRING(entry);
    Py_ssize_t id_start, id_size;
    if (!span_id_of(data, body, PyBytes_GET_SIZE(entry), &id_start, &id_size)) {
        *failed = 1;
        return NULL;
    }
    PyObject *value = NULL;
    if (PyDict_GET_SIZE(appended) <= MAX_LINEAR_APPENDED) {
        Py_ssize_t position = 0;
        PyObject *key, *candidate;
        while (PyDict_Next(appended, &position, &key, &candidate)) {
            if (!PyBytes_CheckExact(key)) {
                *failed = 1; /* a key that may equal bytes without being bytes: the twin */
                return NULL;
            }
            if (PyBytes_GET_SIZE(key) == id_size &&
                memcmp(PyBytes_AS_STRING(key), data + id_start, (size_t)id_size) == 0) {
                value = candidate;
                break;
            }
        }
    } else {
        PyObject *key = PyBytes_FromStringAndSize((const char *)data + id_start, id_size);
        if (key == NULL) {
            *failed = -1;
            return NULL;
        }
        value = PyDict_GetItemWithError(appended, key);
        Py_DECREF(key);
        if (value == NULL && PyErr_Occurred()) {
            *failed = -1;
            return NULL;
        }
    }
    if (value == NULL) {
        return NULL;
    }
    if (!PyBytes_CheckExact(value)) {
        *failed = 1;
        return NULL;
    }
    Py_INCREF(value);
    return value;
}

/* A SpanRef attribute that must be bytes: a new reference, or NULL (*failed -1 with the error
 * set, or 1 when the value is not bytes). */
static PyObject *bytes_attribute(PyObject *ref, PyObject *name, int *failed) {
    PyObject *value = PyObject_GetAttr(ref, name);
    if (value == NULL) {
        *failed = -1;
        return NULL;
    }
    if (!PyBytes_CheckExact(value)) {
        Py_DECREF(value);
        *failed = 1;
        return NULL;
    }
    return value;
}

/* The group of `object` (taken) under `parent` in `groups`: its index, opened with the ref's
 * `wire_name` bytes when new; -1 outside the fast path (a full table, no bytes), -2 error. */
static Py_ssize_t group_of(Group *groups, Py_ssize_t *count, Py_ssize_t max, Py_ssize_t parent,
                           PyObject *object, PyObject *ref, PyObject *wire_name) {
    for (Py_ssize_t g = 0; g < *count; g++) {
        if (groups[g].parent == parent && groups[g].object == object) {
            Py_DECREF(object);
            return g;
        }
    }
    int failed = 0;
    PyObject *wire = *count == max ? NULL : bytes_attribute(ref, wire_name, &failed);
    if (wire == NULL) {
        Py_DECREF(object);
        return failed < 0 ? -2 : -1;
    }
    groups[*count] = (Group){parent, object, wire, 0};
    return (*count)++;
}

/* One ref placed in its groups (opened where new) and its entry sized: 1, 0 outside the fast
 * path, -1 error. */
static int plan_ref(TracePlan *plan, PyObject *ref, PyObject *appended) {
    int failed = 0;
    PyObject *wire = bytes_attribute(ref, name_wire, &failed);
    if (wire == NULL) {
        return failed > 0 ? 0 : -1;
    }
    Py_ssize_t body = entry_body(wire);
    PyObject *extra = NULL;
    if (body != 0 && appended != NULL) {
        extra = appended_for(appended, wire, body, &failed);
    }
    if (body == 0 || failed) {
        Py_DECREF(wire);
        return body == 0 || failed > 0 ? 0 : -1;
    }
    if (extra != NULL && PyBytes_GET_SIZE(extra) == 0) {
        Py_CLEAR(extra); /* re-headed with nothing added: the same entry */
    }
    RefEntry *entry = &plan->entries[plan->entry_count++];
    *entry = (RefEntry){-1, wire, body, extra};

    PyObject *resource = PyObject_GetAttr(ref, name_resource);
    if (resource == NULL) {
        return -1;
    }
    Py_ssize_t r = group_of(plan->resources, &plan->resource_count, MAX_RESOURCE_GROUPS, -1,
                            resource, ref, name_resource_wire);
    if (r < 0) {
        return r == -1 ? 0 : -1;
    }
    PyObject *scope = PyObject_GetAttr(ref, name_scope);
    if (scope == NULL) {
        return -1;
    }
    Py_ssize_t s = group_of(plan->scopes, &plan->scope_count, MAX_SCOPE_GROUPS, r, scope, ref,
                            name_scope_wire);
    if (s < 0) {
        return s == -1 ? 0 : -1;
    }
    entry->scope = s;
    plan->scopes[s].content +=
        extra == NULL ? PyBytes_GET_SIZE(wire)
                      : field_size(PyBytes_GET_SIZE(wire) - body + PyBytes_GET_SIZE(extra));
    return 1;
}

/* Groups the refs and sizes every part: 1 done, 0 outside the fast path, -1 error. */
static int plan_trace(TracePlan *plan, PyObject *refs, Py_ssize_t count, PyObject *appended) {
    for (Py_ssize_t i = 0; i < count; i++) {
        if (PyList_GET_SIZE(refs) != count) {
            return 0; /* changed by a ref's attribute look-up */
        }
        PyObject *ref = PyList_GET_ITEM(refs, i);
        Py_INCREF(ref);
        int planned = plan_ref(plan, ref, appended);
        Py_DECREF(ref);
        if (planned != 1) {
            return planned;
        }
    }
    for (Py_ssize_t s = 0; s < plan->scope_count; s++) {
        Group *scope = &plan->scopes[s];
        scope->content += field_size(PyBytes_GET_SIZE(scope->wire)); /* ScopeSpans.scope */
        plan->resources[scope->parent].content += field_size(scope->content);
    }
    for (Py_ssize_t r = 0; r < plan->resource_count; r++) {
        plan->resources[r].content += field_size(PyBytes_GET_SIZE(plan->resources[r].wire));
    }
    return 1;
}

static unsigned char *put_bytes(unsigned char *out, PyObject *bytes, Py_ssize_t from) {
    Py_ssize_t size = PyBytes_GET_SIZE(bytes) - from;
    memcpy(out, PyBytes_AS_STRING(bytes) + from, (size_t)size);
    return out + size;
}

/* ExportTraceServiceRequest.resource_spans = 1 { resource = 1, scope_spans = 2 { scope = 1,
 * spans = 2 } }: each group's spans in their order in the trace. */
static void write_trace(TracePlan *plan, unsigned char *out) {
    for (Py_ssize_t r = 0; r < plan->resource_count; r++) {
        Group *resource = &plan->resources[r];
        out = put_field_head(out, 0x0a, resource->content);
        out = put_field_head(out, 0x0a, PyBytes_GET_SIZE(resource->wire));
        out = put_bytes(out, resource->wire, 0);
        for (Py_ssize_t s = 0; s < plan->scope_count; s++) {
            Group *scope = &plan->scopes[s];
            if (scope->parent != r) {
                continue;
            }
            out = put_field_head(out, 0x12, scope->content);
            out = put_field_head(out, 0x0a, PyBytes_GET_SIZE(scope->wire));
            out = put_bytes(out, scope->wire, 0);
            for (Py_ssize_t i = 0; i < plan->entry_count; i++) {
                RefEntry *entry = &plan->entries[i];
                if (entry->scope != s) {
                    continue;
                }
                if (entry->extra == NULL) {
                    out = put_bytes(out, entry->wire, 0);
                    continue;
                }
                Py_ssize_t body = PyBytes_GET_SIZE(entry->wire) - entry->body;
                out = put_field_head(out, SPAN_ENTRY_TAG, body + PyBytes_GET_SIZE(entry->extra));
                out = put_bytes(out, entry->wire, entry->body);
                out = put_bytes(out, entry->extra, 0);
            }
        }
    }
}

static PyObject *trace_request(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "trace_request takes 2 arguments");
        return NULL;
    }
    PyObject *refs = args[0], *appended = args[1];
    if (!PyList_CheckExact(refs) || (appended != Py_None && !PyDict_CheckExact(appended))) {
        Py_RETURN_NONE;
    }
    if (appended == Py_None || PyDict_GET_SIZE(appended) == 0) {
        appended = NULL;
    }
    if (!intern_names()) {
        return NULL;
    }
    /* Nothing here runs Python code for slotted SpanRefs; for refs whose attribute look-ups
     * could, every object used is held, and a list that changes leaves the fast path. */
    Py_INCREF(refs);
    TracePlan plan;
    plan.entry_count = plan.resource_count = plan.scope_count = 0;
    Py_ssize_t count = PyList_GET_SIZE(refs);
    plan.entries = PyMem_Malloc(sizeof(RefEntry) * (size_t)(count ? count : 1));
    if (plan.entries == NULL) {
        Py_DECREF(refs);
        return PyErr_NoMemory();
    }
    PyObject *result = NULL;
    int planned = plan_trace(&plan, refs, count, appended);
    if (planned == 1) {
        Py_ssize_t total = 0;
        for (Py_ssize_t r = 0; r < plan.resource_count; r++) {
            total += field_size(plan.resources[r].content);
        }
        result = PyBytes_FromStringAndSize(NULL, total);
        if (result != NULL) {
            write_trace(&plan, (unsigned char *)PyBytes_AS_STRING(result));
        }
    } else if (planned >= 0) {
        result = Py_NewRef(Py_None);
    }
    release_plan(&plan);
    Py_DECREF(refs);
    return result;
}

/* tcp_info(fd) -> (tcpi_last_data_recv in ms, tcpi_rtt in us), or None where the kernel cannot
 * tell: not Linux, not a TCP socket, a closed descriptor, a short answer. */
static PyObject *tcp_info(PyObject *module, PyObject *arg) {
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
#if defined(__linux__) && defined(TCP_INFO)
    struct tcp_info info;
    socklen_t size = sizeof(info);
    if (fd < 0 || fd > INT32_MAX ||
        getsockopt((int)fd, IPPROTO_TCP, TCP_INFO, &info, &size) != 0 ||
        size < offsetof(struct tcp_info, tcpi_rtt) + sizeof(info.tcpi_rtt)) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(kk)", (unsigned long)info.tcpi_last_data_recv,
                         (unsigned long)info.tcpi_rtt);
#else
    Py_RETURN_NONE;
#endif
}

static PyMethodDef wire_methods[] = {
    {"attributes", attributes, METH_O,
     "attributes(items: dict | list | tuple of (str, value)) -> bytes | None"},
    {"length_delimited", (PyCFunction)(void (*)(void))length_delimited, METH_FASTCALL,
     "length_delimited(tag: bytes, payload: bytes) -> bytes"},
    {"span_entries", span_entries, METH_O, "span_entries(request: bytes) -> list[bytes] | None"},
    {"unclean_spans", (PyCFunction)(void (*)(void))unclean_spans, METH_FASTCALL,
     "unclean_spans(request: bytes, fast_path_bytes: int, min_time_ns: int, max_time_ns: int)"
     " -> list[tuple[int, int, int]] | None"},
    {"trace_request", (PyCFunction)(void (*)(void))trace_request, METH_FASTCALL,
     "trace_request(refs: list[SpanRef], appended: dict[bytes, bytes] | None) -> bytes | None"},
    {"tcp_info", tcp_info, METH_O,
     "tcp_info(fd: int) -> tuple[int, int] | None: (last_data_recv ms, rtt us)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef wire_module = {
    PyModuleDef_HEAD_INIT, "_wire", "OTLP protobuf wire format in C (see _wire.c).", -1,
    wire_methods,
};

PyMODINIT_FUNC PyInit__wire(void) { return PyModule_Create(&wire_module); }
