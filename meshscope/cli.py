"""``meshscope`` command line: a thin dispatcher. Each sub-command lives with the package that owns it
and is imported only when used, so ``meshscope agent`` never imports torch and nothing imports the
dashboard unless asked to."""

from __future__ import annotations

import importlib
import sys

# sub-command -> (module, function, one-line help). Each function takes argv (list[str]) and returns an
# exit code.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("meshscope.trainer.launch", "main", "launch the reference trainer on this node (wraps torch.distributed.run)"),
    "run": ("meshscope.agent.zerocode.cli", "main", "run any training command unchanged, observed (meshscope run -- torchrun ...)"),
    "agent": ("meshscope.agent.collector.cli", "agent_main", "run the node agent: follow rank spools, serve /metrics, write the store"),
    "ingest": ("meshscope.agent.collector.cli", "ingest_main", "ingest every spool under a store once and exit"),
    "demo": ("meshscope.trainer.demo", "main", "train every strategy instrumented, then serve the dashboard (make demo)"),
    "sweep": ("meshscope.dashboard.sweep", "main", "run one model over a grid of world sizes / strategies (scaling study)"),
    "export-trace": ("meshscope.agent.trace", "main", "write a Perfetto / Chrome-trace JSON of a step range"),
    "trace": ("meshscope.agent.deeptrace", "main", "torch.profiler on a running job's ranks for N steps: Kineto traces + one merged timeline"),
    "report": ("meshscope.dashboard.report", "main", "a run's verdicts in the terminal (--json for scripts): what the pages say"),
    "hang": ("meshscope.dashboard.hangcli", "main", "why a run hangs, while it is alive: culprit ranks, the collective the others wait in, stacks"),
    "diff": ("meshscope.dashboard.diffcli", "main", "compare run B with run A: how much slower, with what confidence, which part and which change (a CI gate with --fail-above)"),
    "plan": ("meshscope.dashboard.planner.cli", "main", "predict step time, MFU and memory of other layouts from measured runs"),
    "dashboard": ("meshscope.dashboard.cli", "main", "serve the Streamlit dashboard over a store (and Prometheus)"),
    "stack": ("meshscope.agent.stack", "main", "run Prometheus + Alertmanager (+ an agent) on 127.0.0.1 with meshscope's rules"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: meshscope <command> [options]   (meshscope --version)", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from meshscope.agent import version

        print(f"meshscope {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"meshscope: error: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
