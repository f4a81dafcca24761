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
- a blocking call issued async on the caller's behalf (``Issue``'s ``blocking``), which is what c10d's own
  blocking path does (issue, then ``work.wait()``): the wrapper makes that wait itself, so that the
  blocked time is timed where it happens, and returns ``None`` as the blocking API does. The wait is part
  of the user's call, so its errors propagate as well.

The tracer (``CollectiveTracer``: its ``enabled`` flag and ``busy``, ``enter``, ``leave``, ``finish_sync``,
``error``) is passed in: this module imports neither the hub nor its plug-ins, so both can import it.
"""

from __future__ import annotations

from typing import Any, Callable

# What ``describe`` returns for a call it traces: ``(op, args, kwargs, blocking, state)``.
#   op: the op record the call issues; while it runs, a wait or a ProcessGroup call nested in it belongs
#       to this op (``tracer.current()``). ``None`` when the call issues several (they go in ``state``).
#   args, kwargs: what to call the original with.
#   blocking: a blocking call issued async on the caller's behalf (see the module docstring).
#   state: handed to ``finish`` as is (the caller's ``async_op``; the records of a multi-op call).
# A plain tuple, not a class: one is built per traced call, and a slotted class's constructor measured
# +0.3-0.4 µs per call in-process against this tuple and the inline wrappers it replaced.
Issue = tuple[Any, tuple, dict, bool, Any]


def traced_call(original: Callable, *, tracer: Any, where: str, describe: Callable[[tuple, dict], Issue | None],
                finish: Callable[[Any, Any, Any], None], skip: Callable[[], Any] | None = None) -> Callable:
    """``original`` wrapped as the module docstring says; ``where`` names the site in error reports
    (``record_error("collectives.<where>", ...)``)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not tracer.enabled or tracer.busy() or (skip is not None and skip()):
            return original(*args, **kwargs)
        try:
            issue = describe(args, kwargs)
        except Exception as exc:
            tracer.error(where, exc)
            return original(*args, **kwargs)
        if issue is None:
            return original(*args, **kwargs)
        op, call_args, call_kwargs, blocking, state = issue
        prev = tracer.enter(op)
        try:
            result = original(*call_args, **call_kwargs)
        finally:
            tracer.leave(prev)
        if blocking:
            # No future callback for the completion: it would run on the gloo worker thread and take the
            # GIL, which the caller, woken by the same completion, usually holds by then; the worker (and
            # the next op in its queue) then waits up to the interpreter's switch interval (5 ms). That
            # stretched the profiler's own ``gloo:*`` ranges (traced/profiler 0.67-0.76 for small blocking
            # all-reduces), while the caller's wake-up it would have saved is microseconds. Completion is
            # therefore the return of this wait, and the whole call is blocked time (``finish_sync``).
            # ``None``: c10d returns no work on a rank outside the group; nothing to wait for.
            if result is not None:
                tracer.raw_wait(result)
            try:
                tracer.finish_sync(op)
            except Exception as exc:
                tracer.error(where, exc)
            return None
        try:
            finish(op, state, result)
        except Exception as exc:
            tracer.error(where, exc)
        return result

    return wrapper
