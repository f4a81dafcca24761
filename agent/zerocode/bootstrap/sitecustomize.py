"""meshscope's zero-code bootstrap. ``meshscope run`` puts this folder first on the job's PYTHONPATH, so
Python's ``site`` imports this file at start-up in every process of the job. It:

1. runs the job's own ``sitecustomize`` (the next one on ``sys.path``) as ``site`` would have, errors
   reported the way ``site`` reports them, so a job keeps what it had;
2. unless MESHSCOPE_DISABLE=1 (then nothing of meshscope is imported), activates the zero-code driver,
   which imports no torch and waits for the job to import it.

Nothing here may change the job: every failure is one line on stderr and the job goes on."""

import os
import sys


def _chain_own_sitecustomize():
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # what site.execsitecustomize prints
        if sys.flags.verbose:
            sys.excepthook(*sys.exc_info())
        else:
            sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(err).__name__}: {err}\n")


def _activate():
    if os.environ.get("MESHSCOPE_DISABLE", "").strip().lower() in ("1", "true", "yes", "on"):
        return
    try:
        from meshscope.agent.zerocode import inject

        inject.activate()
    except Exception as err:
        sys.stderr.write(f"meshscope: zero-code observation is off in this process ({type(err).__name__}: {err})\n")


_chain_own_sitecustomize()
_activate()
