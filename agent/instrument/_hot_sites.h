/* The issue sites (Site: c10d collectives and P2P, FSDP2's comms) and Work.wait (Wait) of
 * agent/instrument/_hot.c, which includes this once, after _hot_common.h (gloo's batch_isend_irecv,
 * Batch, is in _hot_batch.h). */
#ifndef MESHSCOPE_HOT_SITES_H
#define MESHSCOPE_HOT_SITES_H

/* ------------------------------------------------------------------------------------------- Site */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    Hot h;
    int kind;
    PyObject *original, *slow, *op, *source, *where, *tname, *coalesce, *works, *learn;
    PyObject *peer_kw, *group_peer_kw, *known;  /* P2P called as torch's API is: its keywords */
    /* The last group's entry (a site is called with one group again and again: a stage's P2P, FSDP's, the
     * world): no key object and no dict look-up then. The group is held, so its identity cannot be reused;
     * its GroupInfo, counter and key stay the group's for the tracer's life. */
    PyObject *last_group, *last_hit;
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

static PyObject *site_call_inner(Site *s, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
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
        if (s->known && ((kwnames && !all_known(kwnames, s->known)) || nargs > PyTuple_GET_SIZE(s->known)))
            goto slow;  /* not torch's own signature (the Python site takes what else it accepts) */
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
    if (group == s->last_group && s->last_hit) {
        hit = Py_NewRef(s->last_hit);
    } else {
        hit = group_entry(h, group);
        if (!hit) goto describe_failed;
        Py_XSETREF(s->last_group, Py_NewRef(group));
        Py_XSETREF(s->last_hit, Py_NewRef(hit));
    }
    nbytes = PyObject_GetAttr(t, s_nbytes);
    if (!nbytes) goto describe_failed;
    if (s->kind == KIND_C10D && s->pi >= 0) {  /* P2P: the peer's global rank, or the group peer's */
        peer = arg(args, nargs, kwnames, s->pi, s->peer_kw);
        if (peer == NULL || peer == Py_None) {
            PyObject *group_peer = arg(args, nargs, kwnames, s->pi + 3, s->group_peer_kw);
            if (group_peer == NULL || group_peer == Py_None) {
                peer = k_minus_one;
                Py_INCREF(peer);
            } else {
                peer = global_rank(PyTuple_GET_ITEM(hit, 1), group_peer);
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

/* The site's call inside the kernels' site depth (``g_site_depth``): what the original does is this op. */
static PyObject *site_call(Site *s, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    void (*depth)(int) = g_site_depth;
    if (!depth) return site_call_inner(s, args, nargsf, kwnames);
    depth(1);
    PyObject *result = site_call_inner(s, args, nargsf, kwnames);
    depth(-1);
    return result;
}

static PyObject *site_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"kind", "original", "slow", "hot", "op", "source", "where", "tensor", "group",
                             "async_op", "tensor_kw", "fixed_async", "peer", "buffer", "coalesce", "works",
                             "learn", "peer_kw", "group_peer_kw", "known", NULL};
    int kind, fixed_async = -1;
    PyObject *original, *slow, *hot, *op, *source, *where, *tname = Py_None, *coalesce = Py_None,
        *works = Py_None, *learn = Py_None, *peer_kw = Py_None, *group_peer_kw = Py_None, *known = Py_None;
    Py_ssize_t ti = -1, gi = -1, ai = -1, pi = -1, buffer = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOOOUUU|nnnOinnOOOOOO:Site", kwlist, &kind, &original, &slow,
                                     &hot, &op, &source, &where, &ti, &gi, &ai, &tname, &fixed_async, &pi,
                                     &buffer, &coalesce, &works, &learn, &peer_kw, &group_peer_kw, &known))
        return NULL;
    int names_ok = (known == Py_None || PyTuple_Check(known)) && (peer_kw == Py_None || PyUnicode_Check(peer_kw))
        && (group_peer_kw == Py_None || PyUnicode_Check(group_peer_kw)) && (tname == Py_None || PyUnicode_Check(tname));
    for (Py_ssize_t i = 0; names_ok && known != Py_None && i < PyTuple_GET_SIZE(known); i++)
        names_ok = PyUnicode_Check(PyTuple_GET_ITEM(known, i));
    if (!names_ok) {  /* same_name reads them as str */
        PyErr_SetString(PyExc_TypeError, "Site: known must be a tuple of str, tensor_kw / peer_kw / group_peer_kw str");
        return NULL;
    }
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
    s->coalesce = coalesce == Py_None ? NULL : Py_NewRef(coalesce);
    s->works = works == Py_None ? NULL : Py_NewRef(works);
    s->learn = learn == Py_None ? NULL : Py_NewRef(learn);
    s->peer_kw = peer_kw == Py_None ? NULL : interned(peer_kw);
    s->group_peer_kw = group_peer_kw == Py_None ? NULL : interned(group_peer_kw);
    s->tname = tname == Py_None ? NULL : interned(tname);
    if (known != Py_None) {
        Py_ssize_t n = PyTuple_GET_SIZE(known);
        s->known = PyTuple_New(n);
        if (!s->known) {
            Py_DECREF(s);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(s->known, i, interned(PyTuple_GET_ITEM(known, i)));
    }
    s->ti = ti; s->gi = gi; s->ai = ai; s->pi = pi; s->buffer = buffer;
    s->fixed_async = fixed_async;
    return (PyObject *)s;
}

static int site_traverse(Site *s, visitproc visit, void *arg) {
    Py_VISIT(s->dict); Py_VISIT(s->original); Py_VISIT(s->slow); Py_VISIT(s->op); Py_VISIT(s->source);
    Py_VISIT(s->where); Py_VISIT(s->tname); Py_VISIT(s->coalesce); Py_VISIT(s->works); Py_VISIT(s->learn);
    Py_VISIT(s->peer_kw); Py_VISIT(s->group_peer_kw); Py_VISIT(s->known); Py_VISIT(s->last_group);
    Py_VISIT(s->last_hit);
    return hot_traverse(&s->h, visit, arg);
}

static int site_clear(Site *s) {
    Py_CLEAR(s->dict); Py_CLEAR(s->original); Py_CLEAR(s->slow); Py_CLEAR(s->op); Py_CLEAR(s->source);
    Py_CLEAR(s->where); Py_CLEAR(s->tname); Py_CLEAR(s->coalesce); Py_CLEAR(s->works); Py_CLEAR(s->learn);
    Py_CLEAR(s->peer_kw); Py_CLEAR(s->group_peer_kw); Py_CLEAR(s->known); Py_CLEAR(s->last_group);
    Py_CLEAR(s->last_hit);
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
    PyObject *result = timed_wait(h, w->original, args, nargsf, issued, w->where);
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

#endif
