/* What the C sites of agent/instrument/_hot.c share: the tracer's hot state (ops.Hot), its nesting
 * and enabled checks, the hand-over of an Entry, the pending maps, the argument and group look-ups.
 * Included once, by _hot.c (one translation unit: everything stays static). */
#ifndef MESHSCOPE_HOT_COMMON_H
#define MESHSCOPE_HOT_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

enum { KIND_C10D = 0, KIND_FSDP = 1 };

static PyObject *s_depth, *s_enabled, *s_nesting, *s_is_cuda, *s_nbytes, *s_key, *s_global_rank, *s_ranks, *s_error,
    *s_track_work, *s_dropped_done, *s_group, *s_async_op;
static PyObject *k_minus_one, *k_one;

/* The dispatcher kernels' count of this thread's calls inside a site (funcol_kernels: ``site_depth``), set
 * once they are bound (``set_site_depth``): an all-reduce a site makes is its own op, which the DDP bucket
 * kernel must not record again. NULL: no kernels. */
static void (*g_site_depth)(int) = NULL;

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    /* as CPython's _PyTime_AsSecondsDouble: integer nanoseconds, then one division */
    int64_t ns = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    return (double)ns / 1e9;
}

/* ------------------------------------------------------------------------------------------ shared */
typedef struct {
    PyObject *tracer, *main, *local, *groups, *resolve, *live, *done, *push, *pending, *stats;
    unsigned long main_tid;
    Py_ssize_t max_done, max_pending;
} Hot;

static int hot_from(Hot *h, PyObject *hot) {
    /* ``hot``: ops.Hot (tracer, main, main_tid, local, get_ident, groups, resolve, now, live, push, done,
     * max_done, pending, max_pending, stats) */
    if (!PyTuple_Check(hot) || PyTuple_GET_SIZE(hot) != 15) {
        PyErr_SetString(PyExc_TypeError, "hot must be an ops.Hot");
        return -1;
    }
#define H(i) PyTuple_GET_ITEM(hot, i)
    h->tracer = H(0); h->main = H(1); h->local = H(3); h->groups = H(5); h->resolve = H(6); h->live = H(8);
    h->push = H(9); h->done = H(10); h->pending = H(12); h->stats = H(14);
    h->main_tid = PyLong_AsUnsignedLong(H(2));
    h->max_done = PyLong_AsSsize_t(H(11));
    h->max_pending = PyLong_AsSsize_t(H(13));
#undef H
    if (PyErr_Occurred()) return -1;
    if (!PyDict_Check(h->groups) || !PyDict_Check(h->pending)) {
        PyErr_SetString(PyExc_TypeError, "hot.groups and the pending map must be dicts");
        return -1;
    }
    Py_INCREF(h->tracer); Py_INCREF(h->main); Py_INCREF(h->local); Py_INCREF(h->groups);
    Py_INCREF(h->resolve); Py_INCREF(h->live); Py_INCREF(h->push); Py_INCREF(h->done);
    Py_INCREF(h->pending); Py_INCREF(h->stats);
    return 0;
}

static int hot_traverse(Hot *h, visitproc visit, void *arg) {
    Py_VISIT(h->tracer); Py_VISIT(h->main); Py_VISIT(h->local); Py_VISIT(h->groups); Py_VISIT(h->resolve);
    Py_VISIT(h->live); Py_VISIT(h->push); Py_VISIT(h->done); Py_VISIT(h->pending); Py_VISIT(h->stats);
    return 0;
}

static void hot_clear(Hot *h) {
    Py_CLEAR(h->tracer); Py_CLEAR(h->main); Py_CLEAR(h->local); Py_CLEAR(h->groups); Py_CLEAR(h->resolve);
    Py_CLEAR(h->live); Py_CLEAR(h->push); Py_CLEAR(h->done); Py_CLEAR(h->pending); Py_CLEAR(h->stats);
}

/* The calling thread's nesting state (ops._Nesting), a new reference. */
static PyObject *nesting(Hot *h) {
    if (PyThread_get_thread_ident() == h->main_tid) {
        Py_INCREF(h->main);
        return h->main;
    }
    return PyObject_GetAttr(h->local, s_nesting);
}

static long get_long_attr(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v) return -1;
    long r = PyLong_AsLong(v);
    Py_DECREF(v);
    return r;
}

static int set_long_attr(PyObject *o, PyObject *name, long value) {
    PyObject *v = PyLong_FromLong(value);
    if (!v) return -1;
    int r = PyObject_SetAttr(o, name, v);
    Py_DECREF(v);
    return r;
}

/* Whether the tracer is enabled and the thread is outside any traced call: 1, 0, or -1 (error). */
static int tracing(Hot *h, PyObject *tls, long *depth) {
    PyObject *en = PyObject_GetAttr(h->tracer, s_enabled);
    if (!en) return -1;
    int on = PyObject_IsTrue(en);
    Py_DECREF(en);
    if (on <= 0) return on;
    *depth = get_long_attr(tls, s_depth);
    if (*depth == -1 && PyErr_Occurred()) return -1;
    return *depth == 0;
}

/* The pending exception handed to tracer.error(where, exc), which is never raised (as the Python sites'
 * ``except Exception: tracer.error(where, exc)``; BaseException subclasses such as KeyboardInterrupt are
 * kept pending for the caller, as there). Returns 0, or -1 when the exception must propagate. */
static int report(Hot *h, PyObject *where) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb && value) PyException_SetTraceback(value, tb);
    PyObject *r = PyObject_CallMethodObjArgs(h->tracer, s_error, where, value ? value : Py_None, NULL);
    Py_XDECREF(r);
    PyErr_Clear();  /* the tracer's own error path failing must not surface either */
    Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
    return 0;
}

/* Hand over one Entry: push(entry) when the done queue has room, else stats["dropped_done"] += 1. */
static int put(Hot *h, PyObject *entry) {
    Py_ssize_t n = PyObject_Length(h->done);
    if (n < 0) return -1;
    if (n < h->max_done) {
        PyObject *r = PyObject_CallOneArg(h->push, entry);
        if (!r) return -1;
        Py_DECREF(r);
        return 0;
    }
    PyObject *v = PyObject_GetItem(h->stats, s_dropped_done);
    if (!v) return -1;
    PyObject *w = PyNumber_Add(v, k_one);
    Py_DECREF(v);
    if (!w) return -1;
    int r = PyObject_SetItem(h->stats, s_dropped_done, w);
    Py_DECREF(w);
    return r;
}

/* Issued + (t_end, wait_s, live.key): the op's Entry (a new reference). */
static PyObject *entry_of(Hot *h, PyObject *issued, PyObject *t_end, PyObject *wait_s) {
    PyObject *key = PyObject_GetAttr(h->live, s_key);
    if (!key) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(issued);
    PyObject *e = PyTuple_New(n + 3);
    if (!e) { Py_DECREF(key); return NULL; }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyTuple_GET_ITEM(issued, i);
        Py_INCREF(x);
        PyTuple_SET_ITEM(e, i, x);
    }
    Py_INCREF(t_end); PyTuple_SET_ITEM(e, n, t_end);
    Py_INCREF(wait_s); PyTuple_SET_ITEM(e, n + 1, wait_s);
    PyTuple_SET_ITEM(e, n + 2, key);
    return e;
}

static int put_timed(Hot *h, PyObject *issued, double t_end, double wait_s) {
    PyObject *a = PyFloat_FromDouble(t_end), *b = PyFloat_FromDouble(wait_s);
    PyObject *e = (a && b) ? entry_of(h, issued, a, b) : NULL;
    Py_XDECREF(a); Py_XDECREF(b);
    if (!e) return -1;
    int r = put(h, e);
    Py_DECREF(e);
    return r;
}

/* ``original(*args)`` made as the wait of the op ``issued``: it completed at the call's return, and the call
 * is its blocked time (both wait sites). A failure of ours is reported, never raised; the call's own
 * exception propagates. */
static PyObject *timed_wait(Hot *h, PyObject *original, PyObject *const *args, size_t nargsf, PyObject *issued,
                            PyObject *where) {
    double t0 = now_s();
    PyObject *result = PyObject_Vectorcall(original, args, nargsf, NULL);
    if (!result) return NULL;
    double t1 = now_s();
    if (put_timed(h, issued, t1, t1 - t0) < 0 && report(h, where) < 0) {
        Py_DECREF(result);
        return NULL;
    }
    return result;
}

/* Store ``value`` under ``key`` in the pending map, or hand it to tracer.<overflow>(key_obj, item) when
 * the map is full (as the sites' inline ``track_*``). */
static int track(Hot *h, PyObject *key, PyObject *value, PyObject *overflow, PyObject *a, PyObject *b) {
    /* PyObject_SetItem, not PyDict_SetItem: the map's own __setitem__, as the Python sites' ``map[k] = v`` */
    if (PyDict_GET_SIZE(h->pending) < h->max_pending) return PyObject_SetItem(h->pending, key, value);
    PyObject *r = PyObject_CallMethodObjArgs(h->tracer, overflow, a, b, NULL);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* args[i] if given positionally, else the keyword ``name``; NULL (no error) when absent. */
/* Whether two names are equal: keyword names of a call and ours are interned (identifiers in code, our
 * names interned at init), and two distinct interned strings differ; only a name built at run time is
 * compared by content (a content compare per keyword and name measured 0.4 us on a P2P call by keyword). */
static inline int same_name(PyObject *a, PyObject *b) {
    if (a == b) return 1;
    if (PyUnicode_CHECK_INTERNED(a) && PyUnicode_CHECK_INTERNED(b)) return 0;
    int r = PyUnicode_Compare(a, b);
    if (r == -1 && PyErr_Occurred()) PyErr_Clear();
    return r == 0;
}

static PyObject *arg(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, Py_ssize_t i, PyObject *name) {
    if (i >= 0 && i < nargs) return args[i];
    if (kwnames && name) {
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t k = 0; k < nk; k++) {
            if (same_name(PyTuple_GET_ITEM(kwnames, k), name)) return args[nargs + k];
        }
    }
    return NULL;
}

/* A new reference to ``name``, interned where it is a str (so that same_name compares it by identity). */
static PyObject *interned(PyObject *name) {
    Py_INCREF(name);
    if (PyUnicode_CheckExact(name)) PyUnicode_InternInPlace(&name);
    return name;
}

/* GroupInfo.global_rank(group_peer) (agent/instrument/meshinfo.py), read from its ``ranks`` tuple here: the
 * method call is a Python frame per P2P op that names its peer by group rank, as pipelining's do. */
static PyObject *global_rank(PyObject *info, PyObject *group_peer) {
    if (PyLong_CheckExact(group_peer)) {
        PyObject *ranks = PyObject_GetAttr(info, s_ranks);
        if (ranks && PyTuple_CheckExact(ranks)) {
            int overflow = 0;
            long i = PyLong_AsLongAndOverflow(group_peer, &overflow);
            PyObject *peer = (!overflow && i >= 0 && i < PyTuple_GET_SIZE(ranks)) ? PyTuple_GET_ITEM(ranks, i)
                                                                                  : k_minus_one;
            Py_INCREF(peer);
            Py_DECREF(ranks);
            return peer;
        }
        Py_XDECREF(ranks);
        PyErr_Clear();
    }
    return PyObject_CallMethodOneArg(info, s_global_rank, group_peer);
}

/* Whether every keyword of the call is one of ``known`` (a tuple of str). */
static int all_known(PyObject *kwnames, PyObject *known) {
    Py_ssize_t nk = PyTuple_GET_SIZE(kwnames), nn = PyTuple_GET_SIZE(known);
    for (Py_ssize_t k = 0; k < nk; k++) {
        PyObject *kn = PyTuple_GET_ITEM(kwnames, k);
        int found = 0;
        for (Py_ssize_t j = 0; j < nn && !found; j++) found = same_name(kn, PyTuple_GET_ITEM(known, j));
        if (!found) return 0;
    }
    return 1;
}

/* The group's entry in hot.groups (designator, GroupInfo, counter, key), resolved if missing: a new ref. */
static PyObject *group_entry(Hot *h, PyObject *group) {
    PyObject *gid = PyLong_FromVoidPtr(group);
    if (!gid) return NULL;
    PyObject *hit = PyDict_GetItemWithError(h->groups, gid);
    Py_DECREF(gid);
    if (hit && PyTuple_Check(hit) && PyTuple_GET_SIZE(hit) == 4 && PyTuple_GET_ITEM(hit, 0) == group) {
        Py_INCREF(hit);
        return hit;
    }
    if (PyErr_Occurred()) return NULL;
    hit = PyObject_CallOneArg(h->resolve, group);
    if (hit && !(PyTuple_Check(hit) && PyTuple_GET_SIZE(hit) == 4)) {
        Py_DECREF(hit);
        PyErr_SetString(PyExc_TypeError, "the tracer's group entry is not a 4-tuple");
        return NULL;
    }
    return hit;
}


#endif
