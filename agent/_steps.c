/* The engine-step tracer's per-step work in C (tokentrace.agent.frameworks.vllm_engine).
 *
 * EngineCore's busy loop calls the tracer once per step, at the step's update, and the tracer
 * reads the step: its prefill requests (recorded per request), and its outputs (the finished
 * ones); decoding requests cost nothing per step but their output's finish reason (their token
 * steps are found in the ring when they finish). `step_facts` does the whole step's reading and
 * recording, which in Python costs a few µs on the serving thread, mostly in Python calls; here
 * a fraction. Its Python twin in vllm_engine.py gives the same answers; it returns None where
 * its input is not of the types it walks (the twin then answers), before it changes anything.
 * Unlike _wire.c it reads attributes, which may run Python code of the host's objects; errors it
 * raises propagate (the tracer's hook guard catches them).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

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

/* Appends to the list `found` getattr(item, name) of each item of the list or tuple `items`
 * whose attribute `flag` is not None, in order. */
static int ids_where_set_into(PyObject *found, PyObject *items, PyObject *flag, PyObject *name) {
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
            int appended = id == NULL ? -1 : PyList_Append(found, id);
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
    NAME_COUNT,
};
static const char *const name_strings[NAME_COUNT] = {
    "num_scheduled_tokens", "scheduled_new_reqs", "scheduled_cached_reqs", "req_ids",
    "num_output_tokens",    "req_id",             "timestamp",             "outputs",
    "finish_reason",        "request_id",         "get_request_counts",    "kv_cache_manager",
    "usage",                "total_num_scheduled_tokens", "prefill_steps",
};
static PyObject *names[NAME_COUNT];
static PyObject *zero;
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
        int has_zero = PySequence_Contains(output_tokens, zero);
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

/* step_facts(step_type, requests, scheduler, output, outputs_by_client, index, start_ns, clock)
 *     -> (step, finished, first_seen) | () | None
 *
 * vllm_engine.step_facts_python in one call: what the step read and changed is the same; it
 * answers None (having changed nothing) where an input is not of the types it walks. */
static PyObject *step_facts(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "step_facts takes 8 arguments");
        return NULL;
    }
    PyObject *step_type = args[0], *requests = args[1], *scheduler = args[2], *output = args[3];
    PyObject *outputs_by_client = args[4], *index = args[5], *start_ns = args[6], *clock = args[7];
    if (!PyType_Check(step_type) || !PyType_IsSubtype((PyTypeObject *)step_type, &PyTuple_Type) ||
        !PyDict_CheckExact(requests) || !PyDict_CheckExact(outputs_by_client)) {
        Py_RETURN_NONE;
    }
    PyObject *result = NULL, *scheduled = NULL, *prefill = NULL, *clients = NULL;
    PyObject *finished = NULL, *end_ns = NULL, *total = NULL, *first_seen = NULL;
    PyObject *prefill_tokens = NULL, *counts = NULL, *kv_manager = NULL, *usage = NULL;
    PyObject *kv_usage = NULL, *decode_tokens = NULL, *step = NULL;
    PyObject *items = NULL, *packed = NULL, *prefill_count = NULL, *decode_count = NULL;
    Py_ssize_t prefill_requests = 0;

    /* Everything read first: a decline changes nothing. */
    scheduled = PyObject_GetAttr(output, names[NAME_NUM_SCHEDULED_TOKENS]);
    if (scheduled == NULL) {
        goto done;
    }
    if (!PyDict_CheckExact(scheduled)) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (PyDict_GET_SIZE(scheduled) == 0) {
        result = PyTuple_New(0);
        goto done;
    }
    int layout = prefill_ids(output, &prefill);
    if (layout <= 0) {
        result = layout < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    finished = PyList_New(0);
    clients = finished == NULL ? NULL : PyDict_Values(outputs_by_client);
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
            result = Py_NewRef(Py_None);
            goto done;
        }
        int walked = ids_where_set_into(finished, outputs, names[NAME_FINISH_REASON],
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
    first_seen = PyList_New(0);
    if (first_seen == NULL) {
        goto done;
    }
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
                    failed = pair == NULL || PyList_Append(first_seen, pair) < 0;
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
    /* running, waiting = get_request_counts(); the record holds waiting first. */
    items = PyTuple_Pack(12, index, start_ns, end_ns, prefill_count, decode_count, prefill_tokens,
                         decode_tokens, kv_usage, PyTuple_GET_ITEM(counts, 1),
                         PyTuple_GET_ITEM(counts, 0), scheduled,
                         prefill == NULL ? no_prefill : prefill);
    packed = items == NULL ? NULL : PyTuple_Pack(1, items);
    step = packed == NULL ? NULL : PyTuple_Type.tp_new((PyTypeObject *)step_type, packed, NULL);
    if (step != NULL) {
        result = PyTuple_Pack(3, step, finished, first_seen);
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
    Py_XDECREF(items);
    Py_XDECREF(packed);
    Py_XDECREF(step);
    return result;
}

static PyMethodDef steps_methods[] = {
    {"step_facts", (PyCFunction)(void (*)(void))step_facts, METH_FASTCALL,
     "step_facts(step_type, requests, scheduler, output, outputs_by_client, index, start_ns, "
     "clock) -> tuple | None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef steps_module = {
    PyModuleDef_HEAD_INIT, "_steps", "The engine-step tracer's per-request loops (see _steps.c).",
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
    if (ns_per_s == NULL && (ns_per_s = PyLong_FromLong(1000000000L)) == NULL) {
        return NULL;
    }
    if (no_prefill == NULL && (no_prefill = PyFrozenSet_New(NULL)) == NULL) {
        return NULL;
    }
    return PyModule_Create(&steps_module);
}
