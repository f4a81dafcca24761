"""Run a function right after a module is first imported, without importing it first.

The zero-code bootstrap runs in every Python process of a job, most of which never import torch (the
launcher's helpers, data workers, compilers): it must not import torch itself. A finder on
``sys.meta_path`` wraps the loader of the named modules, so the callback runs once the module has
executed, in the importing thread, before the importer sees it. A module already imported gets the
callback at once."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from types import ModuleType
from typing import Callable

Callback = Callable[[ModuleType], None]


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.hooks: dict[str, list[Callback]] = {}
        self._busy = threading.local()

    def find_spec(self, name, path=None, target=None):
        if name not in self.hooks or getattr(self._busy, "name", None) == name:
            return None
        self._busy.name = name  # find the real spec with the other finders, not ourselves
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._busy.name = None
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Loader(spec.loader, self.hooks.pop(name))
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, callbacks: list[Callback]) -> None:
        self.inner, self.callbacks = inner, callbacks

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # A package's __spec__.loader is what reloads and importlib.resources use: give back the real one.
        module.__loader__ = self.inner
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        try:
            self.inner.exec_module(module)
        except BaseException:  # the import failed: wait for the next attempt
            _FINDER.hooks.setdefault(module.__name__, []).extend(self.callbacks)
            raise
        for callback in self.callbacks:
            try:
                callback(module)
            except Exception:  # a callback's failure is its own business, never the importer's
                pass

    def __getattr__(self, name):  # get_resource_reader, is_package, get_code, ...: the real loader's
        return getattr(self.inner, name)


_FINDER = _Finder()


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``name`` has been imported (now, if it already is)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    _FINDER.hooks.setdefault(name, []).append(callback)
