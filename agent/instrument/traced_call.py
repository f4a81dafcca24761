"""The one wrapper around every traced issue call: c10d collectives, P2P and ``batch_isend_irecv``
(``comm_c10d``), functional collectives (``comm_funcol``), FSDP2's custom comms (``comm_fsdp``).

    wrapper = traced_call(original, tracer=tracer, where="all_reduce", describe=describe, finish=finish)

A site says only what a call issues and what becomes of its result:

- ``describe(args, kwargs) -> Issue | None``: the op record(s) of the call (``tracer.begin``) and the
  arguments to make it with (see ``Issue``); ``None``: nothing to trace in this call, it goes through
  untouched.
- ``finish(op, state, result)``: hand the result to the tracer (record it now, or track the work /
  tensor until its wait).

Everything else is the same at every site, so it is written once, here:

- the wrapper steps aside (calls ``original`` as it was called) while the tracer is detached, inside
  another traced call (re-entrancy: the ``dist.*`` call a DDP hook, an FSDP comm or a funcol op makes is
  that op, recorded once under the outer source), or while ``skip()`` is true;
- a failure in ``describe`` or ``finish`` is telemetry's own: counted through ``tracer.error`` (→
  ``recorder.record_error``), never raised; the real call is still made, exactly once;
- the real call's own exception propagates unchanged, after the tracer's nesting state is restored;
- a blocking call (``Issue``'s ``blocking``: it returns once its op completed, as c10d's blocking calls do
  on CPU) is recorded right there: completion is the return, the whole call is blocked time.

The tracer (``CollectiveTracer``: its ``enabled`` flag, per-thread nesting state ``_main`` / ``_tls``, ``now``,
``emit`` and ``error``) is passed in: this module imports neither the hub nor its plug-ins, so both can import it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

# What ``describe`` returns for a call it traces: ``(op, args, kwargs, blocking, state)``.
#   op: the op record the call issues; while it runs, a wait or a ProcessGroup call nested in it belongs
#       to this op (``tracer.current()``). ``None`` when the call issues several (they go in ``state``).
#   args, kwargs: what to call the original with.
#   blocking: the call returns once its op completed (see the module docstring).
#   state: handed to ``finish`` as is (the caller's ``async_op``; the records of a multi-op call).
# A plain tuple, not a class: one is built per traced call, and a slotted class's constructor measured
# +0.3-0.4 µs per call in-process against this tuple and the inline wrappers it replaced.
Issue = tuple[Any, tuple, dict, bool, Any]


def traced_call(original: Callable, *, tracer: Any, where: str, describe: Callable[[tuple, dict], Issue | None],
                finish: Callable[[Any, Any, Any], None], skip: Callable[[], Any] | None = None) -> Callable:
    """``original`` wrapped as the module docstring says; ``where`` names the site in error reports
    (``record_error("collectives.<where>", ...)``)."""

    # The tracer's enter / leave, inline (this runs on every traced call): the attaching thread's nesting
    # state is a plain object, other threads' a threading.local (see CollectiveTracer.nesting).
    main, main_tid, local, get_ident = tracer._main, tracer._main_tid, tracer._tls, threading.get_ident

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # ``skip`` first: for funcol it is torch.compile's check, which Dynamo folds (nothing else of ours
        # is traced then: no graph break on the thread id).
        if skip is not None and skip():
            return original(*args, **kwargs)
        tls = main if get_ident() == main_tid else local.nesting
        if not tracer.enabled or tls.depth:
            return original(*args, **kwargs)
        try:
            issue = describe(args, kwargs)
        except Exception as exc:
            tracer.error(where, exc)
            return original(*args, **kwargs)
        if issue is None:
            return original(*args, **kwargs)
        op, call_args, call_kwargs, blocking, state = issue
        prev = tls.current
        tls.depth += 1
        tls.current = op
        try:
            result = original(*call_args, **call_kwargs)
        finally:
            tls.depth -= 1
            tls.current = prev
        if blocking:
            # No future callback for the completion: it would run on the gloo worker thread and take the
            # GIL, which the caller, woken by the same completion, usually holds by then; the worker (and
            # the next op in its queue) then waits up to the interpreter's switch interval (5 ms). That
            # stretched the profiler's own ``gloo:*`` ranges (traced/profiler 0.67-0.76 for small blocking
            # all-reduces), while the caller's wake-up it would have saved is microseconds.
            t_end = tracer.now()
            try:
                tracer.emit(op, t_end, t_end - op.t_start)
            except Exception as exc:
                tracer.error(where, exc)
            return result
        try:
            finish(op, state, result)
        except Exception as exc:
            tracer.error(where, exc)
        return result

    return wrapper
