"""What the bootstrap's ``sitecustomize`` calls in every process of a ``meshscope run`` job: the driver,
configured by the launcher's environment, and meshscope's callback on every framework trainer built."""

from __future__ import annotations

import os
from typing import Any, Mapping

from meshscope.agent import zerocode
from meshscope.agent.zerocode import frameworks
from meshscope.agent.zerocode.imports import when_imported


def activate(*, environ: Mapping[str, str] = os.environ) -> Any:
    """Install the zero-code driver in this process (once); ``None`` when MESHSCOPE_DISABLE is set."""
    if zerocode.disabled(environ):
        return None
    driver = zerocode.observe(store=environ.get(zerocode.ENV_STORE) or zerocode.DEFAULT_STORE,
                              run=environ.get(zerocode.ENV_RUN) or None)
    frameworks.add_when_imported(when_imported, on_error=driver.error)
    return driver
