"""Where the suite's time goes: per test file and the slowest tests, from the junit XML files that `make
test` writes (artifacts/junit.xml for its parallel phase, artifacts/junit-serial.xml for its serial one).
pytest's junit time of a test is its setup + call + teardown, so a module-scoped fixture (a shared reference
run) counts in the first test that uses it; under pytest-xdist the tests' times overlap, so each phase's own
wall time (the junit suite's) is printed beside their sum. ``cores`` is the CPU the test and the processes
it reaped used per second of its wall time (tests/conftest.py records it): on 2 cores, a file at 2.0 is
CPU-bound and one at 0.3 mostly waits. ``--asserts DIR`` counts the assert statements of the suite's files
(the "same or more assertions" count of a change to the suite).

    python bench/suite_durations.py [artifacts/junit.xml artifacts/junit-serial.xml] [--top 15] [--asserts tests]
"""

from __future__ import annotations

import argparse
import ast
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def durations(path: Path) -> list[tuple[str, str, float, str, float | None]]:
    """(file, test, seconds, outcome, CPU seconds or None) per test case."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = tag
        cpu = next((float(p.get("value")) for p in case.iter("property") if p.get("name") == "cpu_s"), None)
        file = case.get("classname", "").replace(".", "/") + ".py"
        out.append((file, case.get("name", ""), float(case.get("time", 0.0)), outcome, cpu))
    return out


def assert_counts(folder: Path) -> dict[str, int]:
    """The assert statements per test file (helpers under the folder included)."""
    return {str(p): sum(isinstance(n, ast.Assert) for n in ast.walk(ast.parse(p.read_text())))
            for p in sorted(folder.rglob("*.py"))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit", nargs="*", help="junit files (default: artifacts/junit.xml, and artifacts/junit-serial.xml "
                    "where make test ran on several workers)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--asserts", type=Path, help="count the assert statements under this folder instead")
    ns = ap.parse_args(argv)
    if ns.asserts is not None:
        counts = assert_counts(ns.asserts)
        for file, n in sorted(counts.items(), key=lambda kv: -kv[1]):
            print(f"{n:>6}  {file}")
        print(f"{sum(counts.values()):>6}  assert statements in {len(counts)} files under {ns.asserts}")
        return 0
    paths = [Path(p) for p in ns.junit] or [p for p in (Path("artifacts/junit.xml"), Path("artifacts/junit-serial.xml"))
                                            if p.is_file() or p.name == "junit.xml"]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"meshscope: no junit file {missing[0]!r} (run make test first)", file=sys.stderr)
        return 2
    for p in paths:
        suite = ET.parse(p).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        print(f"{p}: {float(suite.get('time', 0.0)) / 60:.1f} min wall, started {suite.get('timestamp', '?')}")
    rows = [row for p in paths for row in durations(p)]
    total = sum(r[2] for r in rows)
    by_file: dict[str, list[float]] = defaultdict(list)
    cpu_by_file: dict[str, float] = defaultdict(float)
    for file, _, t, _, cpu in rows:
        by_file[file].append(t)
        cpu_by_file[file] += cpu or 0.0
    has_cpu = any(r[4] is not None for r in rows)
    counts = defaultdict(int)
    for _, _, _, outcome, _ in rows:
        counts[outcome] += 1
    outcomes = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    print(f"{len(rows)} tests, {total / 60:.1f} min in tests ({outcomes})")
    if has_cpu:
        cpu_total = sum(cpu_by_file.values())
        print(f"CPU {cpu_total / 60:.1f} min: {cpu_total / total:.2f} cores busy on average")
    print(f"\n{'file':<48} {'tests':>5} {'s':>8} {'share':>6}" + (f" {'cores':>6}" if has_cpu else ""))
    for file, ts in sorted(by_file.items(), key=lambda kv: -sum(kv[1])):
        cores = f" {cpu_by_file[file] / sum(ts):>6.2f}" if has_cpu and sum(ts) > 0 else ""
        print(f"{file:<48} {len(ts):>5} {sum(ts):>8.1f} {sum(ts) / total:>6.1%}{cores}")
    print(f"\nslowest {ns.top}:")
    for file, name, t, _, cpu in sorted(rows, key=lambda r: -r[2])[:ns.top]:
        cores = f" {cpu / t:>5.2f} cores" if cpu is not None and t > 0 else ""
        print(f"{t:>8.1f} s{cores}  {file}::{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
