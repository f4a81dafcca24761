/* The collective tracer's per-op path in C: what a Python wrapper cannot go below (a frame, the packing
 * of *args / **kwargs, a call per clock reading) is what this module removes.
 *
 * Each type here is the C form of one Python fast site, and does exactly what that site does on the
 * case it handles; anything else (a CUDA tensor, an argument missing, an op object of the general path)
 * goes to that Python site, ``slow``, which stays the reference (and the whole path where this module
 * is not built: ``agent/instrument/native.py``):
 *
 *   Site(KIND_C10D, ...)   comm_c10d._fast_one's wrapper   (one-tensor collectives, P2P)
 *   Site(KIND_FSDP, ...)   comm_fsdp._traced's ``fast``    (FSDP2's custom all-gather / reduce-scatter)
 *   Wait(...)              comm_c10d.wait's ``traced_wait`` (Work.wait, bound as a method)
 *   DdpOp(hot, group, n)   comm_ddp's op + ops.stamp_unwrap (a DDP bucket's op and its completion callback)
 *   read_fd(fd, n)         a pread that keeps the GIL      (cpu.ThreadCPU: /proc/thread-self/schedstat)
 *
 * Not here: the functional collectives (TP). Their wrappers must stay Python functions that Dynamo inlines
 * (a C callable in compiled TP code is a graph break), and a C site behind such a Python check measured
 * 0.4-1.0 us more per op than the Python site alone (bench/hooks_overhead.py, 3 pairs of runs).
 *
 * Timestamps are CLOCK_MONOTONIC converted as time.perf_counter converts it (native.py uses this module
 * only where perf_counter is that clock and the tracer's clock is perf_counter). The tuples built are the
 * ``Issued`` / ``Entry`` of agent/instrument/ops.py. Every failure of this code is telemetry's own:
 * handed to ``tracer.error(where, exc)``, never raised; the real call is made exactly once and its own
 * exception propagates unchanged.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

enum { KIND_C10D = 0, KIND_FSDP = 1 };

static PyObject *s_depth, *s_enabled, *s_nesting, *s_is_cuda, *s_nbytes, *s_key, *s_global_rank, *s_error,
    *s_track_work, *s_dropped_done, *s_group, *s_async_op;
static PyObject *k_minus_one, *k_one;

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
static PyObject *arg(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, Py_ssize_t i, PyObject *name) {
    if (i >= 0 && i < nargs) return args[i];
    if (kwnames && name) {
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t k = 0; k < nk; k++) {
            PyObject *kn = PyTuple_GET_ITEM(kwnames, k);
            if (kn == name || PyUnicode_Compare(kn, name) == 0) return args[nargs + k];
        }
        if (PyErr_Occurred()) PyErr_Clear();
    }
    return NULL;
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

/* ------------------------------------------------------------------------------------------- Site */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    Hot h;
    int kind;
    PyObject *original, *slow, *op, *source, *where, *tname, *coalesce, *works, *learn;
    Py_ssize_t ti, gi, ai, pi, buffer;
    int fixed_async;
} Site;

static PyObject *call_original(Site *s, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return PyObject_Vectorcall(s->original, args, nargsf, kwnames);
}

/* Restore the nesting depth after the real call, keeping the call's own exception, if any, pending. */
static void leave(PyObject *tls, long depth) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (set_long_attr(tls, s_depth, depth) < 0) PyErr_Clear();
    PyErr_Restore(type, value, tb);
}

static PyObject *site_call(Site *s, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Hot *h = &s->h;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *tls = nesting(h);
    if (!tls) {
        if (report(h, s->where) < 0) return NULL;
        return call_original(s, args, nargsf, kwnames);
    }
    long depth = 0;
    int on = tracing(h, tls, &depth);
    if (on < 0) {
        Py_DECREF(tls);
        if (report(h, s->where) < 0) return NULL;
        return call_original(s, args, nargsf, kwnames);
    }
    if (!on || (s->coalesce && PyDict_GET_SIZE(s->coalesce))) {
        Py_DECREF(tls);
        return call_original(s, args, nargsf, kwnames);
    }

    /* describe: the tensor, the group, async-ness; anything unexpected goes to the Python site */
    PyObject *t, *group;
    int async_op = 0;
    if (s->kind == KIND_FSDP) {
        if (nargs < 4 || kwnames) goto slow;
        t = args[s->buffer];
        group = args[2];
        async_op = PyObject_IsTrue(args[nargs - 1]);
    } else {
        t = arg(args, nargs, kwnames, s->ti, s->tname);
        if (!t) goto slow;
        group = arg(args, nargs, kwnames, s->gi, s_group);
        if (!group) group = Py_None;
        if (s->fixed_async >= 0) {
            async_op = s->fixed_async;
        } else {
            PyObject *a = arg(args, nargs, kwnames, s->ai, s_async_op);
            async_op = a ? PyObject_IsTrue(a) : 0;
        }
    }
    PyObject *hit = NULL, *issued = NULL, *nbytes = NULL, *peer = NULL, *seq = NULL, *t0 = NULL;
    if (async_op < 0) goto describe_failed;
    PyObject *cuda = PyObject_GetAttr(t, s_is_cuda);
    if (!cuda) goto describe_failed;
    int is_cuda = PyObject_IsTrue(cuda);
    Py_DECREF(cuda);
    if (is_cuda) {
        if (is_cuda < 0) goto describe_failed;
        goto slow;
    }
    if (s->kind == KIND_C10D && s->pi >= 0 && nargs < s->pi + 4) goto slow;
    hit = group_entry(h, group);
    if (!hit) goto describe_failed;
    nbytes = PyObject_GetAttr(t, s_nbytes);
    if (!nbytes) goto describe_failed;
    if (s->kind == KIND_C10D && s->pi >= 0) {  /* P2P: the peer's global rank, or the group peer's */
        peer = args[s->pi];
        if (peer == Py_None) {
            PyObject *group_peer = args[s->pi + 3];
            if (group_peer == Py_None) {
                peer = k_minus_one;
                Py_INCREF(peer);
            } else {
                peer = PyObject_CallMethodOneArg(PyTuple_GET_ITEM(hit, 1), s_global_rank, group_peer);
                if (!peer) goto describe_failed;
            }
        } else {
            Py_INCREF(peer);
        }
    } else {
        peer = k_minus_one;
        Py_INCREF(peer);
    }
    seq = PyIter_Next(PyTuple_GET_ITEM(hit, 2));
    if (!seq) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_StopIteration, "group counter exhausted");
        goto describe_failed;
    }
    double t_start = now_s();
    t0 = PyFloat_FromDouble(t_start);
    if (!t0) goto describe_failed;
    issued = PyTuple_Pack(7, s->op, PyTuple_GET_ITEM(hit, 3), nbytes, peer, s->source, seq, t0);
    if (!issued) goto describe_failed;
    Py_CLEAR(hit); Py_CLEAR(nbytes); Py_CLEAR(peer); Py_CLEAR(seq); Py_CLEAR(t0);

    /* the real call, inside the op: a traced call it makes is this op */
    if (set_long_attr(tls, s_depth, depth + 1) < 0) {
        Py_DECREF(issued);
        goto describe_failed;
    }
    PyObject *result = call_original(s, args, nargsf, kwnames);
    leave(tls, depth);
    Py_DECREF(tls);
    if (!result) {
        Py_DECREF(issued);
        return NULL;
    }

    /* finish */
    int r = 0;
    if (!async_op || (s->kind == KIND_FSDP && result == Py_None)) {
        /* returned once its op completed: the whole call was blocked time */
        double t_end = now_s();
        r = put_timed(h, issued, t_end, t_end - t_start);
    } else if (s->kind == KIND_FSDP) {  /* async_op with a work: completed by its Work.wait */
        PyObject *key = PyLong_FromVoidPtr(result);
        PyObject *pair = key ? PyTuple_Pack(2, result, issued) : NULL;
        r = pair ? track(h, key, pair, s_track_work, result, issued) : -1;
        Py_XDECREF(key); Py_XDECREF(pair);
    } else {  /* an async c10d call: tracked until its Work.wait when its result is a Work */
        PyObject *ok = PyDict_GetItemWithError(s->works, (PyObject *)Py_TYPE(result));
        int is_work;
        if (ok) {
            is_work = PyObject_IsTrue(ok);
        } else if (PyErr_Occurred()) {
            is_work = -1;
        } else {
            PyObject *learned = PyObject_CallOneArg(s->learn, result);
            is_work = learned ? PyObject_IsTrue(learned) : -1;
            Py_XDECREF(learned);
        }
        if (is_work > 0) {
            PyObject *key = PyLong_FromVoidPtr(result);
            PyObject *pair = key ? PyTuple_Pack(2, result, issued) : NULL;
            r = pair ? track(h, key, pair, s_track_work, result, issued) : -1;
            Py_XDECREF(key); Py_XDECREF(pair);
        } else {
            r = is_work;
        }
    }
    Py_DECREF(issued);
    if (r < 0 && report(h, s->where) < 0) {
        Py_DECREF(result);
        return NULL;
    }
    return result;

describe_failed:
    Py_XDECREF(hit); Py_XDECREF(nbytes); Py_XDECREF(peer); Py_XDECREF(seq); Py_XDECREF(t0);
    Py_DECREF(tls);
    if (report(h, s->where) < 0) return NULL;
    return call_original(s, args, nargsf, kwnames);

slow:
    Py_DECREF(tls);
    return PyObject_Vectorcall(s->slow, args, nargsf, kwnames);
}

static PyObject *site_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"kind", "original", "slow", "hot", "op", "source", "where", "tensor", "group",
                             "async_op", "tensor_kw", "fixed_async", "peer", "buffer", "coalesce", "works",
                             "learn", NULL};
    int kind, fixed_async = -1;
    PyObject *original, *slow, *hot, *op, *source, *where, *tname = Py_None, *coalesce = Py_None,
        *works = Py_None, *learn = Py_None;
    Py_ssize_t ti = -1, gi = -1, ai = -1, pi = -1, buffer = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOOOUUU|nnnOinnOOO:Site", kwlist, &kind, &original, &slow,
                                     &hot, &op, &source, &where, &ti, &gi, &ai, &tname, &fixed_async, &pi,
                                     &buffer, &coalesce, &works, &learn))
        return NULL;
    if (kind < KIND_C10D || kind > KIND_FSDP || !PyCallable_Check(original) || !PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_ValueError, "Site: bad kind, or original / slow not callable");
        return NULL;
    }
    if (kind == KIND_C10D && (!PyDict_Check(works) || !PyCallable_Check(learn) || ti < 0)) {
        PyErr_SetString(PyExc_ValueError, "Site: a c10d site needs tensor, works (a dict) and learn");
        return NULL;
    }
    if (kind == KIND_FSDP && (buffer < 0 || buffer > 1)) {
        PyErr_SetString(PyExc_ValueError, "Site: an FSDP site's buffer is 0 or 1");
        return NULL;
    }
    if (coalesce != Py_None && !PyDict_Check(coalesce)) {
        PyErr_SetString(PyExc_TypeError, "Site: coalesce must be a dict");
        return NULL;
    }
    Site *s = (Site *)type->tp_alloc(type, 0);
    if (!s) return NULL;
    if (hot_from(&s->h, hot) < 0) {
        Py_DECREF(s);
        return NULL;
    }
    s->vectorcall = (vectorcallfunc)site_call;
    s->kind = kind;
    s->original = Py_NewRef(original); s->slow = Py_NewRef(slow); s->op = Py_NewRef(op);
    s->source = Py_NewRef(source); s->where = Py_NewRef(where);
    s->tname = tname == Py_None ? NULL : Py_NewRef(tname);
    s->coalesce = coalesce == Py_None ? NULL : Py_NewRef(coalesce);
    s->works = works == Py_None ? NULL : Py_NewRef(works);
    s->learn = learn == Py_None ? NULL : Py_NewRef(learn);
    s->ti = ti; s->gi = gi; s->ai = ai; s->pi = pi; s->buffer = buffer;
    s->fixed_async = fixed_async;
    return (PyObject *)s;
}

static int site_traverse(Site *s, visitproc visit, void *arg) {
    Py_VISIT(s->dict); Py_VISIT(s->original); Py_VISIT(s->slow); Py_VISIT(s->op); Py_VISIT(s->source);
    Py_VISIT(s->where); Py_VISIT(s->tname); Py_VISIT(s->coalesce); Py_VISIT(s->works); Py_VISIT(s->learn);
    return hot_traverse(&s->h, visit, arg);
}

static int site_clear(Site *s) {
    Py_CLEAR(s->dict); Py_CLEAR(s->original); Py_CLEAR(s->slow); Py_CLEAR(s->op); Py_CLEAR(s->source);
    Py_CLEAR(s->where); Py_CLEAR(s->tname); Py_CLEAR(s->coalesce); Py_CLEAR(s->works); Py_CLEAR(s->learn);
    hot_clear(&s->h);
    return 0;
}

static void site_dealloc(Site *s) {
    PyObject_GC_UnTrack(s);
    site_clear(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *bind_method(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyGetSetDef dict_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SiteType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "meshscope.agent.instrument._hot.Site",
    .tp_doc = "A traced issue call (see the module docstring of agent/instrument/_hot.c).",
    .tp_basicsize = sizeof(Site),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = site_new,
    .tp_traverse = (traverseproc)site_traverse,
    .tp_clear = (inquiry)site_clear,
    .tp_dealloc = (destructor)site_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Site, vectorcall),
    .tp_dictoffset = offsetof(Site, dict),
    .tp_getset = dict_getset,
};

/* ------------------------------------------------------------------------------------------- Wait */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    Hot h;
    PyObject *original, *slow, *where;
} Wait;

/* The pending entry of ``key``, popped (a new reference), or NULL (none; or an error pending). */
static PyObject *pop_pending(Hot *h, PyObject *key) {
    PyObject *v = PyDict_GetItemWithError(h->pending, key);
    if (!v) return NULL;
    Py_INCREF(v);
    if (PyDict_DelItem(h->pending, key) < 0) {
        Py_DECREF(v);
        return NULL;
    }
    return v;
}

static PyObject *wait_call(Wait *w, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Hot *h = &w->h;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1 || kwnames || nargs > 2) return PyObject_Vectorcall(w->slow, args, nargsf, kwnames);
    PyObject *work = args[0];
    if (PyDict_GET_SIZE(h->pending) == 0) return PyObject_Vectorcall(w->original, args, nargsf, NULL);
    PyObject *key = PyLong_FromVoidPtr(work);
    if (!key) {
        if (report(h, w->where) < 0) return NULL;
        return PyObject_Vectorcall(w->original, args, nargsf, NULL);
    }
    PyObject *entry = pop_pending(h, key);
    if (!entry) {
        Py_DECREF(key);
        if (PyErr_Occurred() && report(h, w->where) < 0) return NULL;
        return PyObject_Vectorcall(w->original, args, nargsf, NULL);
    }
    /* (work, ops): a fast site's Issued when ops is a tuple; anything else (an op list; another work's
     * entry under a reused id) goes back where it was found, for the Python wait */
    PyObject *issued = NULL;
    if (PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) == 2 && PyTuple_GET_ITEM(entry, 0) == work
        && PyTuple_CheckExact(PyTuple_GET_ITEM(entry, 1)))
        issued = PyTuple_GET_ITEM(entry, 1);
    if (!issued) {
        int r = PyObject_SetItem(h->pending, key, entry);
        Py_DECREF(key); Py_DECREF(entry);
        if (r < 0 && report(h, w->where) < 0) return NULL;
        return PyObject_Vectorcall(w->slow, args, nargsf, NULL);
    }
    Py_DECREF(key);
    double t0 = now_s();
    PyObject *result = PyObject_Vectorcall(w->original, args, nargsf, NULL);
    if (!result) {
        Py_DECREF(entry);
        return NULL;
    }
    double t1 = now_s();
    if (put_timed(h, issued, t1, t1 - t0) < 0 && report(h, w->where) < 0) {
        Py_DECREF(entry); Py_DECREF(result);
        return NULL;
    }
    Py_DECREF(entry);
    return result;
}

static PyObject *wait_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"original", "slow", "hot", "where", NULL};
    PyObject *original, *slow, *hot, *where;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOU:Wait", kwlist, &original, &slow, &hot, &where)) return NULL;
    if (!PyCallable_Check(original) || !PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_ValueError, "Wait: original / slow not callable");
        return NULL;
    }
    Wait *w = (Wait *)type->tp_alloc(type, 0);
    if (!w) return NULL;
    if (hot_from(&w->h, hot) < 0) {
        Py_DECREF(w);
        return NULL;
    }
    w->vectorcall = (vectorcallfunc)wait_call;
    w->original = Py_NewRef(original); w->slow = Py_NewRef(slow); w->where = Py_NewRef(where);
    return (PyObject *)w;
}

static int wait_traverse(Wait *w, visitproc visit, void *arg) {
    Py_VISIT(w->dict); Py_VISIT(w->original); Py_VISIT(w->slow); Py_VISIT(w->where);
    return hot_traverse(&w->h, visit, arg);
}

static int wait_clear(Wait *w) {
    Py_CLEAR(w->dict); Py_CLEAR(w->original); Py_CLEAR(w->slow); Py_CLEAR(w->where);
    hot_clear(&w->h);
    return 0;
}

static void wait_dealloc(Wait *w) {
    PyObject_GC_UnTrack(w);
    wait_clear(w);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

/* Bound as a method when stored on a class (Work.wait), as the Python function it replaces was;
 * Py_TPFLAGS_METHOD_DESCRIPTOR lets ``work.wait()`` call it with the work first, no bound method built. */
static PyTypeObject WaitType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "meshscope.agent.instrument._hot.Wait",
    .tp_doc = "A traced wait (see the module docstring of agent/instrument/_hot.c).",
    .tp_basicsize = sizeof(Wait),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = wait_new,
    .tp_traverse = (traverseproc)wait_traverse,
    .tp_clear = (inquiry)wait_clear,
    .tp_dealloc = (destructor)wait_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Wait, vectorcall),
    .tp_dictoffset = offsetof(Wait, dict),
    .tp_getset = dict_getset,
    .tp_descr_get = bind_method,
};

/* ------------------------------------------------------------------------------------------ DdpOp */
/* A DDP bucket's op on CPU (comm_ddp): DdpOp(hot, group, nbytes) is the op record ``tracer.begin`` makes
 * (ops._Op's fields, ``cuda`` None), issued now, and also its future's completion callback, which stamps
 * ``t_done`` and returns the bucket's tensor (ops.stamp_unwrap bound to the op). */
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *op, *key, *nbytes, *peer, *source, *seq, *t_start, *t_done, *cuda, *info;
} DdpOp;

static PyObject *s_value, *s_all_reduce, *s_ddp_comm_hook;

static PyObject *ddpop_call(DdpOp *d, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames) {
        PyErr_SetString(PyExc_TypeError, "a DdpOp is called with the future only");
        return NULL;
    }
    PyObject *t = PyFloat_FromDouble(now_s());  /* on the backend's thread, holding the GIL */
    if (!t) return NULL;
    Py_XSETREF(d->t_done, t);
    PyObject *value = PyObject_CallMethodNoArgs(args[0], s_value);
    if (!value) return NULL;
    PyObject *first = PySequence_GetItem(value, 0);
    Py_DECREF(value);
    return first;
}

static PyObject *ddpop_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *hot, *group, *nbytes;
    if (!PyArg_ParseTuple(args, "OOO:DdpOp", &hot, &group, &nbytes)) return NULL;
    Hot h;
    if (!PyTuple_Check(hot) || PyTuple_GET_SIZE(hot) != 15 || !PyDict_Check(PyTuple_GET_ITEM(hot, 5))) {
        PyErr_SetString(PyExc_TypeError, "hot must be an ops.Hot");
        return NULL;
    }
    h.groups = PyTuple_GET_ITEM(hot, 5);
    h.resolve = PyTuple_GET_ITEM(hot, 6);
    PyObject *hit = group_entry(&h, group);
    if (!hit) return NULL;
    PyObject *seq = PyIter_Next(PyTuple_GET_ITEM(hit, 2));
    if (!seq) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_StopIteration, "group counter exhausted");
        Py_DECREF(hit);
        return NULL;
    }
    PyObject *t0 = PyFloat_FromDouble(now_s());
    DdpOp *d = t0 ? (DdpOp *)type->tp_alloc(type, 0) : NULL;
    if (!d) {
        Py_DECREF(hit); Py_DECREF(seq); Py_XDECREF(t0);
        return NULL;
    }
    d->vectorcall = (vectorcallfunc)ddpop_call;
    d->op = Py_NewRef(s_all_reduce);
    d->info = Py_NewRef(PyTuple_GET_ITEM(hit, 1));
    d->key = Py_NewRef(PyTuple_GET_ITEM(hit, 3));
    d->nbytes = Py_NewRef(nbytes);
    d->peer = Py_NewRef(k_minus_one);
    d->source = Py_NewRef(s_ddp_comm_hook);
    d->seq = seq;
    d->t_start = t0;
    d->t_done = Py_NewRef(Py_None);
    d->cuda = Py_NewRef(Py_None);
    Py_DECREF(hit);
    return (PyObject *)d;
}

static int ddpop_traverse(DdpOp *d, visitproc visit, void *arg) {
    Py_VISIT(d->op); Py_VISIT(d->key); Py_VISIT(d->nbytes); Py_VISIT(d->peer); Py_VISIT(d->source);
    Py_VISIT(d->seq); Py_VISIT(d->t_start); Py_VISIT(d->t_done); Py_VISIT(d->cuda); Py_VISIT(d->info);
    return 0;
}

static int ddpop_clear(DdpOp *d) {
    Py_CLEAR(d->op); Py_CLEAR(d->key); Py_CLEAR(d->nbytes); Py_CLEAR(d->peer); Py_CLEAR(d->source);
    Py_CLEAR(d->seq); Py_CLEAR(d->t_start); Py_CLEAR(d->t_done); Py_CLEAR(d->cuda); Py_CLEAR(d->info);
    return 0;
}

static void ddpop_dealloc(DdpOp *d) {
    PyObject_GC_UnTrack(d);
    ddpop_clear(d);
    Py_TYPE(d)->tp_free((PyObject *)d);
}

static PyMemberDef ddpop_members[] = {
    {"op", T_OBJECT, offsetof(DdpOp, op), READONLY, NULL},
    {"info", T_OBJECT, offsetof(DdpOp, info), READONLY, NULL},
    {"key", T_OBJECT, offsetof(DdpOp, key), READONLY, NULL},
    {"nbytes", T_OBJECT, offsetof(DdpOp, nbytes), READONLY, NULL},
    {"peer", T_OBJECT, offsetof(DdpOp, peer), READONLY, NULL},
    {"source", T_OBJECT, offsetof(DdpOp, source), READONLY, NULL},
    {"seq", T_OBJECT, offsetof(DdpOp, seq), READONLY, NULL},
    {"t_start", T_OBJECT, offsetof(DdpOp, t_start), READONLY, NULL},
    {"t_done", T_OBJECT, offsetof(DdpOp, t_done), 0, NULL},
    {"cuda", T_OBJECT, offsetof(DdpOp, cuda), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject DdpOpType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "meshscope.agent.instrument._hot.DdpOp",
    .tp_doc = "DdpOp(hot, group, nbytes): a DDP bucket's op, and its completion callback (comm_ddp).",
    .tp_basicsize = sizeof(DdpOp),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = ddpop_new,
    .tp_traverse = (traverseproc)ddpop_traverse,
    .tp_clear = (inquiry)ddpop_clear,
    .tp_dealloc = (destructor)ddpop_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(DdpOp, vectorcall),
    .tp_members = ddpop_members,
};

/* ---------------------------------------------------------------------------------------- read_fd */
static PyObject *read_fd(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "read_fd(fd, n)");
        return NULL;
    }
    int fd = PyLong_AsLong(args[0]);
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (n <= 0 || n > 4096) {
        PyErr_SetString(PyExc_ValueError, "read_fd: n must be in 1..4096");
        return NULL;
    }
    char buf[4096];
    /* The GIL is kept: a read of a /proc file does not block, and releasing it would hand it to the
     * flusher thread at every read (see agent/instrument/cpu.py). */
    ssize_t got = pread(fd, buf, (size_t)n, 0);
    if (got < 0) return PyErr_SetFromErrno(PyExc_OSError);
    return PyBytes_FromStringAndSize(buf, got);
}

static PyObject *perf_counter(PyObject *module, PyObject *unused) {
    return PyFloat_FromDouble(now_s());
}

static PyMethodDef methods[] = {
    {"read_fd", (PyCFunction)(void (*)(void))read_fd, METH_FASTCALL,
     "read_fd(fd, n) -> bytes: pread(fd, n, 0) with the GIL held."},
    {"perf_counter", perf_counter, METH_NOARGS, "This module's clock (time.perf_counter's, where native.py uses it)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_hot", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hot(void) {
#define INTERN(var, text) if (!(var = PyUnicode_InternFromString(text))) return NULL
    INTERN(s_depth, "depth"); INTERN(s_enabled, "enabled"); INTERN(s_nesting, "nesting");
    INTERN(s_is_cuda, "is_cuda"); INTERN(s_nbytes, "nbytes"); INTERN(s_key, "key");
    INTERN(s_global_rank, "global_rank"); INTERN(s_error, "error"); INTERN(s_track_work, "track_work");
    INTERN(s_dropped_done, "dropped_done"); INTERN(s_group, "group"); INTERN(s_async_op, "async_op");
    INTERN(s_value, "value");
    INTERN(s_all_reduce, "all_reduce"); INTERN(s_ddp_comm_hook, "ddp_comm_hook");
#undef INTERN
    if (!(k_minus_one = PyLong_FromLong(-1)) || !(k_one = PyLong_FromLong(1)))
        return NULL;
    if (PyType_Ready(&SiteType) < 0 || PyType_Ready(&WaitType) < 0 || PyType_Ready(&DdpOpType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Site", (PyObject *)&SiteType) < 0
        || PyModule_AddObjectRef(m, "Wait", (PyObject *)&WaitType) < 0
        || PyModule_AddObjectRef(m, "DdpOp", (PyObject *)&DdpOpType) < 0
        || PyModule_AddIntConstant(m, "KIND_C10D", KIND_C10D) < 0
        || PyModule_AddIntConstant(m, "KIND_FSDP", KIND_FSDP) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
