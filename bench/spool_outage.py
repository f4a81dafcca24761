"""What a full disk costs a rank's telemetry: records lost, time to recover once space returns, and the
training thread's ``submit`` cost during the outage. In-process, on the real ``SpoolWriter``.

Method: a producer thread (standing in for the training thread) submits records at a trainer-like pace
(``--rate`` steps/s, each step one ``step``-sized batch of ``event`` rows) to a SpoolWriter whose spool
lies on a small tmpfs (root with CAP_SYS_ADMIN; else ``RLIMIT_FSIZE`` of this process is set to 0 and
back, which fails every append with EFBIG). After 1 s the disk is filled, after ``D`` s it is freed, and
the run goes on for 2 s more. Per outage length and hold size, over ``--repeats`` runs:

- lost: rows submitted but not in the spool (read back with the transport's reader), and whether that
  equals the writer's own ``dropped_records`` (it must);
- recovery: seconds from the free to the first byte appended to the spool (the writer's retry back-off:
  50 ms doubling to ``retry_max_s`` = 1 s);
- submit p50 / p99 (µs) during the outage vs before it, and the writer thread's CPU seconds per outage
  second (encoding into the hold, retries).

    python bench/spool_outage.py [--outages 0.5,2,10] [--holds default,65536] [--repeats 3] [--rate 50]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshscope.agent.contract import event_record, spool_path  # noqa: E402
from meshscope.agent.transport.reader import SpoolReader  # noqa: E402
from meshscope.agent.transport.writer import DEFAULT_MAX_HOLD_BYTES, SpoolWriter  # noqa: E402

ROWS_PER_STEP = 4  # the reference DDP trainer's records per rank and step: step, memory, 2 collectives


class Disk:
    """A disk that can be filled and freed: tmpfs with a ballast file, or this process's RLIMIT_FSIZE."""

    def __init__(self, root: Path) -> None:
        self.path = root / "store"
        self.path.mkdir()
        self.tmpfs = os.geteuid() == 0 and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(self.path)], capture_output=True).returncode == 0
        self.name = "tmpfs" if self.tmpfs else "rlimit"

    def fill(self) -> None:
        if not self.tmpfs:
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
            return
        with open(self.path / "ballast", "wb", buffering=0) as fh:
            for size in (1 << 16, 512, 1):
                try:
                    while True:
                        fh.write(b"\0" * size)
                except OSError:
                    pass

    def free(self) -> None:
        if self.tmpfs:
            (self.path / "ballast").unlink()
        else:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    def close(self) -> None:
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.path)], check=False)


def rows_in_spool(path: Path) -> list[int]:
    reader, offset, steps = SpoolReader(path, max_read_bytes=1 << 30), 0, []
    while True:
        res = reader.read(offset)
        steps += [s for f in res.frames if f.kind == "event" for s in f.table.column("step").to_pylist()]
        if res.offset == offset:
            return steps
        offset = res.offset


def thread_cpu_s(native_id: int) -> float:
    for t in psutil.Process().threads():
        if t.id == native_id:
            return t.user_time + t.system_time
    return 0.0


def one_run(root: Path, *, outage_s: float, hold: int, rate: float) -> dict:
    disk = Disk(root)
    try:
        path = spool_path(disk.path, run="bench", rank=0, attempt=0)
        w = SpoolWriter(path=path, run="bench", rank=0, attempt=0, host="h", max_hold_bytes=hold)
        phase = {"name": "before"}
        lat: dict[str, list[float]] = {"before": [], "outage": [], "after": []}
        stop = threading.Event()
        n = [0]

        def produce() -> None:
            period = 1.0 / rate
            nxt = time.perf_counter()
            while not stop.is_set():
                rows = [event_record(t=time.time(), step=n[0] + i, kind="start", message="x" * 24)
                        for i in range(ROWS_PER_STEP)]
                t0 = time.perf_counter()
                w.submit("event", rows)
                lat[phase["name"]].append(time.perf_counter() - t0)
                n[0] += ROWS_PER_STEP
                nxt += period
                time.sleep(max(0.0, nxt - time.perf_counter()))

        producer = threading.Thread(target=produce)
        producer.start()
        time.sleep(1.0)
        while not path.exists():
            time.sleep(0.01)
        disk.fill()
        phase["name"] = "outage"
        cpu0 = thread_cpu_s(w._thread.native_id)
        time.sleep(outage_s)
        cpu_outage = thread_cpu_s(w._thread.native_id) - cpu0
        size = path.stat().st_size
        disk.free()
        t_free = time.perf_counter()
        phase["name"] = "after"
        recovery = None
        while time.perf_counter() - t_free < 5.0:
            if path.stat().st_size > size:
                recovery = time.perf_counter() - t_free
                break
            time.sleep(0.001)
        time.sleep(2.0)
        stop.set()
        producer.join()
        w.close(timeout_s=5)
        stored = rows_in_spool(path)
        assert len(stored) == len(set(stored)), "duplicated rows in the spool"
        return {
            "submitted": n[0], "lost": n[0] - len(stored), "counted": w.dropped_records, "recovery_s": recovery,
            "submit_before_us": [x * 1e6 for x in lat["before"]], "submit_outage_us": [x * 1e6 for x in lat["outage"]],
            "writer_cpu_per_s": cpu_outage / outage_s, "disk": disk.name, "spool_bytes": path.stat().st_size,
        }
    finally:
        disk.close()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--outages", default="0.5,2,10", help="outage lengths, seconds, comma-separated")
    ap.add_argument("--holds", default="default,65536", help="hold sizes in bytes ('default': 8 MiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rate", type=float, default=50.0, help="steps per second")
    args = ap.parse_args(argv)
    try:
        outages = [float(x) for x in args.outages.split(",")]
        holds = [DEFAULT_MAX_HOLD_BYTES if h == "default" else int(h) for h in args.holds.split(",")]
    except ValueError as exc:
        ap.error(f"--outages / --holds: {exc}")
    if args.repeats < 1 or args.rate <= 0 or any(o <= 0 for o in outages) or any(h < 0 for h in holds):
        ap.error("--repeats >= 1, --rate > 0, outages > 0 and holds >= 0")
    print(f"{'hold':>9} {'outage s':>8} {'lost/made in outage':>20} {'counted':>8} {'recovery s (max)':>16} "
          f"{'submit p50/p99 us before':>25} {'during':>14} {'writer CPU s/s':>14}  disk")
    for hold in holds:
        for outage in outages:
            runs = []
            for _ in range(args.repeats):
                with tempfile.TemporaryDirectory(prefix="meshscope-outage-") as tmp:
                    runs.append(one_run(Path(tmp), outage_s=outage, hold=hold, rate=args.rate))
            made = round(outage * args.rate * ROWS_PER_STEP)
            lost = [r["lost"] for r in runs]
            exact = all(r["lost"] == r["counted"] for r in runs)
            rec = [r["recovery_s"] for r in runs]
            before = [x for r in runs for x in r["submit_before_us"]]
            during = [x for r in runs for x in r["submit_outage_us"]]
            rec_txt = "none" if None in rec else f"{max(rec):.3f}"
            print(f"{hold:>9} {outage:>8.1f} {f'{statistics.median(lost):.0f}/{made}':>20} "
                  f"{'exact' if exact else 'WRONG':>8} {rec_txt:>16} "
                  f"{f'{pct(before, .5):.1f}/{pct(before, .99):.1f}':>25} "
                  f"{f'{pct(during, .5):.1f}/{pct(during, .99):.1f}':>14} "
                  f"{statistics.median(r['writer_cpu_per_s'] for r in runs):>14.4f}  {runs[0]['disk']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
