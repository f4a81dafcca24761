"""The CPU peak MFU is measured against: the best this host has shown (``agent.instrument.flops.cpu_peak``),
kept across starts in meshscope's cache. The file's rules on a known truth (a stored higher figure wins, a
lower one is raised, a broken or unwritable file is this start's calibration alone), then real jobs: every
rank of two identical 2-rank runs reads the peak a quiet process measures here, not what each rank's
calibration caught while the other rank started (59-102 GF/s on one machine, 2026-12-07)."""

from __future__ import annotations

import json

import pytest
import torch

from meshscope.agent.env import cache_root
from meshscope.agent.instrument import flops
from meshscope.agent.store.reader import Store
from tests.support.jobs import run_job


def test_the_best_figure_seen_is_kept_and_used(tmp_path, monkeypatch):
    cache = tmp_path / "cache" / flops.CPU_PEAK_FILE
    monkeypatch.setattr(flops, "calibrate_cpu_peak", lambda: 50e9)
    assert flops.cpu_peak(cache=cache) == 50e9  # nothing stored: this start's, written
    key = flops._cpu_key()
    assert json.loads(cache.read_text()) == {key: 50e9}
    cache.write_text(json.dumps({key: 80e9, "another cpu | 4 threads | fp32 512": 1.0}))
    assert flops.cpu_peak(cache=cache) == 80e9  # a higher figure from an earlier start wins, untouched
    assert json.loads(cache.read_text())[key] == 80e9
    monkeypatch.setattr(flops, "calibrate_cpu_peak", lambda: 90e9)
    assert flops.cpu_peak(cache=cache) == 90e9  # a new best is kept, the other keys too
    assert json.loads(cache.read_text()) == {key: 90e9, "another cpu | 4 threads | fp32 512": 1.0}
    assert flops.cpu_peak(cache=None) == 90e9


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"%s": "fast"}', '{"%s": Infinity}', '{"%s": -1}'])
def test_a_broken_or_unwritable_file_is_this_starts_figure_never_an_error(tmp_path, monkeypatch, content):
    monkeypatch.setattr(flops, "calibrate_cpu_peak", lambda: 42e9)
    cache = tmp_path / flops.CPU_PEAK_FILE
    cache.write_text(content.replace("%s", flops._cpu_key()))
    assert flops.cpu_peak(cache=cache) == 42e9
    assert json.loads(cache.read_text())[flops._cpu_key()] == 42e9
    blocked = tmp_path / "a-file" / flops.CPU_PEAK_FILE  # its parent is a file: nothing can be written
    (tmp_path / "a-file").write_text("")
    assert flops.cpu_peak(cache=blocked) == 42e9


@pytest.mark.gloo
@pytest.mark.serial
def test_every_rank_of_identical_runs_reads_the_hosts_peak(tmp_path):
    cache = cache_root() / flops.CPU_PEAK_FILE  # what the jobs read (the suite's MESHSCOPE_CACHE_DIR)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the jobs' ranks run (OMP_NUM_THREADS=1: tests.support.jobs.trainer_env)
    try:
        quiet = max(flops.calibrate_cpu_peak() for _ in range(3))  # this process alone: the host's figure
        flops.cpu_peak(cache=cache)
    finally:
        torch.set_num_threads(threads)
    args = ("--model", "tiny", "--steps", "4", "--seed", "1", "--batch-size", "8")
    for run in ("a", "b"):
        run_job(tmp_path, run, 2, *args)
    peaks = Store.open(tmp_path).query("SELECT run, rank, peak_flops FROM run", kinds=("run",), runs=["a", "b"])
    assert len(peaks) == 4 and (peaks["peak_flops"] >= 0.9 * quiet).all(), (peaks, quiet)
    assert peaks["peak_flops"].max() <= 1.05 * peaks["peak_flops"].min(), peaks
