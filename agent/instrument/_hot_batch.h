/* gloo's batch_isend_irecv (Batch) of agent/instrument/_hot.c, which includes this once, after
 * _hot_sites.h (its sites are the isend / irecv Sites there). */
#ifndef MESHSCOPE_HOT_BATCH_H
#define MESHSCOPE_HOT_BATCH_H

/* ------------------------------------------------------------------------------------------ Batch */
/* comm_c10d.batch's ``wrapper``: batch_isend_irecv on a backend that does not coalesce (gloo) is one call
 * per op, each seen by the isend / irecv sites; this swaps the P2P wrappers into ops built before attach
 * and asks once per group and device kind whether the group coalesces (``coalesced(list)``, cached in
 * ``coalesces``: (id(group), cuda) -> (group, answer)). A coalescing batch goes to ``slow``. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    PyObject *original, *slow, *tracer, *swap, *isend, *irecv, *coalesces, *coalesced, *where;
    /* the last answer that did not coalesce, for its group and device kind: a pipeline stage sends on one
     * group, so this is the common case, without the key tuple and the dict look-up */
    PyObject *last_group;
    int last_cuda;
} Batch;

static PyObject *s_op, *s_group_attr, *s_tensor;

static PyObject *batch_call(Batch *b, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 1 || kwnames) return PyObject_Vectorcall(b->slow, args, nargsf, kwnames);
    PyObject *ops = args[0];
    PyObject *en = PyObject_GetAttr(b->tracer, s_enabled);
    int on = en ? PyObject_IsTrue(en) : -1;
    Py_XDECREF(en);
    if (on < 0) PyErr_Clear();
    if (on > 0 && !PyList_Check(ops)) return PyObject_Vectorcall(b->slow, args, nargsf, NULL);
    if (on <= 0 || PyList_GET_SIZE(ops) == 0) return PyObject_Vectorcall(b->original, args, nargsf, NULL);
    int coalesce = -1;
    Py_ssize_t n = PyList_GET_SIZE(ops);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p2p_op = PyList_GET_ITEM(ops, i);
        PyObject *fn = PyObject_GetAttr(p2p_op, s_op);
        if (!fn) goto failed;
        if (fn != b->isend && fn != b->irecv) {
            PyObject *to = PyDict_GetItemWithError(b->swap, fn);
            if (to && PyObject_SetAttr(p2p_op, s_op, to) < 0) {
                Py_DECREF(fn);
                goto failed;
            }
        }
        Py_DECREF(fn);
        if (PyErr_Occurred()) goto failed;
    }
    PyObject *first = PyList_GET_ITEM(ops, 0);
    PyObject *group = PyObject_GetAttr(first, s_group_attr);
    PyObject *tensor = group ? PyObject_GetAttr(first, s_tensor) : NULL;
    PyObject *cuda = tensor ? PyObject_GetAttr(tensor, s_is_cuda) : NULL;
    Py_XDECREF(tensor);
    if (cuda && group == b->last_group && (cuda == Py_True) == b->last_cuda) {
        Py_DECREF(cuda); Py_DECREF(group);
        return PyObject_Vectorcall(b->original, args, nargsf, NULL);
    }
    PyObject *gid = cuda ? PyLong_FromVoidPtr(group) : NULL;
    PyObject *key = gid ? PyTuple_Pack(2, gid, cuda) : NULL;
    int is_cuda = cuda == Py_True;
    Py_XDECREF(gid); Py_XDECREF(cuda);
    if (!key) {
        Py_XDECREF(group);
        goto failed;
    }
    PyObject *hit = PyDict_GetItemWithError(b->coalesces, key);
    if (hit && PyTuple_Check(hit) && PyTuple_GET_SIZE(hit) == 2 && PyTuple_GET_ITEM(hit, 0) == group) {
        coalesce = PyObject_IsTrue(PyTuple_GET_ITEM(hit, 1));
    } else if (!PyErr_Occurred()) {
        PyObject *answer = PyObject_CallOneArg(b->coalesced, ops);
        PyObject *entry = answer ? PyTuple_Pack(2, group, answer) : NULL;
        if (entry && PyDict_SetItem(b->coalesces, key, entry) == 0) coalesce = PyObject_IsTrue(answer);
        Py_XDECREF(answer); Py_XDECREF(entry);
    }
    Py_DECREF(key);
    if (coalesce == 0) {  /* remembered (a strong reference, so that its address is never another group's) */
        Py_XSETREF(b->last_group, group);
        b->last_cuda = is_cuda;
    } else {
        Py_DECREF(group);
    }
    if (coalesce < 0) goto failed;
    if (coalesce) return PyObject_Vectorcall(b->slow, args, nargsf, NULL);
    return PyObject_Vectorcall(b->original, args, nargsf, NULL);

failed:
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
    {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        PyObject *r = PyObject_CallMethodObjArgs(b->tracer, s_error, b->where, value ? value : Py_None, NULL);
        Py_XDECREF(r);
        PyErr_Clear();
        Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
    }
    return PyObject_Vectorcall(b->original, args, nargsf, NULL);
}

static PyObject *batch_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"original", "slow", "tracer", "swap", "isend", "irecv", "coalesced", NULL};
    PyObject *original, *slow, *tracer, *swap, *isend, *irecv, *coalesced;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO!OOO:Batch", kwlist, &original, &slow, &tracer, &PyDict_Type,
                                     &swap, &isend, &irecv, &coalesced))
        return NULL;
    Batch *b = (Batch *)type->tp_alloc(type, 0);
    if (!b) return NULL;
    b->vectorcall = (vectorcallfunc)batch_call;
    b->coalesces = PyDict_New();
    b->where = PyUnicode_FromString("batch_isend_irecv");
    if (!b->coalesces || !b->where) {
        Py_DECREF(b);
        return NULL;
    }
    b->original = Py_NewRef(original); b->slow = Py_NewRef(slow); b->tracer = Py_NewRef(tracer);
    b->swap = Py_NewRef(swap); b->isend = Py_NewRef(isend); b->irecv = Py_NewRef(irecv);
    b->coalesced = Py_NewRef(coalesced);
    return (PyObject *)b;
}

static int batch_traverse(Batch *b, visitproc visit, void *arg) {
    Py_VISIT(b->dict); Py_VISIT(b->original); Py_VISIT(b->slow); Py_VISIT(b->tracer); Py_VISIT(b->swap);
    Py_VISIT(b->isend); Py_VISIT(b->irecv); Py_VISIT(b->coalesces); Py_VISIT(b->coalesced); Py_VISIT(b->where);
    Py_VISIT(b->last_group);
    return 0;
}

static int batch_clear(Batch *b) {
    Py_CLEAR(b->dict); Py_CLEAR(b->original); Py_CLEAR(b->slow); Py_CLEAR(b->tracer); Py_CLEAR(b->swap);
    Py_CLEAR(b->isend); Py_CLEAR(b->irecv); Py_CLEAR(b->coalesces); Py_CLEAR(b->coalesced); Py_CLEAR(b->where);
    Py_CLEAR(b->last_group);
    return 0;
}

static void batch_dealloc(Batch *b) {
    PyObject_GC_UnTrack(b);
    batch_clear(b);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

static PyTypeObject BatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "meshscope.agent.instrument._hot.Batch",
    .tp_doc = "batch_isend_irecv on a backend that does not coalesce (see agent/instrument/_hot_sites.h).",
    .tp_basicsize = sizeof(Batch),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = batch_new,
    .tp_traverse = (traverseproc)batch_traverse,
    .tp_clear = (inquiry)batch_clear,
    .tp_dealloc = (destructor)batch_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Batch, vectorcall),
    .tp_dictoffset = offsetof(Batch, dict),
    .tp_getset = dict_getset,
};

#endif
