/* The HTTP server span's per-resume and per-chunk work in C (tokentrace.agent.frameworks.asgi).
 *
 * The tracing middleware must act when the app's call ends (the span's end, its error), so it
 * sits in the chain of awaits that every resume of the request's task passes through; as a
 * Python coroutine it is one more frame resumed each time (a streamed response resumes the task
 * several times per chunk). `traced_await` wraps the app's coroutine in an object that passes
 * every send, throw and close straight to it and calls `on_exit(exception or None)` once, when
 * it ends: no Python frame per resume. `traced_send` is the `send` the app gets: it reads each
 * message's type and stamps the span (first body bytes, last body bytes, status) before calling
 * the server's send, with no Python frame per chunk. Their Python twins are asgi.py's
 * `_traced_await` and `_traced_send`, which give the same answers; TOKENTRACE_PURE_PYTHON=1
 * runs them instead.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

/* --- traced_await ----------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *inner;   /* the app's coroutine (kept after it ends: it answers for itself) */
    PyObject *on_exit; /* NULL once called */
    int started;       /* the first send reached the coroutine */
} TracedAwait;

static PyObject *name_throw;
static PyObject *name_close;

/* 0, or -1 with RuntimeError set when the coroutine was let go (tp_clear, in a collected cycle). */
static int check_inner(TracedAwait *self) {
    if (self->inner != NULL) {
        return 0;
    }
    PyErr_SetString(PyExc_RuntimeError, "the traced coroutine was collected");
    return -1;
}

/* Calls on_exit(exc) once, exc NULL meaning None; -1 with its error set when it raised. */
static int call_exit(TracedAwait *self, PyObject *exc) {
    PyObject *on_exit = self->on_exit;
    if (on_exit == NULL) {
        return 0;
    }
    self->on_exit = NULL;
    PyObject *done = PyObject_CallOneArg(on_exit, exc != NULL ? exc : Py_None);
    Py_DECREF(on_exit);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

/* The coroutine ended with the error that is set: on_exit gets it (None for StopIteration, a
 * return) and it stays set; an error of on_exit's own replaces it, chained (as the twin's
 * `raise` in an `except` block would). */
static void exit_with_error(TracedAwait *self) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL) {
        PyException_SetTraceback(value, traceback);
    }
    int returned = PyErr_GivenExceptionMatches(type, PyExc_StopIteration);
    if (call_exit(self, returned ? NULL : value) < 0) {
        _PyErr_ChainExceptions(type, value, traceback);
        return;
    }
    PyErr_Restore(type, value, traceback);
}

static PySendResult traced_await_am_send(TracedAwait *self, PyObject *arg, PyObject **result) {
    if (check_inner(self) < 0) {
        *result = NULL;
        return PYGEN_ERROR;
    }
    self->started = 1;
    PySendResult status = PyIter_Send(self->inner, arg, result);
    if (status == PYGEN_RETURN) {
        if (call_exit(self, NULL) < 0) {
            Py_CLEAR(*result);
            return PYGEN_ERROR;
        }
    } else if (status == PYGEN_ERROR) {
        exit_with_error(self);
    }
    return status;
}

/* A send's outcome as a Python method returns it: the yielded value, or NULL with the return
 * value as StopIteration's (`iterating`: a None return sets nothing, as tp_iternext may). */
static PyObject *send_outcome(PySendResult status, PyObject *result, int iterating) {
    if (status != PYGEN_RETURN) {
        return result;
    }
    if (result != Py_None || !iterating) {
        _PyGen_SetStopIterationValue(result);
    }
    Py_DECREF(result);
    return NULL;
}

static PyObject *traced_await_send(TracedAwait *self, PyObject *arg) {
    PyObject *result;
    PySendResult status = traced_await_am_send(self, arg, &result);
    return send_outcome(status, result, 0);
}

static PyObject *traced_await_iternext(TracedAwait *self) {
    PyObject *result;
    PySendResult status = traced_await_am_send(self, Py_None, &result);
    return send_outcome(status, result, 1);
}

static PyObject *traced_await_throw(TracedAwait *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_inner(self) < 0) {
        return NULL;
    }
    self->started = 1;
    PyObject *throw = PyObject_GetAttr(self->inner, name_throw);
    if (throw == NULL) {
        return NULL;
    }
    PyObject *yielded = PyObject_Vectorcall(throw, args, (size_t)nargs, NULL);
    Py_DECREF(throw);
    if (yielded == NULL) {
        exit_with_error(self);
    }
    return yielded;
}

/* The coroutine closed, as the twin's frame sees it: GeneratorExit raised at its await. */
static PyObject *traced_await_close(TracedAwait *self, PyObject *Py_UNUSED(ignored)) {
    if (self->inner == NULL) {
        Py_RETURN_NONE;
    }
    PyObject *closed = PyObject_CallMethodNoArgs(self->inner, name_close);
    if (closed == NULL) {
        exit_with_error(self);
        return NULL;
    }
    Py_DECREF(closed);
    if (self->on_exit == NULL || !self->started) {
        /* Ended already, or never started (the twin's body never ran either). */
        Py_RETURN_NONE;
    }
    PyObject *exit = PyObject_CallNoArgs(PyExc_GeneratorExit);
    if (exit == NULL) {
        return NULL;
    }
    int failed = call_exit(self, exit);
    Py_DECREF(exit);
    if (failed < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* Collected while suspended: closed, as a coroutine is (its errors are unraisable). */
static void traced_await_finalize(TracedAwait *self) {
    if (self->on_exit == NULL || !self->started || self->inner == NULL) {
        return;
    }
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *closed = traced_await_close(self, NULL);
    if (closed == NULL) {
        PyErr_WriteUnraisable((PyObject *)self);
    }
    Py_XDECREF(closed);
    PyErr_Restore(type, value, traceback);
}

static PyObject *traced_await_await(PyObject *self) { return Py_NewRef(self); }

static int traced_await_traverse(TracedAwait *self, visitproc visit, void *arg) {
    Py_VISIT(self->inner);
    Py_VISIT(self->on_exit);
    return 0;
}

static int traced_await_clear(TracedAwait *self) {
    Py_CLEAR(self->inner);
    Py_CLEAR(self->on_exit);
    return 0;
}

static void traced_await_dealloc(TracedAwait *self) {
    if (PyObject_CallFinalizerFromDealloc((PyObject *)self) < 0) {
        return; /* resurrected */
    }
    PyObject_GC_UnTrack(self);
    traced_await_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyAsyncMethods traced_await_async = {
    .am_await = traced_await_await,
    .am_send = (sendfunc)traced_await_am_send,
};

static PyMethodDef traced_await_methods[] = {
    {"send", (PyCFunction)traced_await_send, METH_O, NULL},
    {"throw", (PyCFunction)(void (*)(void))traced_await_throw, METH_FASTCALL, NULL},
    {"close", (PyCFunction)traced_await_close, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TracedAwaitType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tokentrace.agent._asgi.TracedAwait",
    .tp_basicsize = sizeof(TracedAwait),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The app's coroutine, awaited through: on_exit(exception or None) when it ends.",
    .tp_as_async = &traced_await_async,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)traced_await_iternext,
    .tp_methods = traced_await_methods,
    .tp_traverse = (traverseproc)traced_await_traverse,
    .tp_clear = (inquiry)traced_await_clear,
    .tp_dealloc = (destructor)traced_await_dealloc,
    .tp_finalize = (destructor)traced_await_finalize,
};

static PyObject *traced_await(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "traced_await takes 2 arguments");
        return NULL;
    }
    if (!PyCoro_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "traced_await takes a coroutine");
        return NULL;
    }
    TracedAwait *self = PyObject_GC_New(TracedAwait, &TracedAwaitType);
    if (self == NULL) {
        return NULL;
    }
    self->inner = Py_NewRef(args[0]);
    self->on_exit = Py_NewRef(args[1]);
    self->started = 0;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

/* --- traced_send ------------------------------------------------------------------------------ */

enum {
    NAME_TYPE,
    NAME_BODY,
    NAME_MORE_BODY,
    NAME_STATUS,
    NAME_RESPONSE_BODY,
    NAME_RESPONSE_START,
    NAME_FIRST_BODY_NS,
    NAME_END_NS,
    NAME_STATUS_CODE,
    NAME_COUNT,
};
static const char *const name_strings[NAME_COUNT] = {
    "type", "body", "more_body", "status", "http.response.body", "http.response.start",
    "first_body_ns", "end_ns", "status_code",
};
static PyObject *names[NAME_COUNT];

typedef struct {
    PyObject_HEAD
    PyObject *send;  /* the server's */
    PyObject *span;  /* the request's HttpServerSpan */
    PyObject *clock; /* monotonic ns */
    int first_body_pending;
    vectorcallfunc vectorcall;
} TracedSend;

/* message[key] when present, else NULL with no error set (-1: an error). A dict is read
 * directly; any other mapping through its get, as the twin does. */
static int message_get(PyObject *message, PyObject *key, PyObject **value) {
    if (PyDict_CheckExact(message)) {
        *value = Py_XNewRef(PyDict_GetItemWithError(message, key));
        return *value == NULL && PyErr_Occurred() ? -1 : 0;
    }
    *value = PyObject_CallMethod(message, "get", "O", key);
    if (*value == NULL) {
        return -1;
    }
    if (*value == Py_None) {
        Py_CLEAR(*value);
    }
    return 0;
}

/* Sets span.<name> to clock(). */
static int stamp(TracedSend *self, PyObject *name) {
    PyObject *now = PyObject_CallNoArgs(self->clock);
    if (now == NULL) {
        return -1;
    }
    int set = PyObject_SetAttr(self->span, name, now);
    Py_DECREF(now);
    return set;
}

/* What the span takes from one message (the twin: asgi._traced_send). */
static int note_message(TracedSend *self, PyObject *message) {
    PyObject *kind, *value;
    if (message_get(message, names[NAME_TYPE], &kind) < 0) {
        return -1;
    }
    if (kind == NULL) {
        return 0;
    }
    int body = PyUnicode_Check(kind) && PyUnicode_Compare(kind, names[NAME_RESPONSE_BODY]) == 0;
    int start = !body && PyUnicode_Check(kind) &&
                PyUnicode_Compare(kind, names[NAME_RESPONSE_START]) == 0;
    Py_DECREF(kind);
    if (body) {
        if (self->first_body_pending) {
            if (message_get(message, names[NAME_BODY], &value) < 0) {
                return -1;
            }
            int nonempty = value == NULL ? 0 : PyObject_IsTrue(value);
            Py_XDECREF(value);
            if (nonempty < 0) {
                return -1;
            }
            if (nonempty) {
                if (stamp(self, names[NAME_FIRST_BODY_NS]) < 0) {
                    return -1;
                }
                self->first_body_pending = 0;
            }
        }
        if (message_get(message, names[NAME_MORE_BODY], &value) < 0) {
            return -1;
        }
        int more = value == NULL ? 0 : PyObject_IsTrue(value);
        Py_XDECREF(value);
        if (more < 0) {
            return -1;
        }
        /* Read before the last bytes are handed over, so that the span ends before any client
         * can see the response end (a client span always contains it). */
        return more ? 0 : stamp(self, names[NAME_END_NS]);
    }
    if (start) {
        if (message_get(message, names[NAME_STATUS], &value) < 0) {
            return -1;
        }
        int set = 0;
        if (value != NULL && PyLong_CheckExact(value)) {
            set = PyObject_SetAttr(self->span, names[NAME_STATUS_CODE], value);
        }
        Py_XDECREF(value);
        return set;
    }
    return 0;
}

static PyObject *traced_send_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                        PyObject *kwnames) {
    TracedSend *self = (TracedSend *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 1 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "send takes one message");
        return NULL;
    }
    if (note_message(self, args[0]) < 0) {
        return NULL;
    }
    return PyObject_CallOneArg(self->send, args[0]);
}

static int traced_send_traverse(TracedSend *self, visitproc visit, void *arg) {
    Py_VISIT(self->send);
    Py_VISIT(self->span);
    Py_VISIT(self->clock);
    return 0;
}

static int traced_send_clear(TracedSend *self) {
    Py_CLEAR(self->send);
    Py_CLEAR(self->span);
    Py_CLEAR(self->clock);
    return 0;
}

static void traced_send_dealloc(TracedSend *self) {
    PyObject_GC_UnTrack(self);
    traced_send_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject TracedSendType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tokentrace.agent._asgi.TracedSend",
    .tp_basicsize = sizeof(TracedSend),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "The app's send: stamps the request's span, then calls the server's send.",
    .tp_vectorcall_offset = offsetof(TracedSend, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_traverse = (traverseproc)traced_send_traverse,
    .tp_clear = (inquiry)traced_send_clear,
    .tp_dealloc = (destructor)traced_send_dealloc,
};

static PyObject *traced_send(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "traced_send takes 3 arguments");
        return NULL;
    }
    TracedSend *self = PyObject_GC_New(TracedSend, &TracedSendType);
    if (self == NULL) {
        return NULL;
    }
    self->send = Py_NewRef(args[0]);
    self->span = Py_NewRef(args[1]);
    self->clock = Py_NewRef(args[2]);
    self->first_body_pending = 1;
    self->vectorcall = traced_send_vectorcall;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

/* --- module ----------------------------------------------------------------------------------- */

static PyMethodDef asgi_methods[] = {
    {"traced_await", (PyCFunction)(void (*)(void))traced_await, METH_FASTCALL,
     "traced_await(coroutine, on_exit, /): the coroutine, awaited through; on_exit(exception "
     "or None) is called once when it ends (asgi._traced_await is its twin)."},
    {"traced_send", (PyCFunction)(void (*)(void))traced_send, METH_FASTCALL,
     "traced_send(send, span, clock, /): the app's send for the request's span "
     "(asgi._traced_send is its twin)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef asgi_module = {
    PyModuleDef_HEAD_INIT, "_asgi", "The HTTP server span's per-resume and per-chunk work.", -1,
    asgi_methods,
};

PyMODINIT_FUNC PyInit__asgi(void) {
    for (int i = 0; i < NAME_COUNT; i++) {
        if ((names[i] = PyUnicode_InternFromString(name_strings[i])) == NULL) {
            return NULL;
        }
    }
    if ((name_throw = PyUnicode_InternFromString("throw")) == NULL ||
        (name_close = PyUnicode_InternFromString("close")) == NULL) {
        return NULL;
    }
    if (PyType_Ready(&TracedAwaitType) < 0 || PyType_Ready(&TracedSendType) < 0) {
        return NULL;
    }
    return PyModule_Create(&asgi_module);
}
