/* The hook guard's failure report, shared by the C hooks (_steps.c) and HookGuard.run in C
 * (_hooks.c): included by each, as _varint.h is. Needs Python.h first. */
#ifndef TOKENTRACE_GUARD_H
#define TOKENTRACE_GUARD_H

/* The exception being raised, handed to the guard as the one being handled (as `except
 * Exception: guard.failed(name)` does: `failed` is the guard's method, `hook` the caller, named
 * if the guard itself fails); anything not an Exception is left raised (-1). */
static int report_failure_to(PyObject *failed, PyObject *name, PyObject *hook) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
        return -1;
    }
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL && value != NULL) {
        PyException_SetTraceback(value, traceback);
    }
    PyObject *saved_type, *saved_value, *saved_traceback; /* sys.exc_info(), as it was */
    PyErr_GetExcInfo(&saved_type, &saved_value, &saved_traceback);
    Py_XINCREF(type);
    Py_XINCREF(value);
    Py_XINCREF(traceback);
    PyErr_SetExcInfo(type, value, traceback); /* steals */
    PyObject *done = PyObject_CallOneArg(failed, name);
    PyErr_SetExcInfo(saved_type, saved_value, saved_traceback);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    if (done == NULL) { /* the guard itself failed: the host keeps running all the same */
        PyErr_WriteUnraisable(hook);
        return 0;
    }
    Py_DECREF(done);
    return 0;
}

#endif
