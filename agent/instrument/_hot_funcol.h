/* The functional collectives' sites (comm_funcol's ``single`` wrapper and its ``wait_tensor``) in C, for
 * agent/instrument/_hot.c, which includes this once, after _hot_common.h.
 *
 * A FuncolSlot is one site; its ``fn`` is the builtin function put on the funcol module (a builtin, not
 * this object: torch.compile can only be told how to trace builtins, and native.funcol_site tells it to
 * trace the original torch function instead, so compiled TP code has no graph break). torch.compile's
 * registration is for the life of the process, so there is one slot per site name per process (native.py),
 * bound to a tracer while it is attached (``bind`` makes the binding, a Funcol; ``unbind`` drops it); not
 * bound, it is the original call.
 *
 * Issue (as comm_funcol.single's CPU path): the Issued tuple, the call inside the tracer's nesting state,
 * then the op pending by its output's data pointer until its wait_tensor, or done when the call waited
 * inside (the wait's end and blocked time) or returned a plain tensor. Wait: the pending Issued of the
 * tensor waited on, timed around the real wait. Anything else (a CUDA tensor, an argument it cannot find,
 * an entry of the general path, a wait with nothing pending) goes to the Python site, ``slow``. */
#ifndef MESHSCOPE_HOT_FUNCOL_H
#define MESHSCOPE_HOT_FUNCOL_H

static PyObject *s_current, *s_nested_end, *s_nested_wait, *s_elem, *s_data_ptr, *s_size, *s_self, *s_track_tensor,
    *s_is_compiling_flag, *s_funcol, *k_zero_f;

/* One binding of a site to a tracer (immutable once made): a call holds it for its whole length, so that a
 * detach on another thread meanwhile (``unbind``) cannot take the tracer's state from under it. */
typedef struct {
    PyObject_HEAD
    Hot h;
    PyObject *slow, *op, *where;
    Py_ssize_t gi;
    int output_bytes;
    /* the last group designator's entry; a (mesh, dim) pair by its mesh and dim (DTensor makes a new tuple
     * per call); held, so that their identities cannot be reused */
    PyObject *last_group, *last_mesh, *last_dim, *last_hit;
} Funcol;

/* The site of one name in the process: the builtin ``fn`` (holding this as its self) and the binding, if any. */
typedef struct {
    PyObject_HEAD
    PyObject *fn;
    int wait;
    PyObject *original, *act, *compiler;  /* compiler: torch.compiler's __dict__ */
    Funcol *binding;
} FuncolSlot;

/* torch.compiler.is_compiling() outside Dynamo (which never calls this: it traces the original): the flag
 * that torch.export and AOT tracing set. */
static inline int compiling(FuncolSlot *slot) {
    PyObject *flag = PyDict_GetItemWithError(slot->compiler, s_is_compiling_flag);
    if (!flag && PyErr_Occurred()) PyErr_Clear();  /* (a str key in a module's dict: not expected) */
    return flag == Py_True;
}

/* Keep (group, mesh, dim, hit) as the last designator's: the new ones in place before the old ones are
 * released (a release may run Python code, and another thread this site then). */
static void remember(Funcol *f, PyObject *group, PyObject *mesh, PyObject *dim, PyObject *hit) {
    PyObject *og = f->last_group, *om = f->last_mesh, *od = f->last_dim, *oh = f->last_hit;
    f->last_group = Py_XNewRef(group); f->last_mesh = Py_XNewRef(mesh); f->last_dim = Py_XNewRef(dim);
    f->last_hit = Py_NewRef(hit);
    Py_XDECREF(og); Py_XDECREF(om); Py_XDECREF(od); Py_XDECREF(oh);
}

/* The group's entry (new reference), through the last one when the same designator comes again. */
static PyObject *funcol_hit(Funcol *f, PyObject *group) {
    if (PyTuple_CheckExact(group) && PyTuple_GET_SIZE(group) == 2) {
        PyObject *mesh = PyTuple_GET_ITEM(group, 0), *dim = PyTuple_GET_ITEM(group, 1);
        if (f->last_hit && mesh == f->last_mesh && f->last_dim
            && (dim == f->last_dim || (PyLong_CheckExact(dim) && PyLong_CheckExact(f->last_dim)
                                       && PyObject_RichCompareBool(dim, f->last_dim, Py_EQ) == 1)))
            return Py_NewRef(f->last_hit);
        PyObject *hit = PyObject_CallOneArg(f->h.resolve, group);  /* GroupTable.resolve: by mesh and dim */
        if (!hit) return NULL;
        if (!(PyTuple_Check(hit) && PyTuple_GET_SIZE(hit) == 4)) {
            Py_DECREF(hit);
            PyErr_SetString(PyExc_TypeError, "the tracer's group entry is not a 4-tuple");
            return NULL;
        }
        remember(f, NULL, mesh, dim, hit);
        return hit;
    }
    if (f->last_hit && group == f->last_group) return Py_NewRef(f->last_hit);
    PyObject *hit = group_entry(&f->h, group);
    if (!hit) return NULL;
    remember(f, group, NULL, NULL, hit);
    return hit;
}

static PyObject *funcol_issue(FuncolSlot *slot, Funcol *f, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames) {
    Hot *h = &f->h;
    PyObject *tls = nesting(h);
    long depth = 0;
    int on = tls ? tracing(h, tls, &depth) : -1;
    if (on <= 0) {
        Py_XDECREF(tls);
        if (on < 0 && report(h, f->where) < 0) return NULL;
        return PyObject_Vectorcall(slot->original, args, nargs, kwnames);
    }
    PyObject *t = arg(args, nargs, kwnames, 0, s_self), *group = arg(args, nargs, kwnames, f->gi, s_group);
    if (!t || !group) {
        Py_DECREF(tls);
        return PyObject_Vectorcall(f->slow, args, nargs, kwnames);
    }
    PyObject *hit = NULL, *nbytes = NULL, *seq = NULL, *t0 = NULL, *issued = NULL, *prev = NULL;
    PyObject *cuda = PyObject_GetAttr(t, s_is_cuda);
    if (!cuda) goto describe_failed;
    int is_cuda = PyObject_IsTrue(cuda);
    Py_DECREF(cuda);
    if (is_cuda < 0) goto describe_failed;
    if (is_cuda) {  /* CUDA events: the Python site */
        Py_DECREF(tls);
        return PyObject_Vectorcall(f->slow, args, nargs, kwnames);
    }
    if (!(hit = funcol_hit(f, group))) goto describe_failed;
    if (!(nbytes = PyObject_GetAttr(t, s_nbytes))) goto describe_failed;
    if (f->output_bytes) {  /* all-gather: the output's bytes, input × group size */
        PyObject *size = PyObject_GetAttr(PyTuple_GET_ITEM(hit, 1), s_size);
        if (!size) goto describe_failed;
        Py_SETREF(nbytes, PyNumber_Multiply(nbytes, size));
        Py_DECREF(size);
        if (!nbytes) goto describe_failed;
    }
    if (!(seq = PyIter_Next(PyTuple_GET_ITEM(hit, 2)))) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_StopIteration, "group counter exhausted");
        goto describe_failed;
    }
    if (!(t0 = PyFloat_FromDouble(now_s()))) goto describe_failed;
    issued = PyTuple_Pack(7, f->op, PyTuple_GET_ITEM(hit, 3), nbytes, k_minus_one, s_funcol, seq, t0);
    if (!issued) goto describe_failed;
    Py_CLEAR(hit); Py_CLEAR(nbytes); Py_CLEAR(seq); Py_CLEAR(t0);
    /* inside the op: a traced call it makes is this op, a wait it makes is this op's (nested_*) */
    if (!(prev = PyObject_GetAttr(tls, s_current)) || set_long_attr(tls, s_depth, depth + 1) < 0) goto describe_failed;
    if (PyObject_SetAttr(tls, s_current, issued) < 0) {
        leave(tls, depth);
        goto describe_failed;
    }
    PyObject *out = PyObject_Vectorcall(slot->original, args, nargs, kwnames);

    /* after it, also when it raised after its inner wait: the next op must not inherit that wait */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    /* each restored whatever else fails (attributes of the tracer's own slotted object: not expected to) */
    int restored = 1;
#define KEEP_GOING(ok) do { if (!(ok)) { PyErr_Clear(); restored = 0; } } while (0)
    KEEP_GOING(set_long_attr(tls, s_depth, depth) == 0);
    KEEP_GOING(PyObject_SetAttr(tls, s_current, prev) == 0);
    PyObject *end = PyObject_GetAttr(tls, s_nested_end);
    KEEP_GOING(end);
    PyObject *blocked = PyObject_GetAttr(tls, s_nested_wait);
    KEEP_GOING(blocked);
    KEEP_GOING(PyObject_SetAttr(tls, s_nested_end, Py_None) == 0);
    KEEP_GOING(PyObject_SetAttr(tls, s_nested_wait, k_zero_f) == 0);
#undef KEEP_GOING
    PyErr_Restore(type, value, tb);
    Py_DECREF(prev); Py_DECREF(tls);
    if (!out || !restored) {
        Py_XDECREF(end); Py_XDECREF(blocked); Py_DECREF(issued);
        if (out && !restored) {  /* counted, as every failure of ours; the op goes unrecorded */
            PyErr_SetString(PyExc_RuntimeError, "the tracer's nesting state could not be read or restored");
            if (report(h, f->where) < 0) {
                Py_DECREF(out);
                return NULL;
            }
        }
        return out;
    }
    int r;
    if (end == Py_None && Py_TYPE(out) == (PyTypeObject *)slot->act) {  /* in flight: its wait_tensor completes it */
        PyObject *elem = PyObject_GetAttr(out, s_elem);
        PyObject *key = elem ? PyObject_CallMethodNoArgs(elem, s_data_ptr) : NULL;
        r = key ? track(h, key, issued, s_track_tensor, key, issued) : -1;
        Py_XDECREF(elem); Py_XDECREF(key);
    } else if (end == Py_None) {  /* complete at its return */
        double t_end = now_s();
        r = put_timed(h, issued, t_end, 0.0);
    } else {  /* complete at the wait inside the call, not at the call's return (see comm_funcol.register) */
        PyObject *e = entry_of(h, issued, end, blocked);
        r = e ? put(h, e) : -1;
        Py_XDECREF(e);
    }
    Py_DECREF(end); Py_DECREF(blocked); Py_DECREF(issued);
    if (r < 0 && report(h, f->where) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;

describe_failed:
    Py_XDECREF(hit); Py_XDECREF(nbytes); Py_XDECREF(seq); Py_XDECREF(t0); Py_XDECREF(issued); Py_XDECREF(prev);
    Py_DECREF(tls);
    if (report(h, f->where) < 0) return NULL;
    return PyObject_Vectorcall(slot->original, args, nargs, kwnames);
}

static PyObject *funcol_wait(FuncolSlot *slot, Funcol *f, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames) {
    Hot *h = &f->h;
    if (nargs != 1 || kwnames) return PyObject_Vectorcall(f->slow, args, nargs, kwnames);
    PyObject *tensor = args[0];
    /* an AsyncCollectiveTensor passed in directly: its dispatch calls this again with the tensor inside */
    if (Py_TYPE(tensor) == (PyTypeObject *)slot->act || PyDict_GET_SIZE(h->pending) == 0)
        return PyObject_Vectorcall(f->slow, args, nargs, NULL);
    PyObject *key = PyObject_CallMethodNoArgs(tensor, s_data_ptr);
    PyObject *entry = key ? pop_pending(h, key) : NULL;
    if (!entry || !PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 7) {
        /* nothing of a fast site's pending for it (or an error): the Python site, which finds the rest */
        int r = entry ? PyObject_SetItem(h->pending, key, entry) : 0;
        Py_XDECREF(key); Py_XDECREF(entry);
        if ((r < 0 || PyErr_Occurred()) && report(h, f->where) < 0) return NULL;
        return PyObject_Vectorcall(f->slow, args, nargs, NULL);
    }
    Py_DECREF(key);
    PyObject *out = timed_wait(h, slot->original, args, nargs, entry, f->where);
    Py_DECREF(entry);
    return out;
}

static PyObject *funcol_fn(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    FuncolSlot *slot = (FuncolSlot *)self;
    Funcol *f = slot->binding;
    if (!f || compiling(slot)) return PyObject_Vectorcall(slot->original, args, nargs, kwnames);
    Py_INCREF(f);
    PyObject *out = slot->wait ? funcol_wait(slot, f, args, nargs, kwnames) : funcol_issue(slot, f, args, nargs, kwnames);
    Py_DECREF(f);
    return out;
}

static PyMethodDef funcol_def = {"funcol_site", (PyCFunction)(void (*)(void))funcol_fn, METH_FASTCALL | METH_KEYWORDS,
                                 "A traced functional collective (see agent/instrument/_hot_funcol.h)."};

static int funcol_traverse(Funcol *f, visitproc visit, void *arg) {
    Py_VISIT(f->slow); Py_VISIT(f->op); Py_VISIT(f->where); Py_VISIT(f->last_group); Py_VISIT(f->last_mesh);
    Py_VISIT(f->last_dim); Py_VISIT(f->last_hit);
    return hot_traverse(&f->h, visit, arg);
}

static int funcol_clear(Funcol *f) {
    hot_clear(&f->h);
    Py_CLEAR(f->slow); Py_CLEAR(f->op); Py_CLEAR(f->where); Py_CLEAR(f->last_group); Py_CLEAR(f->last_mesh);
    Py_CLEAR(f->last_dim); Py_CLEAR(f->last_hit);
    return 0;
}

static void funcol_dealloc(Funcol *f) {
    PyObject_GC_UnTrack(f);
    funcol_clear(f);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

static PyTypeObject FuncolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "meshscope.agent.instrument._hot.Funcol",
    .tp_doc = "A functional collective site's binding to a tracer (see agent/instrument/_hot_funcol.h).",
    .tp_basicsize = sizeof(Funcol),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)funcol_traverse,
    .tp_clear = (inquiry)funcol_clear,
    .tp_dealloc = (destructor)funcol_dealloc,
};

static PyObject *slot_bind(FuncolSlot *slot, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"slow", "hot", "op", "where", "group", "output_bytes", NULL};
    PyObject *slow, *hot, *op, *where;
    Py_ssize_t gi = 0;
    int output_bytes = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOU|np:bind", kwlist, &slow, &hot, &op, &where, &gi, &output_bytes))
        return NULL;
    if (!PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "FuncolSlot.bind: slow must be callable");
        return NULL;
    }
    if (slot->binding) {
        PyErr_SetString(PyExc_RuntimeError, "FuncolSlot.bind: bound to another tracer");
        return NULL;
    }
    Funcol *f = PyObject_GC_New(Funcol, &FuncolType);
    if (!f) return NULL;
    memset(&f->h, 0, sizeof(Funcol) - offsetof(Funcol, h));
    if (hot_from(&f->h, hot) < 0) {
        memset(&f->h, 0, sizeof(Hot));  /* hot_from took no references on failure */
        Py_DECREF(f);
        return NULL;
    }
    f->slow = Py_NewRef(slow); f->op = Py_NewRef(op); f->where = Py_NewRef(where);
    f->gi = gi; f->output_bytes = output_bytes;
    PyObject_GC_Track(f);
    slot->binding = f;
    Py_RETURN_NONE;
}

static PyObject *slot_unbind(FuncolSlot *slot, PyObject *unused) {
    Py_CLEAR(slot->binding);  /* a call in flight holds its own reference */
    Py_RETURN_NONE;
}

static PyObject *slot_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"original", "act", "compiler", "wait", NULL};
    PyObject *original, *act, *compiler;
    int wait = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!O!|p:FuncolSlot", kwlist, &original, &PyType_Type, &act,
                                     &PyDict_Type, &compiler, &wait))
        return NULL;
    if (!PyCallable_Check(original)) {
        PyErr_SetString(PyExc_TypeError, "FuncolSlot: original must be callable");
        return NULL;
    }
    FuncolSlot *slot = (FuncolSlot *)type->tp_alloc(type, 0);
    if (!slot) return NULL;
    slot->wait = wait;
    slot->original = Py_NewRef(original); slot->act = Py_NewRef(act); slot->compiler = Py_NewRef(compiler);
    slot->fn = PyCFunction_New(&funcol_def, (PyObject *)slot);
    if (!slot->fn) {
        Py_DECREF(slot);
        return NULL;
    }
    return (PyObject *)slot;
}

static int slot_traverse(FuncolSlot *slot, visitproc visit, void *arg) {
    Py_VISIT(slot->fn); Py_VISIT(slot->original); Py_VISIT(slot->act); Py_VISIT(slot->compiler);
    Py_VISIT(slot->binding);
    return 0;
}

static int slot_clear(FuncolSlot *slot) {
    Py_CLEAR(slot->fn); Py_CLEAR(slot->original); Py_CLEAR(slot->act); Py_CLEAR(slot->compiler);
    Py_CLEAR(slot->binding);
    return 0;
}

static void slot_dealloc(FuncolSlot *slot) {
    PyObject_GC_UnTrack(slot);
    slot_clear(slot);
    Py_TYPE(slot)->tp_free((PyObject *)slot);
}

static PyObject *slot_get_fn(FuncolSlot *slot, void *unused) { return Py_NewRef(slot->fn); }
static PyObject *slot_get_bound(FuncolSlot *slot, void *unused) { return PyBool_FromLong(slot->binding != NULL); }
static PyObject *slot_get_original(FuncolSlot *slot, void *unused) { return Py_NewRef(slot->original); }

static PyGetSetDef slot_getset[] = {
    {"fn", (getter)slot_get_fn, NULL, "the builtin put on the funcol module", NULL},
    {"bound", (getter)slot_get_bound, NULL, "whether a tracer is bound", NULL},
    {"original", (getter)slot_get_original, NULL, "the torch function it calls", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef slot_methods[] = {
    {"bind", (PyCFunction)(void (*)(void))slot_bind, METH_VARARGS | METH_KEYWORDS,
     "bind(slow, hot, op, where, group=0, output_bytes=False): trace through the tracer of ``hot``."},
    {"unbind", (PyCFunction)slot_unbind, METH_NOARGS, "Release the tracer: the original call from now on."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FuncolSlotType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "meshscope.agent.instrument._hot.FuncolSlot",
    .tp_doc = "A functional collective's traced site (see agent/instrument/_hot_funcol.h).",
    .tp_basicsize = sizeof(FuncolSlot),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = slot_new,
    .tp_traverse = (traverseproc)slot_traverse,
    .tp_clear = (inquiry)slot_clear,
    .tp_dealloc = (destructor)slot_dealloc,
    .tp_methods = slot_methods,
    .tp_getset = slot_getset,
};

#endif
