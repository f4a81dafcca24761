/* The collective tracer's per-op path in C: what a Python wrapper cannot go below (a frame, the packing
 * of *args / **kwargs, a call per clock reading) is what this module removes.
 *
 * Each type here is the C form of one Python fast site, and does exactly what that site does on the
 * case it handles; anything else (a CUDA tensor, an argument missing, an op object of the general path)
 * goes to that Python site, ``slow``, which stays the reference (and the whole path where this module
 * is not built: ``agent/instrument/native.py``):
 *
 * (one translation unit: _hot_common.h holds what the sites share, _hot_sites.h Site and Wait, _hot_batch.h
 * Batch, _hot_funcol.h Funcol, this file DdpOp, Span,
 * SharedCount, read_fd and the module)
 *
 *   Site(KIND_C10D, ...)   comm_c10d._fast_one's wrapper   (one-tensor collectives, P2P)
 *   Site(KIND_FSDP, ...)   comm_fsdp._traced's ``fast``    (FSDP2's custom all-gather / reduce-scatter)
 *   Wait(...)              comm_c10d.wait's ``traced_wait`` (Work.wait, bound as a method)
 *   Batch(...)             comm_c10d.batch's ``wrapper``    (batch_isend_irecv on gloo: pipeline P2P)
 *   DdpOps(hot, group)(n)  comm_ddp's op + ops.stamp_unwrap (a DDP bucket's op, DdpOp, and its completion
 *                          callback), for one DDP model's group: its entry looked up once
 *   Span(...)              pipeline.PipelineTracer's deferred ``span`` (a pipeline stage's compute)
 *   FuncolSlot(...).fn     comm_funcol.single's wrapper and its ``wait_tensor`` (the functional collectives,
 *                          TP): a builtin, which torch.compile is told to trace as torch's own function
 *                          (native.funcol_site; a C callable it cannot trace would be a graph break)
 *   SharedCount(addr, o)   a group's issue counter shared with the functional-collective kernels
 *                          (funcol_kernels.py: agent/instrument/_funcol_kernels.cpp)
 *   read_fd(fd, n)         a pread that keeps the GIL      (cpu.ThreadCPU: /proc/thread-self/schedstat)
 *
 * Timestamps are CLOCK_MONOTONIC converted as time.perf_counter converts it (native.py uses this module
 * only where perf_counter is that clock and the tracer's clock is perf_counter). The tuples built are the
 * ``Issued`` / ``Entry`` of agent/instrument/ops.py. Every failure of this code is telemetry's own:
 * handed to ``tracer.error(where, exc)``, never raised; the real call is made exactly once and its own
 * exception propagates unchanged.
 */
#include "_hot_common.h"
#include "_hot_sites.h"
#include "_hot_batch.h"
#include "_hot_funcol.h"

#include <structmember.h>

/* ------------------------------------------------------------------------------------------ DdpOp */
/* A DDP bucket's op on CPU (comm_ddp): DdpOps(hot, group)(nbytes) makes the op record ``tracer.begin`` makes
 * (ops._Op's fields, ``cuda`` None), issued now, and also its future's completion callback, which stamps
 * ``t_done`` and returns the bucket's tensor (ops.stamp_unwrap bound to the op). */

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

/* A DdpOp of the group entry ``hit`` (designator, GroupInfo, counter, key) and ``nbytes``, issued now. */
static PyObject *ddpop_make(PyTypeObject *type, PyObject *hit, PyObject *nbytes) {
    PyObject *seq = PyIter_Next(PyTuple_GET_ITEM(hit, 2));
    if (!seq) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_StopIteration, "group counter exhausted");
        return NULL;
    }
    PyObject *t0 = PyFloat_FromDouble(now_s());
    DdpOp *d = t0 ? (DdpOp *)type->tp_alloc(type, 0) : NULL;
    if (!d) {
        Py_DECREF(seq); Py_XDECREF(t0);
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
    return (PyObject *)d;
}

/* The group's entry in ``hot``'s table (resolved if missing), a new reference. */
static PyObject *ddp_group_entry(PyObject *hot, PyObject *group) {
    Hot h;
    if (!PyTuple_Check(hot) || PyTuple_GET_SIZE(hot) != 15 || !PyDict_Check(PyTuple_GET_ITEM(hot, 5))) {
        PyErr_SetString(PyExc_TypeError, "hot must be an ops.Hot");
        return NULL;
    }
    h.groups = PyTuple_GET_ITEM(hot, 5);
    h.resolve = PyTuple_GET_ITEM(hot, 6);
    return group_entry(&h, group);
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
    .tp_doc = "A DDP bucket's op, and its completion callback (comm_ddp; made by DdpOps).",
    .tp_basicsize = sizeof(DdpOp),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_traverse = (traverseproc)ddpop_traverse,
    .tp_clear = (inquiry)ddpop_clear,
    .tp_dealloc = (destructor)ddpop_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(DdpOp, vectorcall),
    .tp_members = ddpop_members,
};

/* DdpOps(hot, group): a DDP model's bucket ops, made by calling it with a bucket's bytes, the group's entry
 * looked up once, here (its GroupInfo, counter and key stay the group's for the tracer's life), and no
 * argument tuple per bucket. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *hit;
} DdpOps;

static PyObject *ddpops_call(DdpOps *f, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames) {
        PyErr_SetString(PyExc_TypeError, "DdpOps is called with a bucket's bytes only");
        return NULL;
    }
    return ddpop_make(&DdpOpType, f->hit, args[0]);
}

static PyObject *ddpops_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *hot, *group;
    if (!PyArg_ParseTuple(args, "OO:DdpOps", &hot, &group)) return NULL;
    PyObject *hit = ddp_group_entry(hot, group);
    if (!hit) return NULL;
    DdpOps *f = (DdpOps *)type->tp_alloc(type, 0);
    if (!f) {
        Py_DECREF(hit);
        return NULL;
    }
    f->vectorcall = (vectorcallfunc)ddpops_call;
    f->hit = hit;
    return (PyObject *)f;
}

static int ddpops_traverse(DdpOps *f, visitproc visit, void *arg) {
    Py_VISIT(f->hit);
    return 0;
}

static int ddpops_clear(DdpOps *f) {
    Py_CLEAR(f->hit);
    return 0;
}

static void ddpops_dealloc(DdpOps *f) {
    PyObject_GC_UnTrack(f);
    ddpops_clear(f);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

static PyTypeObject DdpOpsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "meshscope.agent.instrument._hot.DdpOps",
    .tp_doc = "DdpOps(hot, group)(nbytes) -> DdpOp: a DDP model's bucket ops (comm_ddp).",
    .tp_basicsize = sizeof(DdpOps),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = ddpops_new,
    .tp_traverse = (traverseproc)ddpops_traverse,
    .tp_clear = (inquiry)ddpops_clear,
    .tp_dealloc = (destructor)ddpops_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(DdpOps, vectorcall),
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

/* ------------------------------------------------------------------------------------------- Span */
/* pipeline.PipelineTracer._wrap_deferred's ``span``: a stage's compute method, timed; the span appended to
 * ``spans`` as (stage index, microbatch, kind, t0, t1) while it holds fewer than ``limit``, else
 * ``tracer.dropped`` counted. Recorded whether the method returns or raises (the Python span's
 * ``finally``); the method's own result or exception passes through unchanged. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    PyObject *method, *spans, *index, *kind, *chunk_kw, *tracer;
    Py_ssize_t limit;
} Span;

static PyObject *s_dropped;

static void span_dropped(Span *s) {
    PyObject *n = PyObject_GetAttr(s->tracer, s_dropped);
    PyObject *n1 = n ? PyNumber_Add(n, k_one) : NULL;
    if (!n1 || PyObject_SetAttr(s->tracer, s_dropped, n1) < 0) PyErr_Clear();
    Py_XDECREF(n); Py_XDECREF(n1);
}

static PyObject *span_call(Span *s, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    double t0 = now_s();
    PyObject *result = PyObject_Vectorcall(s->method, args, nargsf, kwnames);
    double t1 = now_s();
    PyObject *type = NULL, *value = NULL, *tb = NULL;
    if (!result) PyErr_Fetch(&type, &value, &tb);
    if (PyList_GET_SIZE(s->spans) < s->limit) {
        Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
        PyObject *mb = nargs > 0 ? args[0] : arg(args, nargs, kwnames, -1, s->chunk_kw);
        PyObject *a = PyFloat_FromDouble(t0), *b = a ? PyFloat_FromDouble(t1) : NULL;
        PyObject *entry = b ? PyTuple_Pack(5, s->index, mb ? mb : k_minus_one, s->kind, a, b) : NULL;
        if (!entry || PyList_Append(s->spans, entry) < 0) {
            PyErr_Clear();
            span_dropped(s);  /* no memory for the span: counted as one not kept */
        }
        Py_XDECREF(a); Py_XDECREF(b); Py_XDECREF(entry);
    } else {
        span_dropped(s);
    }
    if (!result) PyErr_Restore(type, value, tb);
    return result;
}

static PyObject *span_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"method", "spans", "index", "kind", "chunk_kw", "tracer", "limit", NULL};
    PyObject *method, *spans, *index, *kind, *chunk_kw, *tracer;
    Py_ssize_t limit;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!OUUOn:Span", kwlist, &method, &PyList_Type, &spans, &index,
                                     &kind, &chunk_kw, &tracer, &limit))
        return NULL;
    if (!PyCallable_Check(method)) {
        PyErr_SetString(PyExc_TypeError, "Span: method must be callable");
        return NULL;
    }
    Span *s = (Span *)type->tp_alloc(type, 0);
    if (!s) return NULL;
    s->vectorcall = (vectorcallfunc)span_call;
    s->method = Py_NewRef(method); s->spans = Py_NewRef(spans); s->index = Py_NewRef(index);
    s->kind = Py_NewRef(kind); s->chunk_kw = interned(chunk_kw); s->tracer = Py_NewRef(tracer);
    s->limit = limit;
    return (PyObject *)s;
}

static int span_traverse(Span *s, visitproc visit, void *arg) {
    Py_VISIT(s->dict); Py_VISIT(s->method); Py_VISIT(s->spans); Py_VISIT(s->index); Py_VISIT(s->kind);
    Py_VISIT(s->chunk_kw); Py_VISIT(s->tracer);
    return 0;
}

static int span_clear(Span *s) {
    Py_CLEAR(s->dict); Py_CLEAR(s->method); Py_CLEAR(s->spans); Py_CLEAR(s->index); Py_CLEAR(s->kind);
    Py_CLEAR(s->chunk_kw); Py_CLEAR(s->tracer);
    return 0;
}

static void span_dealloc(Span *s) {
    PyObject_GC_UnTrack(s);
    span_clear(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyTypeObject SpanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "meshscope.agent.instrument._hot.Span",
    .tp_doc = "A pipeline stage's compute method, timed (see agent/instrument/_hot.c).",
    .tp_basicsize = sizeof(Span),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = span_new,
    .tp_traverse = (traverseproc)span_traverse,
    .tp_clear = (inquiry)span_clear,
    .tp_dealloc = (destructor)span_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Span, vectorcall),
    .tp_dictoffset = offsetof(Span, dict),
    .tp_getset = dict_getset,
};

/* ------------------------------------------------------------------------------------ SharedCount */
/* SharedCount(address, owner): an iterator over 1, 2, 3, ... counted in the int64 at ``address``, which
 * ``owner`` keeps alive: a group's issue counter shared with the functional-collective kernels
 * (agent/instrument/funcol_kernels.py), taken with ``next`` by every site as an itertools.count is. */
typedef struct {
    PyObject_HEAD
    int64_t *count;
    PyObject *owner;
} SharedCount;

static PyObject *sharedcount_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *address, *owner;
    if (!PyArg_ParseTuple(args, "OO:SharedCount", &address, &owner)) return NULL;
    void *p = PyLong_AsVoidPtr(address);
    if (!p) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "SharedCount: a null address");
        return NULL;
    }
    SharedCount *c = (SharedCount *)type->tp_alloc(type, 0);
    if (!c) return NULL;
    c->count = (int64_t *)p;
    c->owner = Py_NewRef(owner);
    return (PyObject *)c;
}

static PyObject *sharedcount_next(SharedCount *c) {
    return PyLong_FromLongLong(__atomic_add_fetch(c->count, 1, __ATOMIC_SEQ_CST));
}

static int sharedcount_traverse(SharedCount *c, visitproc visit, void *arg) {
    Py_VISIT(c->owner);
    return 0;
}

static int sharedcount_clear(SharedCount *c) {
    Py_CLEAR(c->owner);
    return 0;
}

static void sharedcount_dealloc(SharedCount *c) {
    PyObject_GC_UnTrack(c);
    sharedcount_clear(c);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyTypeObject SharedCountType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "meshscope.agent.instrument._hot.SharedCount",
    .tp_doc = "A group's issue counter shared with the functional-collective kernels (funcol_kernels.py).",
    .tp_basicsize = sizeof(SharedCount),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = sharedcount_new,
    .tp_traverse = (traverseproc)sharedcount_traverse,
    .tp_clear = (inquiry)sharedcount_clear,
    .tp_dealloc = (destructor)sharedcount_dealloc,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)sharedcount_next,
};

static PyObject *perf_counter(PyObject *module, PyObject *unused) {
    return PyFloat_FromDouble(now_s());
}

static PyObject *set_site_depth(PyObject *module, PyObject *address) {
    void *fn = PyLong_AsVoidPtr(address);
    if (!fn && PyErr_Occurred()) return NULL;
    g_site_depth = (void (*)(int))fn;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"set_site_depth", set_site_depth, METH_O,
     "set_site_depth(address): the kernels' site_depth(int) the sites call around their call (0: none)."},
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
    INTERN(s_global_rank, "global_rank"); INTERN(s_ranks, "ranks"); INTERN(s_error, "error"); INTERN(s_track_work, "track_work");
    INTERN(s_dropped_done, "dropped_done"); INTERN(s_group, "group"); INTERN(s_async_op, "async_op");
    INTERN(s_value, "value"); INTERN(s_dropped, "dropped");
    INTERN(s_all_reduce, "all_reduce"); INTERN(s_ddp_comm_hook, "ddp_comm_hook");
    INTERN(s_op, "op"); INTERN(s_group_attr, "group"); INTERN(s_tensor, "tensor");
    INTERN(s_current, "current"); INTERN(s_nested_end, "nested_end"); INTERN(s_nested_wait, "nested_wait");
    INTERN(s_elem, "elem"); INTERN(s_data_ptr, "data_ptr"); INTERN(s_size, "size"); INTERN(s_self, "self");
    INTERN(s_track_tensor, "track_tensor"); INTERN(s_is_compiling_flag, "_is_compiling_flag");
    INTERN(s_funcol, "funcol");
#undef INTERN
    if (!(k_minus_one = PyLong_FromLong(-1)) || !(k_one = PyLong_FromLong(1)) || !(k_zero_f = PyFloat_FromDouble(0.0)))
        return NULL;
    if (PyType_Ready(&SiteType) < 0 || PyType_Ready(&WaitType) < 0 || PyType_Ready(&DdpOpType) < 0
        || PyType_Ready(&BatchType) < 0 || PyType_Ready(&SpanType) < 0 || PyType_Ready(&DdpOpsType) < 0
        || PyType_Ready(&FuncolType) < 0 || PyType_Ready(&FuncolSlotType) < 0
        || PyType_Ready(&SharedCountType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Site", (PyObject *)&SiteType) < 0
        || PyModule_AddObjectRef(m, "Wait", (PyObject *)&WaitType) < 0
        || PyModule_AddObjectRef(m, "DdpOp", (PyObject *)&DdpOpType) < 0
        || PyModule_AddObjectRef(m, "DdpOps", (PyObject *)&DdpOpsType) < 0
        || PyModule_AddObjectRef(m, "Batch", (PyObject *)&BatchType) < 0
        || PyModule_AddObjectRef(m, "Span", (PyObject *)&SpanType) < 0
        || PyModule_AddObjectRef(m, "FuncolSlot", (PyObject *)&FuncolSlotType) < 0
        || PyModule_AddObjectRef(m, "SharedCount", (PyObject *)&SharedCountType) < 0
        || PyModule_AddIntConstant(m, "KIND_C10D", KIND_C10D) < 0
        || PyModule_AddIntConstant(m, "KIND_FSDP", KIND_FSDP) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
