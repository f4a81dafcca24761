"""The reference trainer with its injected crash confined to the first torchrun attempt.

``trainer.faults`` fires ``--crash-rank/--crash-step`` in every attempt, so under ``--max_restarts`` a
resumed attempt would crash again at the same step. A real fault usually does not recur after a
restart; this wrapper drops the crash flags when ``TORCHELASTIC_RESTART_COUNT`` > 0 and then runs
``trainer.train.main`` unchanged. Launch it in place of ``-m meshscope.trainer.train``::

    torchrun --max_restarts 1 ... tests/workers/faults_train.py --crash-rank 1 --crash-step 12 ...
"""

from __future__ import annotations

import os
import sys

from meshscope.trainer.train import exit_without_finalization, main

FIRST_ATTEMPT_ONLY = ("--crash-rank", "--crash-step")


def argv_for_attempt(argv: list[str], attempt: int) -> list[str]:
    if attempt == 0:
        return list(argv)
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in FIRST_ATTEMPT_ONLY:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


if __name__ == "__main__":
    exit_without_finalization(
        main(argv_for_attempt(sys.argv[1:], int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))))
