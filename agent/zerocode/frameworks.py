"""Hugging Face ``Trainer`` and Lightning ``Trainer`` integrations: what zero-code cannot see by itself.

Each is a callback a user adds in one line (``callbacks=[meshscope.TransformersCallback()]`` /
``[meshscope.LightningCallback()]``), and that ``meshscope run`` adds by itself to every trainer built in
the job. It starts the zero-code driver (``observe``) if nothing has, and tells it:
- the framework's global step when training starts (a resumed run keeps its numbering);
- that the losses handed to backward are divided by the gradient accumulation (both frameworks do: their
  sum is the step's loss), so a step of several micro-batches still has its loss.
Steps, phases, collectives, tokens and FLOPs come from the driver, the same as for a plain loop.

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


def add_when_imported(when_imported: Callable, *, on_error: Callable[[str, BaseException], None]) -> None:
    """Have every trainer built in this process carry meshscope's callback (``meshscope run``)."""

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
