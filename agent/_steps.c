/* The engine-step tracer's per-request loops in C (tokentrace.agent.frameworks.vllm_engine).
 *
 * EngineCore's busy loop calls the tracer twice per step, and each call walks the step's batch:
 * the scheduled requests (one list append each, like a token) and their outputs (the finished
 * ones). In Python each request costs a few hundred ns of dict lookups and attribute reads on
 * the serving thread; here a few tens. Each function has a Python twin in vllm_engine.py that
 * gives the same answers, and returns None where its input is not of the types it walks (the
 * twin then answers). Unlike _wire.c these read attributes, which may run Python code of the
 * host's objects; errors it raises propagate (the tracer's hook guard catches them).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* append_index(scheduled, skip, tracked, attribute, index) -> unseen | None
 *
 * For each key of the dict `scheduled` (request id -> tokens) that is not in the set `skip`,
 * look it up in the dict `tracked`: absent -> listed in `unseen` (returned); None -> nothing;
 * else append `index` to (the list in) its attribute `attribute`. */
static PyObject *append_index(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "append_index takes 5 arguments");
        return NULL;
    }
    PyObject *scheduled = args[0], *skip = args[1], *tracked = args[2], *attribute = args[3];
    PyObject *index = args[4];
    if (!PyDict_CheckExact(scheduled) || !PyAnySet_CheckExact(skip) ||
        !PyDict_CheckExact(tracked) || !PyUnicode_CheckExact(attribute)) {
        Py_RETURN_NONE;
    }
    PyObject *unseen = PyList_New(0);
    if (unseen == NULL) {
        return NULL;
    }
    int check_skip = PySet_GET_SIZE(skip) > 0;
    Py_ssize_t position = 0;
    PyObject *key, *value;
    while (PyDict_Next(scheduled, &position, &key, &value)) {
        if (check_skip) {
            int skipped = PySet_Contains(skip, key);
            if (skipped < 0) {
                goto error;
            }
            if (skipped) {
                continue;
            }
        }
        PyObject *entry = PyDict_GetItemWithError(tracked, key); /* borrowed */
        if (entry == NULL) {
            if (PyErr_Occurred() || PyList_Append(unseen, key) < 0) {
                goto error;
            }
            continue;
        }
        if (entry == Py_None) {
            continue;
        }
        Py_INCREF(entry);
        PyObject *steps = PyObject_GetAttr(entry, attribute);
        Py_DECREF(entry);
        if (steps == NULL) {
            goto error;
        }
        int appended;
        if (PyList_CheckExact(steps)) {
            appended = PyList_Append(steps, index);
        } else { /* whatever the twin's .append(index) does */
            PyObject *done = PyObject_CallMethod(steps, "append", "O", index);
            appended = done == NULL ? -1 : 0;
            Py_XDECREF(done);
        }
        Py_DECREF(steps);
        if (appended < 0) {
            goto error;
        }
    }
    return unseen;
error:
    Py_DECREF(unseen);
    return NULL;
}

/* ids_where_set(items, flag, name) -> list | None
 *
 * getattr(item, name) of each item of the list or tuple `items` whose attribute `flag` is not
 * None, in order. */
static PyObject *ids_where_set(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "ids_where_set takes 3 arguments");
        return NULL;
    }
    PyObject *items = args[0], *flag = args[1], *name = args[2];
    if (!(PyList_CheckExact(items) || PyTuple_CheckExact(items)) || !PyUnicode_CheckExact(flag) ||
        !PyUnicode_CheckExact(name)) {
        Py_RETURN_NONE;
    }
    PyObject *found = PyList_New(0);
    if (found == NULL) {
        return NULL;
    }
    /* A list may change length under attribute code: index it afresh each time. */
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(items); i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(items, i);
        Py_INCREF(item);
        PyObject *value = PyObject_GetAttr(item, flag);
        if (value == NULL) {
            Py_DECREF(item);
            goto error;
        }
        int set = value != Py_None;
        Py_DECREF(value);
        if (set) {
            PyObject *id = PyObject_GetAttr(item, name);
            int appended = id == NULL ? -1 : PyList_Append(found, id);
            Py_XDECREF(id);
            if (appended < 0) {
                Py_DECREF(item);
                goto error;
            }
        }
        Py_DECREF(item);
    }
    return found;
error:
    Py_DECREF(found);
    return NULL;
}

static PyMethodDef steps_methods[] = {
    {"append_index", (PyCFunction)(void (*)(void))append_index, METH_FASTCALL,
     "append_index(scheduled: dict[str, int], skip: set | frozenset, tracked: dict, attribute: "
     "str, index: object) -> list[str] | None"},
    {"ids_where_set", (PyCFunction)(void (*)(void))ids_where_set, METH_FASTCALL,
     "ids_where_set(items: list | tuple, flag: str, name: str) -> list | None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef steps_module = {
    PyModuleDef_HEAD_INIT, "_steps", "The engine-step tracer's per-request loops (see _steps.c).",
    -1, steps_methods,
};

PyMODINIT_FUNC PyInit__steps(void) { return PyModule_Create(&steps_module); }
