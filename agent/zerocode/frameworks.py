"""Hugging Face ``Trainer``, Lightning ``Trainer`` and torchtitan integrations: what zero-code cannot see
by itself.

Each is a callback a user adds in one line (``callbacks=[meshscope.TransformersCallback()]`` /
``[meshscope.LightningCallback()]``), and that ``meshscope run`` adds by itself to every trainer built in
the job. It starts the zero-code driver (``observe``) if nothing has, and tells it:
- the framework's global step when training starts (a resumed run keeps its numbering);
- that the losses handed to backward are divided by the gradient accumulation (both frameworks do: their
  sum is the step's loss), so a step of several micro-batches still has its loss.
Steps, phases, collectives, tokens and FLOPs come from the driver, the same as for a plain loop.

torchtitan has no callbacks: its ``MetricsProcessor`` is wrapped as it is imported. Its logged loss is the
loss to show (each rank's backward scalars are its share of the global token count: ``sum over ranks``),
so the driver takes the figure ``MetricsProcessor.log`` receives for each step ``should_log`` said it
would log (``Driver.expect_logged_loss``, ``Driver.framework_loss``); the other steps carry the rank's
own backward sum. The wrappers call the originals with the same arguments and return their results.

The classes are built on first use, so importing this module imports neither framework."""

from __future__ import annotations

import functools
from typing import Any, Callable

# the module that defines a framework's ``Trainer`` -> the framework's package
_TRAINERS = {
    "transformers.trainer": "transformers",
    "lightning.pytorch.trainer.trainer": "lightning.pytorch",
    "pytorch_lightning.trainer.trainer": "pytorch_lightning",
}


def _tell(**word: Any) -> None:
    """Start the driver if nothing has (a callback added by hand) and give it the framework's word;
    nothing when MESHSCOPE_DISABLE is set."""
    from meshscope.agent import zerocode

    driver = zerocode.observe()
    if driver is not None:
        driver.framework(**word)


@functools.cache
def transformers_callback() -> type:
    """``TrainerCallback`` for ``transformers.Trainer``."""
    from transformers import TrainerCallback

    class MeshscopeCallback(TrainerCallback):
        """meshscope's Hugging Face integration: ``Trainer(..., callbacks=[meshscope.TransformersCallback()])``."""

        def on_train_begin(self, args, state, control, **kwargs):
            _tell(name="transformers", step=int(state.global_step or 0), loss_is_sum=True)

    return MeshscopeCallback


@functools.cache
def lightning_callback(package: str = "lightning.pytorch") -> type:
    """``Callback`` for the Lightning trainer of ``package`` (``lightning.pytorch`` or the older
    ``pytorch_lightning``: each checks callbacks against its own base class)."""
    import importlib

    base = importlib.import_module(package).Callback

    class MeshscopeCallback(base):
        """meshscope's Lightning integration: ``Trainer(..., callbacks=[meshscope.LightningCallback()])``."""

        def on_train_start(self, trainer, pl_module):
            _tell(name=package.split(".")[0], step=int(trainer.global_step or 0), loss_is_sum=True)

    return MeshscopeCallback


def _add_to_transformers(trainer: Any) -> None:
    cls = transformers_callback()
    if not any(isinstance(cb, cls) for cb in trainer.callback_handler.callbacks):
        trainer.add_callback(cls())


def _add_to_lightning(trainer: Any, *, package: str) -> None:
    cls = lightning_callback(package)
    if not any(isinstance(cb, cls) for cb in trainer.callbacks):
        trainer.callbacks.append(cls())


def _patch_torchtitan(module: Any, *, on_error: Callable[[str, BaseException], None]) -> None:
    """Wrap torchtitan's ``MetricsProcessor.should_log`` / ``log`` (module docstring)."""
    from meshscope.agent import zerocode

    cls = module.MetricsProcessor
    should_log, log = cls.should_log, cls.log

    @functools.wraps(should_log)
    def should_log_wrapper(self, step, *args, **kwargs):
        result = should_log(self, step, *args, **kwargs)
        try:
            driver = zerocode.current()
            if driver is not None and result:
                driver.expect_logged_loss(framework="torchtitan")
        except Exception as exc:
            on_error("torchtitan.should_log", exc)
        return result

    @functools.wraps(log)
    def log_wrapper(self, step, global_avg_loss, *args, **kwargs):
        try:
            driver = zerocode.current()
            if driver is not None:
                driver.framework_loss(global_avg_loss)
        except Exception as exc:
            on_error("torchtitan.log", exc)
        return log(self, step, global_avg_loss, *args, **kwargs)

    cls.should_log, cls.log = should_log_wrapper, log_wrapper


def add_when_imported(when_imported: Callable, *, on_error: Callable[[str, BaseException], None]) -> None:
    """Have every trainer built in this process carry meshscope's callback (``meshscope run``), and
    torchtitan's metrics report their loss."""

    def titan(module: Any) -> None:
        try:
            _patch_torchtitan(module, on_error=on_error)
        except Exception as exc:
            on_error("torchtitan.patch", exc)

    when_imported("torchtitan.components.metrics", titan)

    def patch(module: Any, *, package: str) -> None:
        try:
            cls = module.Trainer
            init = cls.__init__

            @functools.wraps(init)
            def __init__(self, *args, **kwargs):
                init(self, *args, **kwargs)
                try:
                    if package == "transformers":
                        _add_to_transformers(self)
                    else:
                        _add_to_lightning(self, package=package)
                except Exception as exc:  # the trainer works without us
                    on_error(f"{package}.callback", exc)

            cls.__init__ = __init__
        except Exception as exc:
            on_error(f"{package}.patch", exc)

    for module_name, package in _TRAINERS.items():
        when_imported(module_name, functools.partial(patch, package=package))
