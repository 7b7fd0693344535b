/* megakernel.h through an embedded CPython: each handle holds a megakernel.capi.session.Session, and each call
 * takes the GIL, calls it, and turns a Python exception into a status and mk_last_error's message
 * (session.status_of).  Python starts on the first mk_open, from MK_DEFAULT_PYTHON (the interpreter the
 * library was built with) or $MEGAKERNEL_PYTHON, so its environment's site-packages are found; if the host
 * process already runs Python, that one is used. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "megakernel.h"

#ifndef MK_DEFAULT_PYTHON
#define MK_DEFAULT_PYTHON ""
#endif

struct mk_engine {
    PyObject *session;
    int32_t vocab_size;
    int32_t position;
};

static _Thread_local char last_error[2048];
static PyObject *session_module; /* megakernel.capi.session, imported once */
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;

static mk_status fail(mk_status status, const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(last_error, sizeof last_error, format, args);
    va_end(args);
    return status;
}

/* The pending Python exception as a status (GIL held): session.status_of's code and message, or the exception's
 * text where the module is not there to ask. */
static mk_status python_error(const char *call) {
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *exc = PyErr_GetRaisedException();
#else
    PyObject *type, *exc, *traceback;
    PyErr_Fetch(&type, &exc, &traceback);
    PyErr_NormalizeException(&type, &exc, &traceback);
    Py_XDECREF(type);
    Py_XDECREF(traceback);
#endif
    if (exc == NULL) return fail(MK_ERR_RUNTIME, "%s: failed without a Python exception", call);
    mk_status status = MK_ERR_PYTHON;
    PyObject *verdict = session_module ? PyObject_CallMethod(session_module, "status_of", "O", exc) : NULL;
    int code = 0;
    const char *text = NULL;
    if (verdict != NULL && PyArg_ParseTuple(verdict, "is", &code, &text)) {
        status = (mk_status)code;
        fail(status, "%s: %s", call, text);
    } else {
        PyErr_Clear();
        PyObject *str = PyObject_Str(exc);
        const char *s = str ? PyUnicode_AsUTF8(str) : NULL;
        fail(status, "%s: %s: %s", call, Py_TYPE(exc)->tp_name, s ? s : "(no message)");
        Py_XDECREF(str);
        PyErr_Clear();
    }
    Py_XDECREF(verdict);
    Py_DECREF(exc);
    return status;
}

static mk_status start_python(void) {
    mk_status status = MK_OK;
    int started_here = 0;
    pthread_mutex_lock(&start_lock);
    if (session_module != NULL) goto done;
    if (!Py_IsInitialized()) {
        const char *exe = getenv("MEGAKERNEL_PYTHON");
        if (exe == NULL || !*exe) exe = MK_DEFAULT_PYTHON;
        PyConfig config;
        PyConfig_InitPythonConfig(&config);
        config.install_signal_handlers = 0; /* the host's signals stay the host's */
        PyStatus st = PyStatus_Ok();
        if (*exe) st = PyConfig_SetBytesString(&config, &config.program_name, exe);
        if (!PyStatus_Exception(st)) st = Py_InitializeFromConfig(&config);
        PyConfig_Clear(&config);
        if (PyStatus_Exception(st)) {
            status = fail(MK_ERR_PYTHON, "mk_open: Python did not start from %s: %s", *exe ? exe : "(default)",
                          st.err_msg ? st.err_msg : "unknown error");
            goto done;
        }
        started_here = 1;
    }
    PyGILState_STATE gil = PyGILState_Ensure();
    session_module = PyImport_ImportModule("megakernel.capi.session");
    if (session_module == NULL) status = python_error("mk_open: import megakernel.capi.session");
    PyGILState_Release(gil);
    if (started_here) PyEval_SaveThread(); /* Py_InitializeFromConfig left this thread holding the GIL */
done:
    pthread_mutex_unlock(&start_lock);
    return status;
}

void mk_options_init(mk_options *options) {
    if (options == NULL) return;
    memset(options, 0, sizeof *options);
    options->struct_size = sizeof *options;
    options->max_len = 4096;
    options->top_p = 1.0f;
}

/* The first version's mk_options ended at seed: an older caller's struct_size. */
#define MK_OPTIONS_V1_SIZE (offsetof(mk_options, seed) + sizeof(uint64_t))
/* Whether the caller's struct has field f (else its default applies). */
#define MK_HAS(options, f) ((options)->struct_size >= offsetof(mk_options, f) + sizeof((options)->f))

static PyObject *str_or_empty(const char *s) { return PyUnicode_FromString(s ? s : ""); }

/* Reads an int attribute of the session into *out (GIL held); 0 on failure (an exception pending). */
static int int_attr(PyObject *session, const char *name, int32_t *out) {
    PyObject *v = PyObject_GetAttrString(session, name);
    long x = v ? PyLong_AsLong(v) : -1;
    Py_XDECREF(v);
    if (PyErr_Occurred()) return 0;
    *out = (int32_t)x;
    return 1;
}

mk_status mk_open(const mk_options *options, mk_engine **engine) {
    last_error[0] = 0;
    if (engine == NULL) return fail(MK_ERR_ARGUMENT, "mk_open: engine is NULL");
    *engine = NULL;
    if (options == NULL) return fail(MK_ERR_ARGUMENT, "mk_open: options is NULL (mk_options_init fills one)");
    if (options->struct_size < MK_OPTIONS_V1_SIZE)
        return fail(MK_ERR_ARGUMENT, "mk_open: options.struct_size %u < %zu: call mk_options_init first",
                    options->struct_size, MK_OPTIONS_V1_SIZE);
    double temperature = MK_HAS(options, temperature) ? options->temperature : 0.0;
    double top_p = MK_HAS(options, top_p) ? options->top_p : 1.0;
    unsigned long long sample_seed = MK_HAS(options, sample_seed) ? options->sample_seed : 0;
    mk_status status = start_python();
    if (status != MK_OK) return status;
    mk_engine *e = calloc(1, sizeof *e);
    if (e == NULL) return fail(MK_ERR_RUNTIME, "mk_open: out of host memory");
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *cls = PyObject_GetAttrString(session_module, "Session");
    PyObject *kwargs = Py_BuildValue("{s:N,s:N,s:N,s:N,s:i,s:K,s:i,s:d,s:d,s:K}", "model", str_or_empty(options->model),
                                     "backend", str_or_empty(options->backend), "device",
                                     str_or_empty(options->device), "dtype", str_or_empty(options->dtype),
                                     "max_len", options->max_len, "seed", (unsigned long long)options->seed,
                                     "workers", options->workers, "temperature", temperature, "top_p", top_p,
                                     "sample_seed", sample_seed);
    PyObject *empty = PyTuple_New(0);
    e->session = cls && kwargs && empty ? PyObject_Call(cls, empty, kwargs) : NULL;
    Py_XDECREF(cls);
    Py_XDECREF(kwargs);
    Py_XDECREF(empty);
    if (e->session == NULL || !int_attr(e->session, "vocab_size", &e->vocab_size)) {
        status = python_error("mk_open");
        Py_CLEAR(e->session);
    }
    PyGILState_Release(gil);
    if (status != MK_OK) {
        free(e);
        return status;
    }
    *engine = e;
    return MK_OK;
}

mk_status mk_feed(mk_engine *engine, const int32_t *tokens, size_t n, int32_t *next_token) {
    last_error[0] = 0;
    if (engine == NULL) return fail(MK_ERR_ARGUMENT, "mk_feed: engine is NULL");
    if (tokens == NULL || n == 0) return fail(MK_ERR_ARGUMENT, "mk_feed: no tokens (tokens %s, n = %zu)",
                                              tokens ? "set" : "NULL", n);
    mk_status status = MK_OK;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list != NULL && i < n; i++) {
        PyObject *token = PyLong_FromLong(tokens[i]);
        if (token == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, token);
    }
    PyObject *next = list ? PyObject_CallMethod(engine->session, "feed", "O", list) : NULL;
    long token = next ? PyLong_AsLong(next) : -1;
    if (next == NULL || PyErr_Occurred() || !int_attr(engine->session, "position", &engine->position))
        status = python_error("mk_feed");
    else if (next_token != NULL)
        *next_token = (int32_t)token;
    Py_XDECREF(next);
    Py_XDECREF(list);
    PyGILState_Release(gil);
    return status;
}

mk_status mk_logits(mk_engine *engine, float *logits, size_t capacity) {
    last_error[0] = 0;
    if (engine == NULL) return fail(MK_ERR_ARGUMENT, "mk_logits: engine is NULL");
    if (logits == NULL) return fail(MK_ERR_ARGUMENT, "mk_logits: logits is NULL");
    mk_status status = MK_OK;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *r = PyObject_CallMethod(engine->session, "copy_logits", "Kn", (unsigned long long)(uintptr_t)logits,
                                      (Py_ssize_t)capacity);
    if (r == NULL) status = python_error("mk_logits");
    Py_XDECREF(r);
    PyGILState_Release(gil);
    return status;
}

mk_status mk_reset(mk_engine *engine) {
    last_error[0] = 0;
    if (engine == NULL) return fail(MK_ERR_ARGUMENT, "mk_reset: engine is NULL");
    mk_status status = MK_OK;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *r = PyObject_CallMethod(engine->session, "reset", NULL);
    if (r == NULL) status = python_error("mk_reset");
    else engine->position = 0;
    Py_XDECREF(r);
    PyGILState_Release(gil);
    return status;
}

int32_t mk_vocab_size(const mk_engine *engine) { return engine ? engine->vocab_size : -1; }

int32_t mk_position(const mk_engine *engine) { return engine ? engine->position : -1; }

void mk_close(mk_engine *engine) {
    if (engine == NULL) return;
    PyGILState_STATE gil = PyGILState_Ensure();
    Py_CLEAR(engine->session);
    PyGILState_Release(gil);
    free(engine);
}

const char *mk_last_error(void) { return last_error; }
