/* The engine-step tracer's per-step work in C (tokentrace.agent.frameworks.vllm_engine).
 *
 * EngineCore's busy loop calls the tracer once per step, at the step's update, and the tracer
 * reads the step: its prefill requests (recorded per request), and its outputs (the finished
 * ones); decoding requests cost nothing per step but their output's finish reason (their token
 * steps are found in the ring when they finish). `step_facts` does the whole step's reading and
 * recording, which in Python costs a few µs on the serving thread, mostly in Python calls; here
 * a fraction. Its Python twin in vllm_engine.py gives the same answers; it returns None where
 * its input is not of the types it walks (the twin then answers), before it changes anything.
 * `step_hook` makes the functions put in vLLM's scheduler class in place of the step's two
 * methods, which do the tracer's whole per-step work (see below), and `track_request` reads a
 * request first seen (vllm_engine._track, its twin). `outputs_hook` does the same for the API
 * server's once-per-step call, vLLM's OutputProcessor.process_outputs (vllm_requests.py).
 * Unlike _wire.c it reads attributes, which may run Python code of the host's objects; errors it
 * raises propagate (the hooks hand them to the tracer's hook guard).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stddef.h>
#include <time.h>

#include "_guard.h"

/* Appends `item` to `steps` (a list, or whatever has an append method). */
static int append_to(PyObject *steps, PyObject *item) {
    if (PyList_CheckExact(steps)) {
        return PyList_Append(steps, item);
    }
    PyObject *done = PyObject_CallMethod(steps, "append", "O", item);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

/* Appends `item` to the list in `entry`'s attribute `attribute`. */
static int append_to_attribute(PyObject *entry, PyObject *attribute, PyObject *item) {
    Py_INCREF(entry);
    PyObject *steps = PyObject_GetAttr(entry, attribute);
    Py_DECREF(entry);
    if (steps == NULL) {
        return -1;
    }
    int appended = append_to(steps, item);
    Py_DECREF(steps);
    return appended;
}

/* Appends to the list *found (made when first needed) getattr(item, name) of each item of the
 * list or tuple `items` whose attribute `flag` is not None, in order. */
static int ids_where_set_into(PyObject **found, PyObject *items, PyObject *flag, PyObject *name) {
    /* A list may change length under attribute code: index it afresh each time. */
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(items); i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(items, i);
        Py_INCREF(item);
        PyObject *value = PyObject_GetAttr(item, flag);
        if (value == NULL) {
            Py_DECREF(item);
            return -1;
        }
        int set = value != Py_None;
        Py_DECREF(value);
        if (set) {
            PyObject *id = PyObject_GetAttr(item, name);
            if (id != NULL && *found == NULL && (*found = PyList_New(0)) == NULL) {
                Py_CLEAR(id);
            }
            int appended = id == NULL ? -1 : PyList_Append(*found, id);
            Py_XDECREF(id);
            if (appended < 0) {
                Py_DECREF(item);
                return -1;
            }
        }
        Py_DECREF(item);
    }
    return 0;
}

/* Attribute names, interned once. */
enum {
    NAME_NUM_SCHEDULED_TOKENS,
    NAME_SCHEDULED_NEW_REQS,
    NAME_SCHEDULED_CACHED_REQS,
    NAME_REQ_IDS,
    NAME_NUM_OUTPUT_TOKENS,
    NAME_REQ_ID,
    NAME_TIMESTAMP,
    NAME_OUTPUTS,
    NAME_FINISH_REASON,
    NAME_REQUEST_ID,
    NAME_GET_REQUEST_COUNTS,
    NAME_KV_CACHE_MANAGER,
    NAME_USAGE,
    NAME_TOTAL_NUM_SCHEDULED_TOKENS,
    NAME_PREFILL_STEPS,
    NAME_TRACE_HEADERS,
    NAME_EVENTS,
    NAME_TYPE,
    NAME_FIRST_STEP,
    NAME_NEW_TOKEN_IDS,
    NAME_TOKEN_NS,
    NAME_REQUEST_STATES,
    NAME_COUNT,
};
static const char *const name_strings[NAME_COUNT] = {
    "num_scheduled_tokens", "scheduled_new_reqs", "scheduled_cached_reqs", "req_ids",
    "num_output_tokens",    "req_id",             "timestamp",             "outputs",
    "finish_reason",        "request_id",         "get_request_counts",    "kv_cache_manager",
    "usage",                "total_num_scheduled_tokens", "prefill_steps",
    "trace_headers",        "events",             "type",                  "first_step",
    "new_token_ids",        "token_ns",           "request_states",
};
static PyObject *names[NAME_COUNT];
static PyObject *zero;
static PyObject *one;
static PyObject *ns_per_s;
static PyObject *no_prefill; /* frozenset() */

/* getattr(obj, name, None) as a new reference, NULL with an error set on failure. */
static PyObject *optional_attr(PyObject *obj, PyObject *name) {
    PyObject *value = NULL;
#if PY_VERSION_HEX >= 0x030D0000
    if (PyObject_GetOptionalAttr(obj, name, &value) < 0) {
        return NULL;
    }
#else
    if (_PyObject_LookupAttr(obj, name, &value) < 0) {
        return NULL;
    }
#endif
    if (value == NULL) {
        Py_RETURN_NONE;
    }
    return value;
}

/* `0 in items` for a list: an exact int is read as a C long (a few instructions, where
 * PySequence_Contains compares objects: ~90 per decoding request); anything else is compared. */
static int contains_zero(PyObject *items) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *item = PyList_GET_ITEM(items, i);
        int equal;
        if (PyLong_CheckExact(item)) {
            int overflow;
            long value = PyLong_AsLongAndOverflow(item, &overflow);
            equal = value == 0 && !overflow;
        } else { /* __eq__ may change the list: held, and the size read afresh */
            Py_INCREF(item);
            equal = PyObject_RichCompareBool(item, zero, Py_EQ);
            Py_DECREF(item);
            if (equal < 0) {
                return -1;
            }
        }
        if (equal) {
            return 1;
        }
    }
    return 0;
}

/* The step's prefill requests as vllm_engine._prefill_ids finds them, from the columns of
 * vLLM's CachedRequestData: *prefill is set to NULL for a decode-only step, else to a new set.
 * Returns 1 when done, 0 for another layout (the twin's case), -1 on an error. */
static int prefill_ids(PyObject *output, PyObject **prefill) {
    int answer = -1;
    PyObject *new_requests = NULL, *cached = NULL, *ids = NULL, *output_tokens = NULL;
    *prefill = NULL;
    new_requests = PyObject_GetAttr(output, names[NAME_SCHEDULED_NEW_REQS]);
    cached = new_requests == NULL ? NULL : PyObject_GetAttr(output, names[NAME_SCHEDULED_CACHED_REQS]);
    ids = cached == NULL ? NULL : optional_attr(cached, names[NAME_REQ_IDS]);
    output_tokens = ids == NULL ? NULL : optional_attr(cached, names[NAME_NUM_OUTPUT_TOKENS]);
    if (output_tokens == NULL) {
        goto done;
    }
    if (!PyList_CheckExact(new_requests) || !PyList_CheckExact(ids) ||
        !PyList_CheckExact(output_tokens)) {
        answer = 0;
        goto done;
    }
    if (PyList_GET_SIZE(new_requests) == 0) {
        int has_zero = contains_zero(output_tokens);
        if (has_zero <= 0) { /* decode only, or an error */
            answer = has_zero < 0 ? -1 : 1;
            goto done;
        }
    }
    PyObject *found = PySet_New(NULL);
    if (found == NULL) {
        goto done;
    }
    /* compress(ids, map(not_, output_tokens)); lists may change under __bool__: index afresh. */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ids) && i < PyList_GET_SIZE(output_tokens); i++) {
        PyObject *tokens = PyList_GET_ITEM(output_tokens, i);
        Py_INCREF(tokens);
        int none_yet = PyObject_Not(tokens);
        Py_DECREF(tokens);
        if (none_yet < 0 || (none_yet && i < PyList_GET_SIZE(ids) &&
                             PySet_Add(found, PyList_GET_ITEM(ids, i)) < 0)) {
            Py_DECREF(found);
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(new_requests); i++) {
        PyObject *request = PyList_GET_ITEM(new_requests, i);
        Py_INCREF(request);
        PyObject *id = PyObject_GetAttr(request, names[NAME_REQ_ID]);
        Py_DECREF(request);
        if (id == NULL || PySet_Add(found, id) < 0) {
            Py_XDECREF(id);
            Py_DECREF(found);
            goto done;
        }
        Py_DECREF(id);
    }
    *prefill = found;
    answer = 1;
done:
    Py_XDECREF(new_requests);
    Py_XDECREF(cached);
    Py_XDECREF(ids);
    Py_XDECREF(output_tokens);
    return answer;
}

/* --- a request first seen: vllm_engine._track ------------------------------------------------
 * parts = (ENGINE_PARENT_HEADER, EVENT_SCHEDULED, _TrackedRequest, _track): the header's name,
 * the SCHEDULED event's type, the record's type and the Python function, which answers for
 * anything but the common shapes read here (a dict of headers, a 66-character ASCII value, a
 * list of events). Once per request in EngineCore's busy loop, where its Python frames cost
 * several times their warm time (measured: docs/performance.md). */
enum { TRACK_TRACE_HEX = 32, TRACK_SPAN_HEX = 16, TRACK_VALUE_LENGTH = 32 + 1 + 16 + 1 + 16 };

static int hex_digit(Py_UCS1 c) {
    if (c >= '0' && c <= '9') {
        return c - '0';
    }
    if (c >= 'a' && c <= 'f') {
        return c - 'a' + 10;
    }
    if (c >= 'A' && c <= 'F') {
        return c - 'A' + 10;
    }
    return -1;
}

/* `digits` hex digits at `text` into a new bytes object in *id, *nonzero set where any byte is
 * not zero; 1 done, 0 for a character that is not a hex digit (*id untouched), -1 on an error. */
static int hex_id(const Py_UCS1 *text, Py_ssize_t digits, PyObject **id, int *nonzero) {
    unsigned char raw[TRACK_TRACE_HEX / 2];
    *nonzero = 0;
    for (Py_ssize_t i = 0; i < digits / 2; i++) {
        int high = hex_digit(text[2 * i]), low = hex_digit(text[2 * i + 1]);
        if (high < 0 || low < 0) {
            return 0;
        }
        raw[i] = (unsigned char)(high << 4 | low);
        *nonzero |= raw[i];
    }
    *id = PyBytes_FromStringAndSize((const char *)raw, digits / 2);
    return *id == NULL ? -1 : 1;
}

/* The record of `request` (a new reference, None when not traced), or NULL with an error set. */
static PyObject *track_request_parts(PyObject *parts, PyObject *request) {
    if (!PyTuple_CheckExact(parts) || PyTuple_GET_SIZE(parts) != 4) {
        PyErr_SetString(PyExc_TypeError, "track parts: (header, scheduled type, type, twin)");
        return NULL;
    }
    PyObject *header = PyTuple_GET_ITEM(parts, 0), *scheduled = PyTuple_GET_ITEM(parts, 1);
    PyObject *tracked_type = PyTuple_GET_ITEM(parts, 2), *twin = PyTuple_GET_ITEM(parts, 3);
    PyObject *headers = NULL, *events = NULL, *ids[3] = {NULL, NULL, NULL}, *first_ns = NULL;
    PyObject *answer = NULL;
    headers = optional_attr(request, names[NAME_TRACE_HEADERS]);
    if (headers == NULL) {
        return NULL;
    }
    if (headers == Py_None || (PyDict_CheckExact(headers) && PyDict_GET_SIZE(headers) == 0)) {
        answer = Py_NewRef(Py_None);
        goto done;
    }
    if (!PyDict_CheckExact(headers)) {
        goto twin;
    }
    PyObject *value = PyDict_GetItemWithError(headers, header); /* borrowed */
    if (value == NULL) {
        answer = PyErr_Occurred() ? NULL : Py_NewRef(Py_None); /* parse_engine_parent(None) */
        goto done;
    }
    if (!PyUnicode_CheckExact(value) || !PyUnicode_IS_ASCII(value) ||
        PyUnicode_GET_LENGTH(value) != TRACK_VALUE_LENGTH) {
        goto twin; /* whitespace around it, or not an id at all: the twin's answer */
    }
    const Py_UCS1 *text = PyUnicode_1BYTE_DATA(value);
    if (text[TRACK_TRACE_HEX] != '-' || text[TRACK_TRACE_HEX + 1 + TRACK_SPAN_HEX] != '-') {
        goto twin;
    }
    const Py_ssize_t starts[3] = {0, TRACK_TRACE_HEX + 1, TRACK_TRACE_HEX + TRACK_SPAN_HEX + 2};
    const Py_ssize_t digits[3] = {TRACK_TRACE_HEX, TRACK_SPAN_HEX, TRACK_SPAN_HEX};
    int all_nonzero = 1;
    for (int i = 0; i < 3; i++) {
        int nonzero;
        int parsed = hex_id(text + starts[i], digits[i], &ids[i], &nonzero);
        if (parsed < 0) {
            goto done;
        }
        if (parsed == 0) {
            goto twin;
        }
        all_nonzero &= nonzero != 0;
    }
    if (!all_nonzero) { /* all-zero ids are invalid */
        answer = Py_NewRef(Py_None);
        goto done;
    }
    events = optional_attr(request, names[NAME_EVENTS]);
    if (events == NULL) {
        goto done;
    }
    if (events != Py_None && !PyList_CheckExact(events)) {
        goto twin;
    }
    first_ns = Py_NewRef(Py_None);
    /* the last SCHEDULED event; the list is indexed afresh (__eq__ may change it), and the walk
     * ends where it is shorter than the next index */
    for (Py_ssize_t i = events == Py_None ? -1 : PyList_GET_SIZE(events) - 1;
         i >= 0 && i < PyList_GET_SIZE(events); i--) { /* as reversed() walks it */
        PyObject *event = Py_NewRef(PyList_GET_ITEM(events, i));
        PyObject *type = PyObject_GetAttr(event, names[NAME_TYPE]);
        PyObject *compared = type == NULL ? NULL : PyObject_RichCompare(type, scheduled, Py_EQ);
        int same = compared == NULL ? -1 : PyObject_IsTrue(compared);
        Py_XDECREF(type);
        Py_XDECREF(compared);
        if (same > 0) {
            PyObject *stamp = PyObject_GetAttr(event, names[NAME_TIMESTAMP]);
            PyObject *scaled = stamp == NULL ? NULL : PyNumber_Multiply(stamp, ns_per_s);
            PyObject *whole = scaled == NULL ? NULL : PyNumber_Long(scaled);
            Py_XDECREF(stamp);
            Py_XDECREF(scaled);
            same = whole == NULL ? -1 : 1;
            if (whole != NULL) {
                Py_SETREF(first_ns, whole);
            }
        }
        Py_DECREF(event);
        if (same < 0) {
            goto done;
        }
        if (same > 0) {
            break;
        }
    }
    PyObject *fields[] = {ids[0], ids[1], ids[2], first_ns};
    answer = PyObject_Vectorcall(tracked_type, fields, 4, NULL);
    goto done;
twin:
    answer = PyObject_CallOneArg(twin, request);
done:
    Py_XDECREF(headers);
    Py_XDECREF(events);
    Py_XDECREF(ids[0]);
    Py_XDECREF(ids[1]);
    Py_XDECREF(ids[2]);
    Py_XDECREF(first_ns);
    return answer;
}

/* track_request(parts, request) -> _TrackedRequest | None: vllm_engine._track's answer. */
static PyObject *track_request(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "track_request takes 2 arguments");
        return NULL;
    }
    return track_request_parts(args[0], args[1]);
}

/* EngineStepTracer._track_first_seen(scheduler, index, first_seen): each (request id, prompt
 * tokens) of first_seen tracked in `requests` (None where not traced). 0, or -1 on an error. */
static int track_first_seen(PyObject *parts, PyObject *requests, PyObject *held,
                            PyObject *index, PyObject *first_seen) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(first_seen); i++) {
        PyObject *pair = PyList_GET_ITEM(first_seen, i);
        PyObject *request_id = PyTuple_GET_ITEM(pair, 0), *tokens = PyTuple_GET_ITEM(pair, 1);
        PyObject *request = PyDict_GetItemWithError(held, request_id); /* borrowed */
        if (request == NULL && PyErr_Occurred()) {
            return -1;
        }
        request = Py_NewRef(request == NULL ? Py_None : request); /* its reading may drop it */
        Py_INCREF(pair);
        PyObject *tracked = track_request_parts(parts, request);
        Py_DECREF(request);
        int failed = tracked == NULL || PyDict_SetItem(requests, request_id, tracked) < 0;
        if (!failed && tracked != Py_None) {
            PyObject *step = PyTuple_Pack(2, index, tokens);
            failed = step == NULL ||
                     PyObject_SetAttr(tracked, names[NAME_REQUEST_ID], request_id) < 0 ||
                     PyObject_SetAttr(tracked, names[NAME_FIRST_STEP], index) < 0 ||
                     append_to_attribute(tracked, names[NAME_PREFILL_STEPS], step) < 0;
            Py_XDECREF(step);
        }
        Py_XDECREF(tracked);
        Py_DECREF(pair);
        if (failed) {
            return -1;
        }
    }
    return 0;
}

enum { WALK_FAILED = -1, WALK_EMPTY = 0, WALK_DONE = 1, WALK_DECLINED = 2 };

/* vllm_engine.step_facts_python's walk: what the step read and changed is the same. WALK_DONE
 * with *step_out (the record) and *finished_out / *first_seen_out (lists, NULL when there are
 * none) set to new references; WALK_EMPTY for a step that scheduled nothing; WALK_DECLINED,
 * having changed nothing, where an input is not of the types it walks; WALK_FAILED with an
 * error set. */
static int walk_step(PyObject *step_type, PyObject *requests, PyObject *scheduler,
                     PyObject *output, PyObject *outputs_by_client, PyObject *index,
                     PyObject *start_ns, PyObject *clock, PyObject **step_out,
                     PyObject **finished_out, PyObject **first_seen_out) {
    if (!PyType_Check(step_type) || !PyType_IsSubtype((PyTypeObject *)step_type, &PyTuple_Type) ||
        !PyDict_CheckExact(requests) || !PyDict_CheckExact(outputs_by_client)) {
        return WALK_DECLINED;
    }
    int result = WALK_FAILED;
    PyObject *scheduled = NULL, *prefill = NULL, *clients = NULL;
    PyObject *finished = NULL, *end_ns = NULL, *total = NULL, *first_seen = NULL;
    PyObject *prefill_tokens = NULL, *counts = NULL, *kv_manager = NULL, *usage = NULL;
    PyObject *kv_usage = NULL, *decode_tokens = NULL, *step = NULL;
    PyObject *prefill_count = NULL, *decode_count = NULL;
    Py_ssize_t prefill_requests = 0;

    /* Everything read first: a decline changes nothing. */
    scheduled = PyObject_GetAttr(output, names[NAME_NUM_SCHEDULED_TOKENS]);
    if (scheduled == NULL) {
        goto done;
    }
    if (!PyDict_CheckExact(scheduled)) {
        result = WALK_DECLINED;
        goto done;
    }
    if (PyDict_GET_SIZE(scheduled) == 0) {
        result = WALK_EMPTY;
        goto done;
    }
    int layout = prefill_ids(output, &prefill);
    if (layout <= 0) {
        result = layout < 0 ? WALK_FAILED : WALK_DECLINED;
        goto done;
    }
    clients = PyDict_Values(outputs_by_client);
    if (clients == NULL) {
        goto done;
    }
    end_ns = Py_NewRef(zero);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(clients); i++) {
        PyObject *client_outputs = PyList_GET_ITEM(clients, i);
        int ended = PyObject_IsTrue(end_ns);
        if (ended < 0) {
            goto done;
        }
        if (!ended) {
            PyObject *timestamp = PyObject_GetAttr(client_outputs, names[NAME_TIMESTAMP]);
            int stamped = timestamp == NULL ? -1 : PyObject_IsTrue(timestamp);
            if (stamped > 0) {
                PyObject *scaled = PyNumber_Multiply(timestamp, ns_per_s);
                PyObject *whole = scaled == NULL ? NULL : PyNumber_Long(scaled);
                Py_XDECREF(scaled);
                if (whole == NULL) {
                    stamped = -1;
                } else {
                    Py_SETREF(end_ns, whole);
                }
            }
            Py_XDECREF(timestamp);
            if (stamped < 0) {
                goto done;
            }
        }
        PyObject *outputs = PyObject_GetAttr(client_outputs, names[NAME_OUTPUTS]);
        if (outputs == NULL) {
            goto done;
        }
        if (!(PyList_CheckExact(outputs) || PyTuple_CheckExact(outputs))) {
            Py_DECREF(outputs);
            result = WALK_DECLINED;
            goto done;
        }
        int walked = ids_where_set_into(&finished, outputs, names[NAME_FINISH_REASON],
                                        names[NAME_REQUEST_ID]);
        Py_DECREF(outputs);
        if (walked < 0) {
            goto done;
        }
    }
    /* vLLM's total_num_scheduled_tokens, else sum(scheduled.values()) */
    total = optional_attr(output, names[NAME_TOTAL_NUM_SCHEDULED_TOKENS]);
    if (total == NULL) {
        goto done;
    }
    if (!PyLong_CheckExact(total)) {
        Py_SETREF(total, Py_NewRef(zero));
        Py_ssize_t position = 0;
        PyObject *key, *value;
        while (PyDict_Next(scheduled, &position, &key, &value)) {
            Py_INCREF(value);
            PyObject *sum = PyNumber_Add(total, value);
            Py_DECREF(value);
            if (sum == NULL) {
                goto done;
            }
            Py_SETREF(total, sum);
        }
    }

    /* The prefill steps recorded; a request is first seen in its first prefill step. */
    prefill_tokens = Py_NewRef(zero);
    if (prefill != NULL) {
        PyObject *iterator = PyObject_GetIter(prefill);
        if (iterator == NULL) {
            goto done;
        }
        PyObject *request_id;
        while ((request_id = PyIter_Next(iterator)) != NULL) {
            int failed = 1;
            PyObject *tokens = PyDict_GetItemWithError(scheduled, request_id); /* borrowed */
            if (tokens == NULL) {
                failed = PyErr_Occurred() != NULL;
                Py_DECREF(request_id);
                if (failed) {
                    break;
                }
                continue;
            }
            Py_INCREF(tokens);
            prefill_requests++;
            PyObject *sum = PyNumber_Add(prefill_tokens, tokens);
            if (sum != NULL) {
                Py_SETREF(prefill_tokens, sum);
                PyObject *tracked = PyDict_GetItemWithError(requests, request_id); /* borrowed */
                if (tracked == NULL && !PyErr_Occurred()) {
                    PyObject *pair = PyTuple_Pack(2, request_id, tokens);
                    if (pair != NULL && first_seen == NULL) {
                        first_seen = PyList_New(0);
                    }
                    failed = pair == NULL || first_seen == NULL ||
                             PyList_Append(first_seen, pair) < 0;
                    Py_XDECREF(pair);
                } else if (tracked == Py_None) {
                    failed = 0;
                } else if (tracked != NULL) {
                    PyObject *pair = PyTuple_Pack(2, index, tokens);
                    failed = pair == NULL ||
                             append_to_attribute(tracked, names[NAME_PREFILL_STEPS], pair) < 0;
                    Py_XDECREF(pair);
                }
            }
            Py_DECREF(tokens);
            Py_DECREF(request_id);
            if (failed) {
                break;
            }
        }
        Py_DECREF(iterator);
        if (PyErr_Occurred()) {
            goto done;
        }
    }

    /* The step's record. */
    int ended = PyObject_IsTrue(end_ns);
    if (ended < 0) {
        goto done;
    }
    if (!ended) {
        Py_SETREF(end_ns, PyObject_CallNoArgs(clock));
        if (end_ns == NULL) {
            goto done;
        }
    }
    int later = PyObject_RichCompareBool(start_ns, end_ns, Py_GT); /* max(end_ns, start_ns) */
    if (later < 0) {
        goto done;
    }
    if (later) {
        Py_SETREF(end_ns, Py_NewRef(start_ns));
    }
    PyObject *got = PyObject_CallMethodNoArgs(scheduler, names[NAME_GET_REQUEST_COUNTS]);
    counts = got == NULL ? NULL : PySequence_Tuple(got);
    Py_XDECREF(got);
    if (counts == NULL) {
        goto done;
    }
    if (PyTuple_GET_SIZE(counts) != 2) {
        PyErr_Format(PyExc_ValueError, "get_request_counts() gave %zd values, not 2",
                     PyTuple_GET_SIZE(counts));
        goto done;
    }
    kv_manager = PyObject_GetAttr(scheduler, names[NAME_KV_CACHE_MANAGER]);
    usage = kv_manager == NULL ? NULL : PyObject_GetAttr(kv_manager, names[NAME_USAGE]);
    kv_usage = usage == NULL ? NULL : PyNumber_Float(usage);
    decode_tokens = kv_usage == NULL ? NULL : PyNumber_Subtract(total, prefill_tokens);
    prefill_count = decode_tokens == NULL ? NULL : PyLong_FromSsize_t(prefill_requests);
    decode_count = prefill_count == NULL
                       ? NULL
                       : PyLong_FromSsize_t(PyDict_GET_SIZE(scheduled) - prefill_requests);
    if (decode_count == NULL) {
        goto done;
    }
    /* The record, made as tuple.__new__(step_type, fields) makes it (its Python __new__ is
     * not called); running, waiting = get_request_counts(), and the record holds waiting
     * first. */
    PyObject *fields[] = {
        index,         start_ns,       end_ns,   prefill_count,
        decode_count,  prefill_tokens, decode_tokens, kv_usage,
        PyTuple_GET_ITEM(counts, 1), PyTuple_GET_ITEM(counts, 0), scheduled,
        prefill == NULL ? no_prefill : prefill,
    };
    const Py_ssize_t field_count = sizeof(fields) / sizeof(fields[0]);
    step = ((PyTypeObject *)step_type)->tp_alloc((PyTypeObject *)step_type, field_count);
    if (step != NULL) {
        for (Py_ssize_t i = 0; i < field_count; i++) {
            PyTuple_SET_ITEM(step, i, Py_NewRef(fields[i]));
        }
        /* Out of the cycle collector's sight: the ring holds thousands of records, which every
         * full collection would otherwise walk (vLLM freezes its start-up heap, so they are a
         * large part of what is left). Neither can be in a cycle: the record holds numbers,
         * vLLM's dict of strings to numbers (tracked, and walked, on its own) and a set of
         * strings made here. */
        if (((PyTypeObject *)step_type)->tp_dictoffset == 0) { /* no attributes of its own */
            PyObject_GC_UnTrack(step);
        }
        if (prefill != NULL) {
            PyObject_GC_UnTrack(prefill);
        }
        *step_out = step;
        *finished_out = finished;
        *first_seen_out = first_seen;
        step = finished = first_seen = NULL;
        result = WALK_DONE;
    }
done:
    Py_XDECREF(scheduled);
    Py_XDECREF(prefill);
    Py_XDECREF(clients);
    Py_XDECREF(finished);
    Py_XDECREF(end_ns);
    Py_XDECREF(total);
    Py_XDECREF(first_seen);
    Py_XDECREF(prefill_tokens);
    Py_XDECREF(counts);
    Py_XDECREF(kv_manager);
    Py_XDECREF(usage);
    Py_XDECREF(kv_usage);
    Py_XDECREF(decode_tokens);
    Py_XDECREF(prefill_count);
    Py_XDECREF(decode_count);
    Py_XDECREF(step);
    return result;
}

/* step_facts(step_type, requests, scheduler, output, outputs_by_client, index, start_ns, clock)
 *     -> (step, finished, first_seen) | () | None
 *
 * vllm_engine.step_facts_python in one call: what the step read and changed is the same; it
 * answers None (having changed nothing) where an input is not of the types it walks. */
static PyObject *compute_step_facts(PyObject *step_type, PyObject *requests, PyObject *scheduler,
                                    PyObject *output, PyObject *outputs_by_client,
                                    PyObject *index, PyObject *start_ns, PyObject *clock) {
    PyObject *step = NULL, *finished = NULL, *first_seen = NULL;
    switch (walk_step(step_type, requests, scheduler, output, outputs_by_client, index, start_ns,
                      clock, &step, &finished, &first_seen)) {
    case WALK_EMPTY:
        return PyTuple_New(0);
    case WALK_DECLINED:
        Py_RETURN_NONE;
    case WALK_DONE:
        break;
    default:
        return NULL;
    }
    if (finished == NULL) {
        finished = PyList_New(0);
    }
    if (first_seen == NULL) {
        first_seen = PyList_New(0);
    }
    PyObject *facts = finished == NULL || first_seen == NULL
                          ? NULL
                          : PyTuple_Pack(3, step, finished, first_seen);
    Py_DECREF(step);
    Py_XDECREF(finished);
    Py_XDECREF(first_seen);
    return facts;
}

static PyObject *step_facts(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "step_facts takes 8 arguments");
        return NULL;
    }
    return compute_step_facts(args[0], args[1], args[2], args[3], args[4], args[5], args[6],
                              args[7]);
}

/* ---- The step hooks: vLLM's Scheduler.schedule / update_from_output, patched in C ----------
 *
 * `step_hook(...)` returns the function put in the scheduler class in place of one of the two
 * methods (patching.Patch.direct): it calls vLLM's method and then records the step, with no
 * Python frame of ours between (a Python patch and the tracer's methods cost ~20,000
 * instructions a step; bench/engine_step_instructions.py). What it does is the Python twins'
 * (vllm.VllmInstrumentor._schedule_patch / _update_from_output_patch calling
 * EngineStepTracer.on_scheduled / on_step_done): the same gate, the same records, the same
 * errors caught (Exception and its subclasses, reported to the guard's `failed` as the
 * exception being handled); Python is called back only once per request (its first prefill
 * step: `_track_first_seen`; its finish: the emitter's `submit`), per sampled step and per
 * sweep. A step the C walk declines (step_facts answers None) goes to the tracer's
 * on_step_done. The tracer's parts it uses are read once, when the hook is made.
 */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict; /* functools.update_wrapper's names, the patch mark */
    int updates;    /* 0: schedule, 1: update_from_output */
    PyObject *original;
    PyObject *gate;     /* tracing is on while gate._active is true */
    PyObject *disabled; /* the guard's set of disabled hook names */
    PyObject *failed;   /* the guard's failed(name) */
    PyObject *name;     /* this hook's name */
    PyObject *other;    /* the other step hook's: either one disabled stops the schedule hook */
    PyObject *tracer;
    PyObject *step_type;
    PyObject *open;     /* tracer._open: id(scheduler output) -> start ns */
    PyObject *requests; /* tracer._requests */
    PyObject *ring;     /* tracer._ring */
    double sample_rate;
    Py_ssize_t steps_to_sample; /* unsampled steps before the next sampled one; -1: not drawn */
    PyObject *random;
    PyObject *clock;    /* tracer.clock */
    int native_clock;   /* the clock is time.monotonic_ns: CLOCK_MONOTONIC read here */
    Py_ssize_t max_open_steps;    /* vllm_engine._MAX_OPEN_STEPS */
    Py_ssize_t sweep_every_steps; /* vllm_engine._SWEEP_EVERY_STEPS */
    PyObject *submit;
    PyObject *plan_request;
    PyObject *plan_sampled_step;
    PyObject *track_first_seen;
    PyObject *track_parts; /* vllm_engine._TRACK_PARTS */
    PyObject *sweep;
} StepHook;


enum {
    HNAME_ACTIVE,
    HNAME_NEXT_INDEX,
    HNAME_SAMPLED_STEPS,
    HNAME_LAST_STEP,
    HNAME_REQUESTS,
    HNAME_ON_STEP_DONE,
    HNAME_SCHEDULER_OUTPUT,
    HNAME_COUNT,
};
static const char *const hook_name_strings[HNAME_COUNT] = {
    "_active", "_next_index", "sampled_steps", "last_step", "requests", "on_step_done",
    "scheduler_output",
};
static PyObject *hook_names[HNAME_COUNT];
static PyObject *partial_type; /* functools.partial */

static int report_failure(StepHook *self) {
    return report_failure_to(self->failed, self->name, (PyObject *)self);
}

/* 1 when the hook records, 0 when it only calls vLLM's method, -1 on an error. */
static int hook_on(StepHook *self) {
    PyObject *active = PyObject_GetAttr(self->gate, hook_names[HNAME_ACTIVE]);
    int on = active == NULL ? -1 : PyObject_IsTrue(active);
    Py_XDECREF(active);
    if (on <= 0 || PySet_GET_SIZE(self->disabled) == 0) {
        return on;
    }
    int off = PySet_Contains(self->disabled, self->name);
    if (off == 0 && !self->updates) {
        off = PySet_Contains(self->disabled, self->other);
    }
    return off < 0 ? -1 : !off;
}

static PyObject *clock_now(StepHook *self) {
    if (self->native_clock) {
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        return PyLong_FromLongLong((long long)now.tv_sec * 1000000000LL + now.tv_nsec);
    }
    return PyObject_CallNoArgs(self->clock);
}

static PyObject *schedule_hook(StepHook *self, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames) {
    int on = hook_on(self);
    PyObject *start_ns = NULL;
    if (on > 0) {
        start_ns = clock_now(self);
        if (start_ns == NULL) {
            on = -1;
        }
    }
    if (on < 0 && report_failure(self) < 0) {
        return NULL;
    }
    PyObject *output = PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    if (start_ns == NULL || output == NULL) {
        Py_XDECREF(start_ns);
        return output;
    }
    /* tracer.on_scheduled(output, start_ns) */
    if (PyDict_GET_SIZE(self->open) >= self->max_open_steps) {
        PyDict_Clear(self->open); /* updates that never came */
    }
    PyObject *key = PyLong_FromVoidPtr(output);
    int stored = key == NULL ? -1 : PyDict_SetItem(self->open, key, start_ns);
    Py_XDECREF(key);
    Py_DECREF(start_ns);
    if (stored < 0 && report_failure(self) < 0) {
        Py_DECREF(output);
        return NULL;
    }
    return output;
}

/* `counter` on the tracer, plus one. */
static int count_on(PyObject *tracer, PyObject *counter) {
    PyObject *value = PyObject_GetAttr(tracer, counter);
    PyObject *more = value == NULL ? NULL : PyNumber_Add(value, one);
    Py_XDECREF(value);
    int set = more == NULL ? -1 : PyObject_SetAttr(tracer, counter, more);
    Py_XDECREF(more);
    return set;
}

/* submit(partial(plan, item)) */
static int submit_plan(StepHook *self, PyObject *plan, PyObject *item) {
    PyObject *job = PyObject_CallFunctionObjArgs(partial_type, plan, item, NULL);
    PyObject *done = job == NULL ? NULL : PyObject_CallOneArg(self->submit, job);
    Py_XDECREF(job);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

/* The unsampled steps before the next sampled one, drawn once per sampled step instead of a
 * draw per step (each step still sampled with probability sample_rate, independently: the gap
 * between Bernoulli successes is geometric), from the tracer's seeded random(). */
static int draw_steps_to_sample(StepHook *self) {
    if (self->sample_rate >= 1.0) {
        self->steps_to_sample = 0;
        return 0;
    }
    PyObject *drawn = PyObject_CallNoArgs(self->random);
    double value = drawn == NULL ? -1.0 : PyFloat_AsDouble(drawn);
    Py_XDECREF(drawn);
    if (value == -1.0 && PyErr_Occurred()) {
        return -1;
    }
    /* floor(log(1 - U) / log(1 - p)) for U in [0, 1): geometric on 0, 1, 2, ... */
    double gap = floor(log1p(-value) / log1p(-self->sample_rate));
    self->steps_to_sample = gap < (double)(PY_SSIZE_T_MAX / 2) ? (Py_ssize_t)gap
                                                                : PY_SSIZE_T_MAX / 2;
    return 0;
}

/* EngineStepTracer.on_step_done(scheduler, output, outputs_by_client) with its _store. */
static int record_step(StepHook *self, PyObject *scheduler, PyObject *output,
                       PyObject *outputs_by_client) {
    PyObject *key = PyLong_FromVoidPtr(output);
    if (key == NULL) {
        return -1;
    }
    PyObject *start_ns = PyDict_GetItemWithError(self->open, key); /* borrowed */
    if (start_ns == NULL) {
        Py_DECREF(key);
        return PyErr_Occurred() ? -1 : 0;
    }
    Py_INCREF(start_ns);
    int answer = -1;
    PyObject *index = NULL, *step = NULL, *finished = NULL, *first_seen = NULL, *next = NULL;
    index = PyObject_GetAttr(self->tracer, hook_names[HNAME_NEXT_INDEX]);
    if (index == NULL) {
        goto done;
    }
    int walked = walk_step(self->step_type, self->requests, scheduler, output,
                           outputs_by_client, index, start_ns, self->clock, &step, &finished,
                           &first_seen);
    if (walked == WALK_FAILED) {
        goto done;
    }
    if (walked == WALK_DECLINED) { /* not what the C walk reads: the twin's step */
        PyObject *twin = PyObject_CallMethodObjArgs(self->tracer, hook_names[HNAME_ON_STEP_DONE],
                                                    scheduler, output, outputs_by_client, NULL);
        Py_XDECREF(twin);
        answer = twin == NULL ? -1 : 0;
        goto done;
    }
    if (PyDict_DelItem(self->open, key) < 0) {
        goto done;
    }
    if (walked == WALK_EMPTY) { /* scheduled nothing */
        answer = 0;
        goto done;
    }
    Py_ssize_t number = PyLong_AsSsize_t(index);
    if (number < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "negative step index");
        }
        goto done;
    }
    next = PyNumber_Add(index, one);
    if (next == NULL || PyObject_SetAttr(self->tracer, hook_names[HNAME_NEXT_INDEX], next) < 0) {
        goto done;
    }
    if (first_seen != NULL) {
        /* vLLM's requests; a request that finished in this step is gone from it */
        PyObject *held = PyObject_GetAttr(scheduler, hook_names[HNAME_REQUESTS]);
        int tracked = -1;
        if (held != NULL && PyDict_CheckExact(held)) {
            tracked = track_first_seen(self->track_parts, self->requests, held, index,
                                       first_seen);
        } else if (held != NULL) { /* not a dict: the Python method reads it */
            PyObject *done = PyObject_CallFunctionObjArgs(self->track_first_seen, scheduler,
                                                          index, first_seen, NULL);
            tracked = done == NULL ? -1 : 0;
            Py_XDECREF(done);
        }
        Py_XDECREF(held);
        if (tracked < 0) {
            goto done;
        }
    }
    /* _store(step, finished) */
    Py_ssize_t size = PyList_GET_SIZE(self->ring);
    if (size < 1) {
        PyErr_SetString(PyExc_ValueError, "the step ring is empty");
        goto done;
    }
    PyList_SetItem(self->ring, number % size, Py_NewRef(step));
    if (self->sample_rate > 0.0) {
        if (self->steps_to_sample < 0 && draw_steps_to_sample(self) < 0) { /* the first step */
            goto done;
        }
        int sampled = self->steps_to_sample == 0;
        if (!sampled) {
            self->steps_to_sample--;
        } else if (draw_steps_to_sample(self) < 0) { /* the gap after this one */
            goto done;
        }
        if (sampled && (count_on(self->tracer, hook_names[HNAME_SAMPLED_STEPS]) < 0 ||
                        submit_plan(self, self->plan_sampled_step, step) < 0)) {
            goto done;
        }
    }
    for (Py_ssize_t i = 0; finished != NULL && i < PyList_GET_SIZE(finished); i++) {
        PyObject *request_id = PyList_GET_ITEM(finished, i);
        PyObject *tracked = PyDict_GetItemWithError(self->requests, request_id); /* borrowed */
        if (tracked == NULL) {
            if (PyErr_Occurred()) {
                goto done;
            }
            continue;
        }
        Py_INCREF(tracked);
        int handed = PyDict_DelItem(self->requests, request_id);
        if (handed == 0 && tracked != Py_None) {
            handed = PyObject_SetAttr(tracked, hook_names[HNAME_LAST_STEP], index) < 0 ||
                             submit_plan(self, self->plan_request, tracked) < 0
                         ? -1
                         : 0;
        }
        Py_DECREF(tracked);
        if (handed < 0) {
            goto done;
        }
    }
    if ((number + 1) % self->sweep_every_steps == 0) {
        PyObject *held = PyObject_GetAttr(scheduler, hook_names[HNAME_REQUESTS]);
        PyObject *swept = held == NULL ? NULL : PyObject_CallOneArg(self->sweep, held);
        Py_XDECREF(held);
        if (swept == NULL) {
            goto done;
        }
        Py_DECREF(swept);
    }
    answer = 0;
done:
    Py_DECREF(key);
    Py_DECREF(start_ns);
    Py_XDECREF(index);
    Py_XDECREF(step);
    Py_XDECREF(finished);
    Py_XDECREF(first_seen);
    Py_XDECREF(next);
    return answer;
}

static PyObject *update_hook(StepHook *self, PyObject *const *args, size_t nargsf,
                             PyObject *kwnames) {
    PyObject *result = PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    if (result == NULL) {
        return NULL;
    }
    int on = hook_on(self);
    if (on > 0) {
        /* (scheduler, scheduler_output, ...) or scheduler_output by keyword */
        Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
        PyObject *output = nargs >= 2 ? args[1] : NULL;
        for (Py_ssize_t i = 0; output == NULL && kwnames != NULL && i < PyTuple_GET_SIZE(kwnames);
             i++) {
            int same = PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, i),
                                         hook_names[HNAME_SCHEDULER_OUTPUT]);
            if (same == 0) {
                output = args[nargs + i];
            }
        }
        if (nargs < 1 || output == NULL) {
            PyErr_SetString(PyExc_KeyError, "scheduler_output");
            on = -1;
        } else if (record_step(self, args[0], output, result) < 0) {
            on = -1;
        }
    }
    if (on < 0 && report_failure(self) < 0) {
        Py_DECREF(result);
        return NULL;
    }
    return result;
}

static PyObject *step_hook_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                      PyObject *kwnames) {
    StepHook *self = (StepHook *)callable;
    return self->updates ? update_hook(self, args, nargsf, kwnames)
                         : schedule_hook(self, args, nargsf, kwnames);
}

/* A method: bound to the scheduler it is read from (LOAD_METHOD skips the binding, as for a
 * Python function: Py_TPFLAGS_METHOD_DESCRIPTOR). */
static PyObject *method_get(PyObject *self, PyObject *instance, PyObject *owner) {
    (void)owner;
    if (instance == NULL || instance == Py_None) {
        return Py_NewRef(self);
    }
    return PyMethod_New(self, instance);
}

static int step_hook_traverse(StepHook *self, visitproc visit, void *arg) {
    Py_VISIT(self->dict);
    Py_VISIT(self->original);
    Py_VISIT(self->gate);
    Py_VISIT(self->disabled);
    Py_VISIT(self->failed);
    Py_VISIT(self->name);
    Py_VISIT(self->other);
    Py_VISIT(self->tracer);
    Py_VISIT(self->step_type);
    Py_VISIT(self->open);
    Py_VISIT(self->requests);
    Py_VISIT(self->ring);
    Py_VISIT(self->random);
    Py_VISIT(self->clock);
    Py_VISIT(self->submit);
    Py_VISIT(self->plan_request);
    Py_VISIT(self->plan_sampled_step);
    Py_VISIT(self->track_first_seen);
    Py_VISIT(self->track_parts);
    Py_VISIT(self->sweep);
    return 0;
}

static int step_hook_clear(StepHook *self) {
    Py_CLEAR(self->dict);
    Py_CLEAR(self->original);
    Py_CLEAR(self->gate);
    Py_CLEAR(self->disabled);
    Py_CLEAR(self->failed);
    Py_CLEAR(self->name);
    Py_CLEAR(self->other);
    Py_CLEAR(self->tracer);
    Py_CLEAR(self->step_type);
    Py_CLEAR(self->open);
    Py_CLEAR(self->requests);
    Py_CLEAR(self->ring);
    Py_CLEAR(self->random);
    Py_CLEAR(self->clock);
    Py_CLEAR(self->submit);
    Py_CLEAR(self->plan_request);
    Py_CLEAR(self->plan_sampled_step);
    Py_CLEAR(self->track_first_seen);
    Py_CLEAR(self->track_parts);
    Py_CLEAR(self->sweep);
    return 0;
}

static void step_hook_dealloc(StepHook *self) {
    PyObject_GC_UnTrack(self);
    step_hook_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyGetSetDef dict_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject StepHookType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tokentrace.agent._steps.StepHook",
    .tp_doc = "vLLM's Scheduler.schedule or update_from_output, and the step's record.",
    .tp_basicsize = sizeof(StepHook),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_vectorcall_offset = offsetof(StepHook, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = method_get,
    .tp_dictoffset = offsetof(StepHook, dict),
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
    .tp_getset = dict_getset,
    .tp_traverse = (traverseproc)step_hook_traverse,
    .tp_clear = (inquiry)step_hook_clear,
    .tp_dealloc = (destructor)step_hook_dealloc,
};

/* getattr(tracer, name) into *slot; 0, or -1 with an error set. */
static int read_part(PyObject *tracer, const char *name, PyObject **slot) {
    *slot = PyObject_GetAttrString(tracer, name);
    return *slot == NULL ? -1 : 0;
}

/* step_hook(updates, original, tracer, step_type, gate, guard, name, other, native_clock,
 *           max_open_steps, sweep_every_steps) */
static PyObject *step_hook(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "step_hook takes 11 arguments");
        return NULL;
    }
    StepHook *self = PyObject_GC_New(StepHook, &StepHookType);
    if (self == NULL) {
        return NULL;
    }
    memset((char *)self + offsetof(StepHook, vectorcall), 0,
           sizeof(StepHook) - offsetof(StepHook, vectorcall));
    self->vectorcall = step_hook_vectorcall;
    self->steps_to_sample = -1;
    PyObject_GC_Track(self);
    PyObject *tracer = args[2], *guard = args[5], *sample_rate = NULL;
    self->updates = PyObject_IsTrue(args[0]);
    self->native_clock = PyObject_IsTrue(args[8]);
    self->max_open_steps = PyLong_AsSsize_t(args[9]);
    self->sweep_every_steps = PyLong_AsSsize_t(args[10]);
    if (self->max_open_steps < 1 || self->sweep_every_steps < 1) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "step_hook: the step bounds must be >= 1");
        }
        Py_DECREF(self);
        return NULL;
    }
    self->original = Py_NewRef(args[1]);
    self->tracer = Py_NewRef(tracer);
    self->step_type = Py_NewRef(args[3]);
    self->gate = Py_NewRef(args[4]);
    self->name = Py_NewRef(args[6]);
    self->other = Py_NewRef(args[7]);
    if (self->updates < 0 || self->native_clock < 0 ||
        read_part(guard, "disabled", &self->disabled) < 0 ||
        read_part(guard, "failed", &self->failed) < 0 ||
        read_part(tracer, "_open", &self->open) < 0 ||
        read_part(tracer, "_requests", &self->requests) < 0 ||
        read_part(tracer, "_ring", &self->ring) < 0 ||
        read_part(tracer, "_random", &self->random) < 0 ||
        read_part(tracer, "clock", &self->clock) < 0 ||
        read_part(tracer, "_submit", &self->submit) < 0 ||
        read_part(tracer, "plan_request", &self->plan_request) < 0 ||
        read_part(tracer, "plan_sampled_step", &self->plan_sampled_step) < 0 ||
        read_part(tracer, "_track_first_seen", &self->track_first_seen) < 0 ||
        read_part(tracer, "_track_parts", &self->track_parts) < 0 ||
        read_part(tracer, "_sweep", &self->sweep) < 0 ||
        read_part(tracer, "_sample_rate", &sample_rate) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->sample_rate = PyFloat_AsDouble(sample_rate);
    Py_DECREF(sample_rate);
    if (self->sample_rate == -1.0 && PyErr_Occurred()) {
        Py_DECREF(self);
        return NULL;
    }
    if (!PySet_Check(self->disabled) || !PyDict_CheckExact(self->open) ||
        !PyDict_CheckExact(self->requests) || !PyList_CheckExact(self->ring) ||
        !PyType_Check(self->step_type)) {
        PyErr_SetString(PyExc_TypeError,
                        "step_hook: the guard's disabled set, the tracer's _open and _requests "
                        "dicts, its _ring list and a step type are needed");
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* ---- vLLM's frontend: OutputProcessor.process_outputs, once per engine step in the API server ---
 *
 * `outputs_hook` makes the function put in vLLM's OutputProcessor class in place of
 * process_outputs: what FrontendRequestHooks._process_outputs_patch's Python patch (its twin, in
 * vllm_requests.py) does, with no Python frame between vLLM's caller and vLLM's method. Before
 * vLLM's call it finds the traced requests among the step's outputs (with vLLM's state of each,
 * which vLLM drops for a request that finishes during the call); after it, each one's new tokens
 * get the step's EngineCore timestamp, its events go to `_apply_events` and a finished one to
 * the hooks' `_finish` (Python: once per request, and per step only where vLLM sent events).
 * A call not shaped (processor, list of outputs[, timestamp, ...][, other keywords]) goes to the
 * twin. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;          /* functools.update_wrapper's names, the patch mark */
    PyObject *original;      /* vLLM's process_outputs */
    PyObject *twin;          /* the Python patch */
    PyObject *gate;          /* tracing while gate._active is true */
    PyObject *in_flight;     /* the recorder's dict: request id -> RequestTimer */
    PyObject *clock;         /* the recorder's clock, for a step without a timestamp */
    PyObject *disabled;      /* the guard's set of disabled hook names */
    PyObject *failed;        /* the guard's failed(name) */
    PyObject *name;          /* this hook's name */
    PyObject *request_hooks; /* a tuple of names: any of them disabled stops this hook */
    PyObject *apply_events;  /* vllm_requests._apply_events(timer, events) */
    PyObject *finish;        /* the hooks' _finish(timer, state, reason) */
} OutputsHook;

/* 1 when the hook records, 0 when it only calls vLLM's method, -1 on an error. */
static int outputs_hook_on(OutputsHook *self) {
    if (PyDict_GET_SIZE(self->in_flight) == 0) {
        return 0;
    }
    PyObject *active = PyObject_GetAttr(self->gate, hook_names[HNAME_ACTIVE]);
    int on = active == NULL ? -1 : PyObject_IsTrue(active);
    Py_XDECREF(active);
    if (on <= 0 || PySet_GET_SIZE(self->disabled) == 0) {
        return on;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->request_hooks); i++) {
        int off = PySet_Contains(self->disabled, PyTuple_GET_ITEM(self->request_hooks, i));
        if (off != 0) {
            return off < 0 ? -1 : 0;
        }
    }
    return 1;
}

/* states.get(key) as a new reference (None when absent), NULL with an error set. */
static PyObject *mapping_get(PyObject *states, PyObject *key) {
    if (PyDict_CheckExact(states)) {
        PyObject *value = PyDict_GetItemWithError(states, key);
        if (value == NULL) {
            return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
        }
        return Py_NewRef(value);
    }
    return PyObject_CallMethod(states, "get", "O", key);
}

static void release_held(PyObject **held, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_DECREF(held[i]);
    }
    PyMem_Free(held);
}

enum { HELD_OUTPUT, HELD_TIMER, HELD_STATE, HELD_REQUEST_ID, HELD_WIDTH };

/* The traced requests among `outputs` (a list): HELD_WIDTH references each into *held (grown as
 * needed), their number in *count. 0, or -1 with an error set (what was held stays counted). */
static int find_traced(OutputsHook *self, PyObject *processor, PyObject *outputs, PyObject ***held,
                       Py_ssize_t *count) {
    PyObject *states = NULL;
    Py_ssize_t capacity = 0;
    /* A list may change length under attribute code: index it afresh each time. */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(outputs); i++) {
        PyObject *output = Py_NewRef(PyList_GET_ITEM(outputs, i));
        PyObject *request_id = PyObject_GetAttr(output, names[NAME_REQUEST_ID]);
        PyObject *timer = request_id == NULL
                              ? NULL
                              : PyDict_GetItemWithError(self->in_flight, request_id);
        if (timer == NULL) {
            Py_DECREF(output);
            Py_XDECREF(request_id);
            if (PyErr_Occurred()) {
                Py_XDECREF(states);
                return -1;
            }
            continue;
        }
        Py_INCREF(timer);
        if (states == NULL) {
            states = PyObject_GetAttr(processor, names[NAME_REQUEST_STATES]);
        }
        PyObject *state = states == NULL ? NULL : mapping_get(states, request_id);
        if (state != NULL && *count + HELD_WIDTH > capacity) {
            Py_ssize_t more = capacity + HELD_WIDTH * (PyList_GET_SIZE(outputs) - i);
            PyObject **grown = PyMem_Realloc(*held, (size_t)more * sizeof(PyObject *));
            if (grown == NULL) {
                PyErr_NoMemory();
                Py_CLEAR(state);
            } else {
                *held = grown;
                capacity = more;
            }
        }
        if (state == NULL) {
            Py_DECREF(output);
            Py_DECREF(request_id);
            Py_DECREF(timer);
            Py_XDECREF(states);
            return -1;
        }
        PyObject **slot = *held + *count;
        slot[HELD_OUTPUT] = output;
        slot[HELD_TIMER] = timer;
        slot[HELD_STATE] = state;
        slot[HELD_REQUEST_ID] = request_id;
        *count += HELD_WIDTH;
    }
    Py_XDECREF(states);
    return 0;
}

/* After vLLM's call: each traced request's new tokens, events and finish. 0, or -1 with an error
 * set (the requests after the failing one are left, as the twin's loop leaves them). */
static int after_outputs(OutputsHook *self, PyObject *processor, PyObject *timestamp,
                         PyObject **held, Py_ssize_t count) {
    /* One timestamp for the whole step: EngineCore's, taken after the model ran. */
    PyObject *step_ns;
    if (timestamp == Py_None) {
        step_ns = PyObject_CallNoArgs(self->clock);
    } else {
        PyObject *scaled = PyNumber_Multiply(timestamp, ns_per_s);
        step_ns = scaled == NULL ? NULL : PyNumber_Long(scaled);
        Py_XDECREF(scaled);
    }
    PyObject *states = step_ns == NULL
                           ? NULL
                           : PyObject_GetAttr(processor, names[NAME_REQUEST_STATES]);
    int failed = states == NULL ? -1 : 0;
    for (Py_ssize_t i = 0; failed == 0 && i < count; i += HELD_WIDTH) {
        PyObject **slot = held + i;
        /* Read after vLLM's call: a matched stop string trims the surplus tokens in place. */
        PyObject *ids = PyObject_GetAttr(slot[HELD_OUTPUT], names[NAME_NEW_TOKEN_IDS]);
        Py_ssize_t new_tokens = ids == NULL ? -1 : PyObject_Size(ids);
        Py_XDECREF(ids);
        if (new_tokens < 0) {
            failed = -1;
            break;
        }
        if (new_tokens > 0) {
            PyObject *token_ns = PyObject_GetAttr(slot[HELD_TIMER], names[NAME_TOKEN_NS]);
            failed = token_ns == NULL ? -1 : 0;
            for (Py_ssize_t token = 0; failed == 0 && token < new_tokens; token++) {
                failed = append_to(token_ns, step_ns);
            }
            Py_XDECREF(token_ns);
            if (failed < 0) {
                break;
            }
        }
        PyObject *events = PyObject_GetAttr(slot[HELD_OUTPUT], names[NAME_EVENTS]);
        int any = events == NULL ? -1 : PyObject_IsTrue(events);
        if (any > 0) {
            PyObject *done = PyObject_CallFunctionObjArgs(self->apply_events, slot[HELD_TIMER],
                                                          events, NULL);
            any = done == NULL ? -1 : 0;
            Py_XDECREF(done);
        }
        Py_XDECREF(events);
        int held_still = any < 0 ? -1 : PySequence_Contains(states, slot[HELD_REQUEST_ID]);
        if (held_still == 0) {
            PyObject *reason = PyObject_GetAttr(slot[HELD_OUTPUT], names[NAME_FINISH_REASON]);
            PyObject *done = reason == NULL
                                 ? NULL
                                 : PyObject_CallFunctionObjArgs(self->finish, slot[HELD_TIMER],
                                                                slot[HELD_STATE], reason, NULL);
            held_still = done == NULL ? -1 : 1;
            Py_XDECREF(reason);
            Py_XDECREF(done);
        }
        failed = held_still < 0 ? -1 : 0;
    }
    Py_XDECREF(states);
    Py_XDECREF(step_ns);
    return failed;
}

/* Whether the keyword arguments pass what the hook reads (the outputs, the timestamp) by name;
 * others (vLLM's `weight_version`, its iteration stats) pass through unread. */
static int names_the_outputs(PyObject *kwnames) {
    Py_ssize_t count = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        if (PyUnicode_CompareWithASCIIString(name, "engine_core_outputs") == 0 ||
            PyUnicode_CompareWithASCIIString(name, "engine_core_timestamp") == 0) {
            return 1;
        }
    }
    return 0;
}

static PyObject *outputs_hook_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                         PyObject *kwnames) {
    OutputsHook *self = (OutputsHook *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    int on = outputs_hook_on(self);
    if (on < 0 && report_failure_to(self->failed, self->name, callable) < 0) {
        return NULL;
    }
    if (on <= 0) {
        return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    }
    if (nargs < 2 || !PyList_CheckExact(args[1]) || names_the_outputs(kwnames)) {
        return PyObject_Vectorcall(self->twin, args, nargsf, kwnames);
    }
    PyObject *processor = args[0], *timestamp = nargs > 2 ? args[2] : Py_None;
    PyObject **held = NULL;
    Py_ssize_t count = 0;
    if (find_traced(self, processor, args[1], &held, &count) < 0) {
        release_held(held, count);
        held = NULL;
        count = 0;
        if (report_failure_to(self->failed, self->name, callable) < 0) {
            return NULL;
        }
    }
    /* The arguments are the caller's: they stay alive through the call and after it. */
    PyObject *result = PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    if (result != NULL && count > 0 &&
        after_outputs(self, processor, timestamp, held, count) < 0 &&
        report_failure_to(self->failed, self->name, callable) < 0) {
        Py_CLEAR(result);
    }
    release_held(held, count);
    return result;
}

static int outputs_hook_traverse(OutputsHook *self, visitproc visit, void *arg) {
    Py_VISIT(self->dict);
    Py_VISIT(self->original);
    Py_VISIT(self->twin);
    Py_VISIT(self->gate);
    Py_VISIT(self->in_flight);
    Py_VISIT(self->clock);
    Py_VISIT(self->disabled);
    Py_VISIT(self->failed);
    Py_VISIT(self->name);
    Py_VISIT(self->request_hooks);
    Py_VISIT(self->apply_events);
    Py_VISIT(self->finish);
    return 0;
}

static int outputs_hook_clear(OutputsHook *self) {
    Py_CLEAR(self->dict);
    Py_CLEAR(self->original);
    Py_CLEAR(self->twin);
    Py_CLEAR(self->gate);
    Py_CLEAR(self->in_flight);
    Py_CLEAR(self->clock);
    Py_CLEAR(self->disabled);
    Py_CLEAR(self->failed);
    Py_CLEAR(self->name);
    Py_CLEAR(self->request_hooks);
    Py_CLEAR(self->apply_events);
    Py_CLEAR(self->finish);
    return 0;
}

static void outputs_hook_dealloc(OutputsHook *self) {
    PyObject_GC_UnTrack(self);
    outputs_hook_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject OutputsHookType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tokentrace.agent._steps.OutputsHook",
    .tp_doc = "vLLM's OutputProcessor.process_outputs, and each traced request's new tokens.",
    .tp_basicsize = sizeof(OutputsHook),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_vectorcall_offset = offsetof(OutputsHook, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = method_get,
    .tp_dictoffset = offsetof(OutputsHook, dict),
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
    .tp_getset = dict_getset,
    .tp_traverse = (traverseproc)outputs_hook_traverse,
    .tp_clear = (inquiry)outputs_hook_clear,
    .tp_dealloc = (destructor)outputs_hook_dealloc,
};

/* outputs_hook(original, twin, hooks, recorder, guard, name, request_hooks, apply_events) */
static PyObject *outputs_hook(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "outputs_hook takes 8 arguments");
        return NULL;
    }
    if (!PyTuple_CheckExact(args[6])) {
        PyErr_SetString(PyExc_TypeError, "outputs_hook: request_hooks must be a tuple");
        return NULL;
    }
    OutputsHook *self = PyObject_GC_New(OutputsHook, &OutputsHookType);
    if (self == NULL) {
        return NULL;
    }
    memset((char *)self + offsetof(OutputsHook, vectorcall), 0,
           sizeof(OutputsHook) - offsetof(OutputsHook, vectorcall));
    self->vectorcall = outputs_hook_vectorcall;
    PyObject_GC_Track(self);
    PyObject *hooks = args[2], *recorder = args[3], *guard = args[4];
    self->original = Py_NewRef(args[0]);
    self->twin = Py_NewRef(args[1]);
    self->gate = Py_NewRef(hooks);
    self->name = Py_NewRef(args[5]);
    self->request_hooks = Py_NewRef(args[6]);
    self->apply_events = Py_NewRef(args[7]);
    if (read_part(guard, "disabled", &self->disabled) < 0 ||
        read_part(guard, "failed", &self->failed) < 0 ||
        read_part(recorder, "_in_flight", &self->in_flight) < 0 ||
        read_part(recorder, "clock", &self->clock) < 0 ||
        read_part(hooks, "_finish", &self->finish) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    if (!PySet_Check(self->disabled) || !PyDict_CheckExact(self->in_flight)) {
        PyErr_SetString(PyExc_TypeError,
                        "outputs_hook: the guard's disabled set and the recorder's dict of "
                        "requests in flight are needed");
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* --- a finished request's token steps (emitter thread) ------------------------------------------ */

#define RECORD_NUMBER 0   /* StepRecord's fields, by position */
#define RECORD_END_NS 2
#define RECORD_REQUEST_IDS 10
#define RECORD_PREFILL_IDS 11
#define RECORD_FIELDS 12

/* ring[index % len(ring)] when it is the record of step `index`: a borrowed reference, NULL
 * (no error) when it is not (overwritten, never written), NULL with an error when a slot does not
 * hold a StepRecord-shaped tuple or None (*error set to 1). */
static PyObject *record_at(PyObject *ring, Py_ssize_t index, int *error) {
    Py_ssize_t size = PyList_GET_SIZE(ring);
    PyObject *step = PyList_GET_ITEM(ring, index % size);
    if (step == Py_None) {
        return NULL;
    }
    if (!PyTuple_Check(step) || PyTuple_GET_SIZE(step) != RECORD_FIELDS ||
        !PyLong_CheckExact(PyTuple_GET_ITEM(step, RECORD_NUMBER))) {
        *error = 1;
        return NULL;
    }
    Py_ssize_t number = PyLong_AsSsize_t(PyTuple_GET_ITEM(step, RECORD_NUMBER));
    if (number == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        *error = 1;
        return NULL;
    }
    return number == index ? step : NULL;
}

/* Appends (index, step's end ns) to ends. */
static int append_end(PyObject *ends, Py_ssize_t index, PyObject *step) {
    PyObject *end = Py_BuildValue("(nO)", index, PyTuple_GET_ITEM(step, RECORD_END_NS));
    int failed = end == NULL || PyList_Append(ends, end) < 0;
    Py_XDECREF(end);
    return failed ? -1 : 0;
}

/* token_step_ends(ring, first, last, request_id, prefill_step) -> list[tuple[int, int]] | None
 *
 * EngineStepTracer's (index, end ns) of each step that gave a vLLM request a token, in step order
 * (token_step_ends_python, its twin): the ring's steps from `first` to `last` that scheduled
 * `request_id` outside their prefill set, with `prefill_step` (its last prefill step, or None)
 * among them; a step the ring no longer holds clears the ends before it. None where the input is
 * not as the tracer keeps it (the twin answers).
 */
static PyObject *token_step_ends(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "token_step_ends takes 5 arguments");
        return NULL;
    }
    PyObject *ring = args[0], *request_id = args[3], *prefill_arg = args[4];
    if (!PyList_CheckExact(ring) || PyList_GET_SIZE(ring) == 0 || !PyLong_CheckExact(args[1]) ||
        !PyLong_CheckExact(args[2]) || (prefill_arg != Py_None && !PyLong_CheckExact(prefill_arg))) {
        Py_RETURN_NONE;
    }
    Py_ssize_t first = PyLong_AsSsize_t(args[1]), last = PyLong_AsSsize_t(args[2]);
    Py_ssize_t prefill = prefill_arg == Py_None ? -1 : PyLong_AsSsize_t(prefill_arg);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (first < 0 || last < 0 || (prefill_arg != Py_None && prefill < 0)) {
        Py_RETURN_NONE; /* Python's modulo differs below zero: the twin's */
    }
    Py_ssize_t size = PyList_GET_SIZE(ring);
    Py_ssize_t start = last - size + 1 > first ? last - size + 1 : first;
    PyObject *ends = PyList_New(0);
    if (ends == NULL) {
        return NULL;
    }
    int error = 0, prefill_placed = prefill_arg == Py_None;
    for (Py_ssize_t index = start;; index++) {
        /* The prefill step takes its place in step order: before a token step of the same index
         * (as sorted() leaves it, listed first), or last. */
        if (!prefill_placed && (index > last || prefill <= index)) {
            prefill_placed = 1;
            PyObject *step = record_at(ring, prefill, &error);
            if (error) {
                goto not_fast;
            }
            if (step == NULL) { /* gone from the ring: gaps across it would be wrong */
                if (PyList_SetSlice(ends, 0, PyList_GET_SIZE(ends), NULL) < 0) {
                    goto failed;
                }
            } else if (append_end(ends, prefill, step) < 0) {
                goto failed;
            }
        }
        if (index > last) {
            break;
        }
        PyObject *step = record_at(ring, index, &error);
        if (error) {
            goto not_fast;
        }
        if (step == NULL) {
            continue; /* overwritten: the walk keeps only the steps the ring holds */
        }
        int in_batch = PySequence_Contains(PyTuple_GET_ITEM(step, RECORD_REQUEST_IDS), request_id);
        if (in_batch < 0) {
            goto failed;
        }
        if (!in_batch) {
            continue;
        }
        int prefilled = PySequence_Contains(PyTuple_GET_ITEM(step, RECORD_PREFILL_IDS), request_id);
        if (prefilled < 0) {
            goto failed;
        }
        if (!prefilled && append_end(ends, index, step) < 0) {
            goto failed;
        }
    }
    return ends;
not_fast:
    Py_DECREF(ends);
    Py_RETURN_NONE;
failed:
    Py_DECREF(ends);
    return NULL;
}

static int compare_int64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

#define EXACT_DOUBLE_LIMIT (INT64_C(1) << 53) /* ints beyond compare with a float inexactly */

/* outlier_gap_ends(token_step_ends, ratio, min_gaps) -> list[int] | None
 *
 * vllm_engine.outlier_gap_ends_python's answer: the positions i (>= 1) in `token_step_ends`
 * ((step index, end ns) pairs, as token_step_ends makes them) whose gap from the end before is
 * more than `ratio` x the median gap; none below `min_gaps` gaps. None where the input is not a
 * list of 2-tuples of int64 ends, or where a gap is 2**53 ns or more either way (a double would
 * compare it inexactly): the twin answers, with Python's exact ints.
 */
static PyObject *outlier_gap_ends(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "outlier_gap_ends takes 3 arguments");
        return NULL;
    }
    PyObject *ends = args[0];
    if (!PyList_CheckExact(ends) || !PyFloat_CheckExact(args[1]) ||
        !PyLong_CheckExact(args[2])) {
        Py_RETURN_NONE;
    }
    double ratio = PyFloat_AS_DOUBLE(args[1]);
    Py_ssize_t min_gaps = PyLong_AsSsize_t(args[2]);
    if (min_gaps < 1) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t count = PyList_GET_SIZE(ends) - 1; /* gaps */
    if (count < min_gaps) {
        return PyList_New(0);
    }
    int64_t *gaps = PyMem_Malloc(2 * (size_t)count * sizeof(int64_t));
    if (gaps == NULL) {
        return PyErr_NoMemory();
    }
    int64_t *ordered = gaps + count;
    PyObject *answer = NULL;
    int64_t previous = 0;
    for (Py_ssize_t i = 0; i <= count; i++) {
        PyObject *pair = PyList_GET_ITEM(ends, i);
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 ||
            !PyLong_CheckExact(PyTuple_GET_ITEM(pair, 1))) {
            goto twin;
        }
        int overflow = 0;
        long long end = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(pair, 1), &overflow);
        if (overflow || (end == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            goto twin;
        }
        if (i > 0) {
            int64_t gap;
            if (__builtin_sub_overflow((int64_t)end, previous, &gap) || gap >= EXACT_DOUBLE_LIMIT ||
                gap <= -EXACT_DOUBLE_LIMIT) {
                goto twin;
            }
            gaps[i - 1] = ordered[i - 1] = gap;
        }
        previous = (int64_t)end;
    }
    qsort(ordered, (size_t)count, sizeof(int64_t), compare_int64);
    Py_ssize_t middle = count / 2;
    /* As Python's median: the middle gap as a float, or the two middle ones' exact sum halved
     * (a double rounded once: halving it is exact). */
    double median = count % 2 ? (double)ordered[middle]
                              : (double)(ordered[middle - 1] + ordered[middle]) / 2;
    double threshold = ratio * median;
    answer = PyList_New(0);
    if (answer == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if ((double)gaps[i] > threshold) { /* exact: |gap| < 2**53 */
            PyObject *position = PyLong_FromSsize_t(i + 1);
            if (position == NULL || PyList_Append(answer, position) < 0) {
                Py_XDECREF(position);
                Py_CLEAR(answer);
                goto done;
            }
            Py_DECREF(position);
        }
    }
    goto done;
twin:
    answer = Py_NewRef(Py_None);
done:
    PyMem_Free(gaps);
    return answer;
}

static PyMethodDef steps_methods[] = {
    {"step_facts", (PyCFunction)(void (*)(void))step_facts, METH_FASTCALL,
     "step_facts(step_type, requests, scheduler, output, outputs_by_client, index, start_ns, "
     "clock) -> tuple | None"},
    {"track_request", (PyCFunction)(void (*)(void))track_request, METH_FASTCALL,
     "track_request(parts, request) -> _TrackedRequest | None"},
    {"step_hook", (PyCFunction)(void (*)(void))step_hook, METH_FASTCALL,
     "step_hook(updates, original, tracer, step_type, gate, guard, name, other, native_clock, "
     "max_open_steps, sweep_every_steps) -> StepHook"},
    {"outlier_gap_ends", (PyCFunction)(void (*)(void))outlier_gap_ends, METH_FASTCALL,
     "outlier_gap_ends(token_step_ends, ratio, min_gaps) -> list[int] | None"},
    {"token_step_ends", (PyCFunction)(void (*)(void))token_step_ends, METH_FASTCALL,
     "token_step_ends(ring, first, last, request_id, prefill_step) -> list[tuple[int, int]] | "
     "None"},
    {"outputs_hook", (PyCFunction)(void (*)(void))outputs_hook, METH_FASTCALL,
     "outputs_hook(original, twin, hooks, recorder, guard, name, request_hooks, apply_events) "
     "-> OutputsHook"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef steps_module = {
    PyModuleDef_HEAD_INIT, "_steps",
    "The engine-step tracer's per-step work and step hooks (see _steps.c).",
    -1, steps_methods,
};

PyMODINIT_FUNC PyInit__steps(void) {
    for (int i = 0; i < NAME_COUNT; i++) {
        if (names[i] == NULL && (names[i] = PyUnicode_InternFromString(name_strings[i])) == NULL) {
            return NULL;
        }
    }
    if (zero == NULL && (zero = PyLong_FromLong(0)) == NULL) {
        return NULL;
    }
    for (int i = 0; i < HNAME_COUNT; i++) {
        if (hook_names[i] == NULL &&
            (hook_names[i] = PyUnicode_InternFromString(hook_name_strings[i])) == NULL) {
            return NULL;
        }
    }
    if (one == NULL && (one = PyLong_FromLong(1)) == NULL) {
        return NULL;
    }
    if (partial_type == NULL) {
        PyObject *functools = PyImport_ImportModule("functools");
        partial_type = functools == NULL ? NULL : PyObject_GetAttrString(functools, "partial");
        Py_XDECREF(functools);
        if (partial_type == NULL) {
            return NULL;
        }
    }
    if (PyType_Ready(&StepHookType) < 0 || PyType_Ready(&OutputsHookType) < 0) {
        return NULL;
    }
    if (ns_per_s == NULL && (ns_per_s = PyLong_FromLong(1000000000L)) == NULL) {
        return NULL;
    }
    if (no_prefill == NULL && (no_prefill = PyFrozenSet_New(NULL)) == NULL) {
        return NULL;
    }
    return PyModule_Create(&steps_module);
}
