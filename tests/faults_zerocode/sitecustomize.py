"""Fault injection for tests/test_zerocode_faults.py: a job's own ``sitecustomize`` (``meshscope run``'s
bootstrap chains it, before meshscope activates) that makes one of meshscope's zero-code hooks raise on
every call, chosen by MESHSCOPE_TEST_FAULT. It patches meshscope only, never torch or the job."""

import os

FAULT = os.environ.get("MESHSCOPE_TEST_FAULT", "")


class InjectedFault(RuntimeError):
    pass


def _raise(*args, **kwargs):
    raise InjectedFault(f"injected {FAULT}")


def _patch_telemetry(module):
    if FAULT == "step_boundary":
        module.Telemetry.end_step = _raise
    elif FAULT == "memory_census":
        from meshscope.agent.instrument import memory

        memory.TensorCensus.take = _raise
        memory.TensorCensus.add_modules = _raise


def _install():
    if not FAULT:
        return
    from meshscope.agent.zerocode.imports import when_imported

    if FAULT == "loss_capture":
        from meshscope.agent.zerocode.driver import Driver

        Driver._take_loss = _raise
    elif FAULT == "flop_count":
        from meshscope.agent.zerocode import census

        census.flops = _raise
    elif FAULT == "collective_site":
        def patch(module):
            # ``begin`` is an instance attribute, a closure the tracer sets up (CollectiveTracer._hot_paths)
            hot_paths = module.CollectiveTracer._hot_paths

            def failing_hot_paths(self):
                hot_paths(self)
                self.begin = self._begin = _raise
            module.CollectiveTracer._hot_paths = failing_hot_paths
        when_imported("meshscope.agent.instrument.collectives", patch)
    else:
        when_imported("meshscope.agent.instrument.telemetry", _patch_telemetry)


_install()
