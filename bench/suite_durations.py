"""Where the suite's time goes: per test file and the slowest tests, from the junit XML that `make test`
writes (artifacts/junit.xml). pytest's junit time of a test is its setup + call + teardown, so a
module-scoped fixture (a shared reference run) counts in the first test that uses it.

    python bench/suite_durations.py [artifacts/junit.xml] [--top 15]
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def durations(path: Path) -> list[tuple[str, str, float, str]]:
    """(file, test, seconds, outcome) per test case."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = tag
        file = case.get("classname", "").replace(".", "/") + ".py"
        out.append((file, case.get("name", ""), float(case.get("time", 0.0)), outcome))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit", nargs="?", default="artifacts/junit.xml")
    ap.add_argument("--top", type=int, default=15)
    ns = ap.parse_args(argv)
    path = Path(ns.junit)
    if not path.is_file():
        print(f"meshscope: no junit file {str(path)!r} (run make test first)", file=sys.stderr)
        return 2
    rows = durations(path)
    total = sum(r[2] for r in rows)
    by_file: dict[str, list[float]] = defaultdict(list)
    for file, _, t, _ in rows:
        by_file[file].append(t)
    counts = defaultdict(int)
    for *_, outcome in rows:
        counts[outcome] += 1
    print(f"{len(rows)} tests, {total / 60:.1f} min in tests ({', '.join(f'{n} {k}' for k, n in sorted(counts.items()))})")
    print(f"\n{'file':<48} {'tests':>5} {'s':>8} {'share':>6}")
    for file, ts in sorted(by_file.items(), key=lambda kv: -sum(kv[1])):
        print(f"{file:<48} {len(ts):>5} {sum(ts):>8.1f} {sum(ts) / total:>6.1%}")
    print(f"\nslowest {ns.top}:")
    for file, name, t, _ in sorted(rows, key=lambda r: -r[2])[:ns.top]:
        print(f"{t:>8.1f} s  {file}::{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
