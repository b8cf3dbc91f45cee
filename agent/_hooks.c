/* HookGuard.run in C (tokentrace.agent.hooks).
 *
 * Every hook body of every engine runs through the guard's `run(name, hook, *args)`: `hook(*args)`
 * unless the hook is disabled, an Exception it raises reported to the guard (`failed`, which
 * counts, logs and disables it) and answered None. As a Python method it is one more frame on
 * the serving path per guarded call (several per request, one per step for some engines); this
 * object, put in the class in its place, calls the hook with no frame of its own. It is a method
 * descriptor flagged as one (Py_TPFLAGS_METHOD_DESCRIPTOR), so `guard.run(...)` calls it
 * unbound with the guard first, as it would a Python function. Its Python twin is
 * `HookGuard.run_python`, which gives the same answers; TOKENTRACE_PURE_PYTHON=1 runs it instead.
 * One difference: a guard whose `failed` itself raises has that error written as unraisable here
 * (the host keeps running), where the twin lets it propagate.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

#include "_guard.h"

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
} GuardRun;

static PyObject *name_disabled;
static PyObject *name_failed;

/* The hook's Exception (set) reported to `guard.failed(name)`: None; NULL with it still set
 * when it is not an Exception (or the guard has no `failed`). */
static PyObject *report(PyObject *guard, PyObject *name, PyObject *hook) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
        return NULL;
    }
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *failed = PyObject_GetAttr(guard, name_failed);
    if (failed == NULL) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        return NULL;
    }
    PyErr_Restore(type, value, traceback);
    int reported = report_failure_to(failed, name, hook);
    Py_DECREF(failed);
    if (reported < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* run(guard, name, hook, *args) */
static PyObject *guard_run_call(PyObject *callable, PyObject *const *args, size_t nargsf,
                                PyObject *kwnames) {
    (void)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) {
        PyErr_SetString(PyExc_TypeError, "run() takes no keyword arguments");
        return NULL;
    }
    if (nargs < 3) {
        PyErr_SetString(PyExc_TypeError, "run() takes a guard, a hook name and a hook");
        return NULL;
    }
    PyObject *guard = args[0], *name = args[1], *hook = args[2];
    PyObject *disabled = PyObject_GetAttr(guard, name_disabled);
    if (disabled == NULL) {
        return NULL;
    }
    int off = PyAnySet_Check(disabled) && PySet_GET_SIZE(disabled) == 0
                  ? 0
                  : PySequence_Contains(disabled, name);
    Py_DECREF(disabled);
    if (off != 0) {
        if (off < 0) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    PyObject *result = PyObject_Vectorcall(hook, args + 3, (size_t)(nargs - 3), NULL);
    return result != NULL ? result : report(guard, name, hook);
}

/* A method: bound to the guard it is read from (LOAD_METHOD skips the binding). */
static PyObject *guard_run_get(PyObject *self, PyObject *instance, PyObject *owner) {
    (void)owner;
    if (instance == NULL || instance == Py_None) {
        return Py_NewRef(self);
    }
    return PyMethod_New(self, instance);
}

static PyTypeObject GuardRunType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tokentrace.agent._hooks.GuardRun",
    .tp_doc = "HookGuard.run: hook(*args) unless disabled; an Exception reported to the guard.",
    .tp_basicsize = sizeof(GuardRun),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_vectorcall_offset = offsetof(GuardRun, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = guard_run_get,
};

static struct PyModuleDef hooks_module = {
    PyModuleDef_HEAD_INIT, "_hooks", "HookGuard.run in C.", -1, NULL,
};

PyMODINIT_FUNC PyInit__hooks(void) {
    if ((name_disabled = PyUnicode_InternFromString("disabled")) == NULL ||
        (name_failed = PyUnicode_InternFromString("failed")) == NULL) {
        return NULL;
    }
    if (PyType_Ready(&GuardRunType) < 0) {
        return NULL;
    }
    GuardRun *run = PyObject_New(GuardRun, &GuardRunType);
    if (run == NULL) {
        return NULL;
    }
    run->vectorcall = guard_run_call;
    PyObject *module = PyModule_Create(&hooks_module);
    if (module == NULL || PyModule_AddObject(module, "run", (PyObject *)run) < 0) {
        Py_DECREF(run);
        Py_XDECREF(module);
        return NULL;
    }
    return module;
}
