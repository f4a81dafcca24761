"""The what-if planner: the α-β fit against synthetic collectives of known α and β, the processor-sharing
pipeline simulation against the plain one and its bounds, layout checks against the trainer's own
messages, and (gloo tier) real 2-rank runs that the planner calibrated from reproduces within 5 %
(``meshscope report``'s step time), plus ``meshscope plan`` as a user runs it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from meshscope.dashboard import views
from meshscope.dashboard.planner import calibration, interval, layouts, links, probe, whatif
from meshscope.dashboard.planner import predict as planner
from meshscope.dashboard.analysis import busbw_factor
from meshscope.dashboard.pipeline_sim import makespan_shared, simulate
from meshscope.trainer import config as trainer_config
from meshscope.agent.contract.layout import FLAVORS, LayoutError
from tests.support.jobs import REFERENCE_ARGS, REFERENCE_LAYOUTS, REFERENCE_NPROC, ingest, run_job, torchrun

# serial: predictions from probe runs against runs timed at another moment: both must see the same machine
pytestmark = pytest.mark.serial

TINY_WIDE = FLAVORS["tiny-wide"]


def _instances(op: str, n: int, *, alpha: float, beta: float, noise: float, rng) -> pd.DataFrame:
    sizes = np.repeat(2.0 ** np.arange(10, 27, 2), 20)  # 1 KiB .. 64 MiB, 20 of each
    t = alpha + sizes * busbw_factor(op, n) / beta
    return pd.DataFrame({"op": op, "group_size": n, "bytes": sizes.astype(np.int64),
                         "duration_s": t * (1 + rng.normal(0, noise, len(t)))})


def test_alpha_beta_fit_recovers_known_latency_and_bandwidth():
    rng = np.random.default_rng(0)
    truth = {("all_reduce", 4): (40e-6, 8e9), ("all_gather", 2): (15e-6, 2e9), ("reduce_scatter", 8): (90e-6, 20e9)}
    inst = pd.concat([_instances(op, n, alpha=a, beta=b, noise=0.03, rng=rng) for (op, n), (a, b) in truth.items()])
    fits = calibration.fit_alpha_beta(inst).set_index(["op", "group_size"])
    for key, (a, b) in truth.items():
        fit = fits.loc[key]
        assert fit["alpha_s"] == pytest.approx(a, rel=0.15), key
        assert fit["beta_bytes_per_s"] == pytest.approx(b, rel=0.05), key
        assert fit["sizes"] == 9 and fit["rmse_rel"] < 0.06


def test_alpha_beta_fit_with_one_size_says_so():
    inst = pd.DataFrame({"op": "all_reduce", "group_size": 2, "bytes": [2**20] * 5, "duration_s": [1e-3] * 5})
    fit = calibration.fit_alpha_beta(inst).iloc[0]
    assert fit["sizes"] == 1 and fit["alpha_s"] == 0.0
    assert fit["beta_bytes_per_s"] == pytest.approx(2**20 * busbw_factor("all_reduce", 2) / 1e-3)


def test_one_size_fit_splits_its_time_as_a_many_size_fit_does_at_that_size():
    """A one-size fit (α 0) keeps its measured time at its size, takes the latency share a fit of several
    sizes has there, and so is faster per byte at larger messages than pure bandwidth would say."""
    rng = np.random.default_rng(1)
    many = _instances("all_gather", 2, alpha=1e-3, beta=1e9, noise=0.0, rng=rng)
    one = pd.DataFrame({"op": "all_reduce", "group_size": 2, "bytes": [2**19] * 5, "duration_s": [2e-3] * 5})
    fits = calibration.single_size_latency(calibration.fit_alpha_beta(pd.concat([many, one]))).set_index("op")
    ar = fits.loc["all_reduce"]
    x = 2**19 * busbw_factor("all_reduce", 2)
    assert ar["alpha_s"] + x / ar["beta_bytes_per_s"] == pytest.approx(2e-3)  # its own measurement kept
    gather_share = 1e-3 / (1e-3 + 2**19 * busbw_factor("all_gather", 2) / 1e9)
    assert ar["alpha_s"] == pytest.approx(min(calibration.MAX_LATENCY_SHARE, gather_share) * 2e-3, rel=0.05)
    assert ar["alpha_s"] + 8 * x / ar["beta_bytes_per_s"] < 8 * 2e-3
    alone = calibration.fit_alpha_beta(one)
    assert calibration.single_size_latency(alone).equals(alone)  # nothing to borrow from: unchanged


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_shared_pipeline_matches_the_plain_one_with_a_core_each_and_its_bounds_without(schedule, v):
    p, m, f, b = 4, 8, 1.0, 2.0
    alone, busy = makespan_shared(schedule=schedule, p=p, m=m, v=v, f=f, b=b, cores=p)
    plain = simulate(schedule=schedule, p=p, m=m, v=v, f=f, b=b)
    assert alone == pytest.approx(float(plain["t_end"].max()))
    assert busy == pytest.approx(m * v * (f + b))
    shared, _ = makespan_shared(schedule=schedule, p=p, m=m, v=v, f=f, b=b, cores=2)
    work = p * m * v * (f + b)
    assert work / 2 <= shared <= alone * p / 2  # no faster than all work on 2 cores, no slower than halving every rank
    assert shared > alone


def test_shared_pipeline_finishes_on_tiny_actions_and_refuses_nonsense():
    """Actions far shorter than the clock's resolution at the step's end still finish (no endless loop), and
    a rate that is not a number is refused rather than simulated."""
    span, _ = makespan_shared(schedule="gpipe", p=8, m=32, f=1e-7, b=2e-7, gap=1e-3, cores=2)
    assert 0.03 < span < 0.1  # 63 host gaps of 1 ms on the critical path, the work negligible
    with pytest.raises(ValueError):
        makespan_shared(schedule="1f1b", p=2, m=4, f=float("nan"), b=1.0, cores=2)


SHAPE = calibration.ModelShape(name="tiny-wide", n_layers=TINY_WIDE.n_layers, d_model=TINY_WIDE.d_model,
                               n_heads=TINY_WIDE.n_heads, vocab_size=TINY_WIDE.vocab_size, seq_len=64,
                               n_params=12849664, n_params_nonembedding=12718592, flops_per_token=1.0)


@pytest.mark.parametrize("spec,world,batch", [
    ({"tp": 3}, 3, 9),  # tp does not divide the heads
    ({"pp": 3}, 3, 9),  # stages do not divide the layers
    ({"dp": 2, "tp": 2}, 8, 8),  # degrees do not multiply to the world
    ({"tp": 8}, 4, 8),  # tp*pp exceeds the world
    ({"dp": 2, "tp": 2}, 4, 8),  # DDP over TP needs FSDP
    ({"dp": 4}, 4, 6),  # batch not divisible by dp
    ({"pp": 2, "microbatches": 3}, 2, 8),  # microbatches do not divide the batch
    ({"pp": 4, "microbatches": 2, "schedule": "1f1b"}, 4, 8),  # 1F1B needs m >= p
    ({"pp": 2, "schedule": "zigzag"}, 2, 8),  # unknown schedule
])
def test_invalid_layouts_get_the_trainers_message(spec, world, batch):
    with pytest.raises(LayoutError) as planned:
        layouts.resolve(spec, model=SHAPE, world_size=world, global_batch=batch)
    flags = {"parallel": {k: v for k, v in spec.items() if k in ("dp", "tp", "pp", "microbatches", "schedule")}}
    with pytest.raises(trainer_config.ConfigError) as trained:
        trainer_config.load(None, {"model.flavor": "tiny-wide", "data.batch_size": batch,
                                   **{f"parallel.{k}": v for k, v in flags["parallel"].items()}}).resolve(world)
    assert str(planned.value) == str(trained.value)


def test_every_candidate_layout_is_one_the_trainer_accepts():
    lays = layouts.candidates(model=SHAPE, world_size=8, global_batch=16)
    assert {(x.dp, x.tp, x.pp) for x in lays} >= {(8, 1, 1), (4, 2, 1), (2, 2, 2), (1, 8, 1), (2, 1, 4)}
    for x in lays:
        cfg = trainer_config.load(None, {"model.flavor": "tiny-wide", "data.batch_size": 16, "parallel.dp": x.dp,
                                         "parallel.tp": x.tp, "parallel.pp": x.pp, "parallel.fsdp": x.fsdp,
                                         "parallel.schedule": x.schedule or "1f1b",
                                         "parallel.microbatches": x.microbatches,
                                         "parallel.virtual_stages": x.virtual_stages})
        assert cfg.resolve(8).parallel.n_stages == x.pp * x.virtual_stages


# ------------------------------------------------------------------ what a calibration did not measure
LAYOUT = {"dp": 2, "tp": 1, "pp": 1, "fsdp": False, "schedule": "", "microbatches": 1, "virtual_stages": 1,
          "world_size": 2, "global_batch": 8}
LINKS = pd.DataFrame([{"op": op, "group_size": n, "alpha_s": 0.0, "beta_bytes_per_s": bw, "n": 10, "sizes": 4,
                       "bytes_min": 2**18, "bytes_max": 2**26, "rmse_rel": 0.01, "shared": shared}
                      for op, bw in (("all_reduce", 1e9), ("all_gather", 2e9), ("reduce_scatter", 5e8))
                      for n in (2, 4) for shared in (False, True)])


def _cal(traffic: list[tuple[str, dict, float, float]], *, device: str = "cpu", links: pd.DataFrame = LINKS,
         pipeline: dict | None = None) -> calibration.Calibration:
    """A calibration of measured (kind, layout changes, sharing φ, exposed seconds) rows on known links."""
    rows = [{"run": f"r{i}", "kind": kind, "exposed_s": exposed, "sharing": phi, **{**LAYOUT, **lay}}
            for i, (kind, lay, phi, exposed) in enumerate(traffic)]
    return calibration.Calibration(runs=tuple(r["run"] for r in rows), device=device, model=SHAPE, peak_flops=1e12,
                                   cores=2.0 if device == "cpu" else None, spin=1.0, links=links,
                                   traffic=pd.DataFrame(rows), counts={"tp_per_layer_mb": 4.0}, pipeline=pipeline or {},
                                   memory_measure="")


FSDP2, TP2, FSDP4 = {"fsdp": True}, {"dp": 1, "tp": 2}, {"fsdp": True, "dp": 4, "world_size": 4}


def test_exposure_not_measured_in_a_regime_is_the_other_regimes_times_their_ratio():
    """FSDP measured with and without ranks sharing cores, TP only without: TP's exposure when sharing is
    its own × FSDP's ratio between the regimes, and the note says so."""
    cal = _cal([("fsdp", FSDP2, 1.0, 0.12), ("fsdp", FSDP4, 1.8, 0.50), ("tp", TP2, 1.0, 0.08)])
    fsdp = {r: planner.exposure_of(cal, "fsdp", shared=r) for r in (False, True)}
    tp_alone = planner.exposure_of(cal, "tp", shared=False)
    assert planner.exposure_of(cal, "tp", shared=True) is None
    value, how = planner.exposure_for(cal, "tp", shared=True)
    assert value == pytest.approx(tp_alone * fsdp[True] / fsdp[False])
    assert "ratio" in how and planner.exposure_for(cal, "tp", shared=False) == (tp_alone, "")


@pytest.mark.parametrize("device,share", [("cpu", planner.OVERLAPPED_SHARE["cpu"]),
                                          ("cuda", planner.OVERLAPPED_SHARE["cuda"])])
def test_exposure_of_an_unmeasured_kind_comes_from_its_family_else_the_other_converted(device, share):
    cal = _cal([("dp_grads", {}, 1.0, 0.03)], device=device)
    dp = planner.exposure_of(cal, "dp_grads", shared=False)
    for kind in ("fsdp", "tp"):  # blocking kinds from DDP's overlapped buckets
        value, how = planner.exposure_for(cal, kind, shared=False)
        assert value == pytest.approx(dp / share) and "DDP exposing" in how
    cal = _cal([("fsdp", FSDP2, 1.0, 0.12)], device=device)
    fsdp = planner.exposure_of(cal, "fsdp", shared=False)
    assert planner.exposure_for(cal, "tp", shared=False)[0] == pytest.approx(fsdp)  # the same family
    assert planner.exposure_for(cal, "dp_grads", shared=False)[0] == pytest.approx(fsdp * share)


def test_exposure_with_no_traffic_measured_is_a_cpu_hosts_or_the_textbooks():
    for kind in planner.DEFAULT_EXPOSURE:
        assert planner.exposure_for(_cal([]), kind, shared=True)[0] == planner.DEFAULT_EXPOSURE_CPU[kind]
        assert planner.exposure_for(_cal([], device="cuda"), kind, shared=False)[0] == planner.DEFAULT_EXPOSURE[kind]


def test_links_not_measured_are_composed_scaled_or_taken_from_the_pipeline():
    notes: list[str] = []
    no_ar = LINKS[LINKS["op"] != "all_reduce"]
    lk = links.Links(_cal([], links=no_ar), notes)
    size = 2**22
    # a ring all-reduce: a reduce-scatter then an all-gather of the same buffer
    assert lk.time("all_reduce", 2, size) == pytest.approx(lk.time("reduce_scatter", 2, size)
                                                             + lk.time("all_gather", 2, size))
    assert any("reduce-scatter and an all-gather" in n for n in notes)
    # below the smallest message measured: the throughput reached there, not the fit's α
    flat = pd.DataFrame([{"op": "all_gather", "group_size": 4, "alpha_s": 0.03, "beta_bytes_per_s": float("inf"),
                          "n": 9, "sizes": 3, "bytes_min": 2**22, "bytes_max": 2**25, "rmse_rel": 0.1, "shared": True}])
    lk = links.Links(_cal([], links=flat), [], shared=True)
    assert lk.time("all_gather", 4, 2**22) == pytest.approx(0.03)
    assert lk.time("all_gather", 4, 2**18) == pytest.approx(0.03 / 16)
    # no collective measured: the pipeline's point-to-point transfers (fp32 activations: 4 bytes a value)
    empty = LINKS.iloc[:0]
    lk = links.Links(_cal([], links=empty, pipeline={"hop_s": 1e-3, "hop_values": 2**16, "gap_s": 0.0}), [])
    assert lk.time("all_reduce", 2, 2**20) == pytest.approx(2**20 * busbw_factor("all_reduce", 2) / (2**18 / 1e-3))


# ------------------------------------------------------------------------------------- real runs (gloo)
RUNS = ["ddp", "fsdp2", "tp", "pp-1f1b"]  # the session's reference runs (tests/support/jobs.py)
# Each run's own layout, predicted from a calibration that holds it, within this of its measured step.
SELF_TOLERANCE = 0.05


def _job(store, run: str, layout: str) -> None:
    """``layout``'s reference run once more, as ``run`` in ``store``."""
    run_job(store, run, REFERENCE_NPROC, *REFERENCE_ARGS, *REFERENCE_LAYOUTS[layout])


@pytest.fixture(scope="module")
def planner_store(reference_runs, tmp_path_factory):
    """The reference runs of the four layouts in one store (a copy: the tests add runs to it)."""
    return reference_runs.store_of(*RUNS, into=tmp_path_factory.mktemp("planner"))


def _self_errors(store, runs: list[str]) -> dict[str, tuple[float, float, object]]:
    """Calibrated from ``runs`` together, each run's own layout: (predicted, measured: report's slowest rank,
    median over the steps after warm-up, the prediction)."""
    from meshscope.agent.store.reader import Store
    from meshscope.dashboard import report

    load = views.direct_loader(Store.open(store))
    cal = whatif.calibrate_from(load, runs=runs)
    out = {}
    for row in cal.measured.to_dict("records"):
        pred = planner.predict(cal, layouts.measured_layout(row, model=cal.model))
        out[row["run"]] = (pred.step_time_s, report.build(load, run=row["run"])["step_time_s"], pred)
    return out


def _missed(errors: dict) -> list[str]:
    return [run for run, (pred, measured, _) in errors.items() if abs(pred / measured - 1) > SELF_TOLERANCE]


def _once_more(store, runs: list[str], missed: list[str]) -> list[str]:
    """The runs that missed, each run once more (under a new name) and calibrated again with the others: a
    2-rank job on 2 shared cores is now and then disturbed as a whole (a pp run read 0.50 s per step
    against 0.42 in the same session, and its prediction missed by 5.5 %; the model's own error on these
    layouts is 0-2 %), and a real regression misses both times."""
    again = {run: f"{run}-again" for run in missed}
    for run, name in again.items():
        _job(store, name, run)
    errors = _self_errors(store, [again.get(r, r) for r in runs])
    return [f"{r}: {errors[again.get(r, r)][0]:.4f} s predicted, {errors[again.get(r, r)][1]:.4f} s measured"
            for r in runs if again.get(r, r) in _missed(errors)]


@pytest.mark.gloo
@pytest.mark.parametrize("run", list(RUNS))
def test_planner_reproduces_the_run_it_calibrated_from(planner_store, run, tmp_path):
    """Self-consistency: calibrated from one real run, the prediction of that run's own layout is within
    5 % of its measured step time (report's: slowest rank, median over the steps after warm-up)."""
    errors = _self_errors(planner_store, [run])
    missed = _missed(errors) and _once_more(tmp_path, [run], [run])
    assert not missed, missed
    pred = errors[run][2]
    assert not pred.extrapolated, pred.extrapolated  # its own layout needs nothing it did not measure
    parts = pred.breakdown
    total = (parts["compute_s"] + parts["optimizer_s"] + parts["bubble_s"] + parts["other_s"]
             + sum(parts["exposed_comm_s"].values()))
    assert total == pytest.approx(pred.step_time_s, rel=1e-6)


@pytest.mark.gloo
def test_planner_calibrated_from_every_run_reproduces_each(planner_store):
    """What the What-if page does by default: one calibration from several runs of different layouts; each
    run's own layout is still predicted within 5 % (the compute rate, exposure and sharing of the runs
    most like it, not an average of all)."""
    errors = _self_errors(planner_store, list(RUNS))
    assert set(errors) == set(RUNS)
    missed = _missed(errors) and _once_more(planner_store, list(RUNS), _missed(errors))
    assert not missed, missed


def test_sharing_below_the_calibrations_threshold_is_none():
    """Ranks that just fit the cores a loaded host had (2 ranks on 1.96 cores) are counted as the
    calibration counts its runs: not sharing (their fits, exposure and rates are the unshared ones)."""
    cal = dataclasses.replace(_cal([]), cores=1.96)
    assert planner.sharing(cal, k=2, exposed_share=0.0) == 1.0
    assert planner.sharing(cal, k=4, exposed_share=0.0) == pytest.approx(4 / 1.96)
    assert planner.sharing(cal, k=4, exposed_share=0.0, residual=0.9) == pytest.approx(0.9 * 4 / 1.96)


def _plan(store, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshscope.cli", "plan", "--store", str(store), *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.gloo
def test_plan_cli_predicts_a_layout_and_ranks_every_layout(planner_store):
    proc = _plan(planner_store, "--run", "ddp", "--run", "pp-1f1b", "--layout", "dp=1,tp=1,pp=2,schedule=gpipe,microbatches=4",
                 "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["layout"]["pp"] == 2 and out["layout"]["schedule"] == "gpipe"
    assert out["step_time_s"] > 0 and out["tokens_per_s"] == pytest.approx(8 * 64 / out["step_time_s"])
    assert out["peak_memory_bytes"] > 0 and 0 < out["mfu"] < 1
    assert set(out["breakdown"]) >= {"compute_s", "exposed_comm_s", "bubble_s"} and out["breakdown"]["bubble_s"] > 0
    ranked = _plan(planner_store, "--run", "ddp", "--rank-layouts", "--world-size", "4", "--json")
    assert ranked.returncode == 0, ranked.stderr
    rows = json.loads(ranked.stdout)
    assert len(rows) >= 5
    speeds = [r["tokens_per_s"] for r in rows if r["memory_fits"] is not False]
    assert speeds == sorted(speeds, reverse=True)
    # A layout the calibration never saw says what it extrapolated.
    assert any("tp" in " ".join(r["extrapolated"]).lower() for r in rows if r["layout"]["tp"] > 1)
    text = _plan(planner_store, "--run", "ddp", "--layout", "tp=2")
    assert text.returncode == 0 and "step time" in text.stdout and "extrapolated" in text.stdout
    assert out["warnings"] == [] and "WARNING" not in text.stdout  # 10 steps: enough after warm-up


@pytest.mark.gloo
def test_plan_warns_when_a_run_is_too_short_to_calibrate_from(tmp_path):
    run_job(tmp_path, "short", 2, "--model", "tiny-wide", "--steps", "3")
    proc = _plan(tmp_path, "--run", "short", "--layout", "dp=2", "--json")
    assert proc.returncode == 0, proc.stderr
    (warning,) = json.loads(proc.stdout)["warnings"]
    assert warning.startswith("run short has only") and "too few to calibrate from" in warning


@pytest.mark.gloo
@pytest.mark.parametrize("args,needle", [
    (("--run", "ddp", "--layout", "tp=3"), "tp=3 does not divide n_heads=8"),
    (("--run", "ddp", "--layout", "dp=3"), "dp*tp*pp = 3*1*1 = 3 but the world size is 2"),
    (("--run", "ddp", "--layout", "bogus=1"), "'bogus=1'"),
    (("--run", "ddp", "--layout", "pp=2,schedule=zigzag"), "unknown schedule 'zigzag'"),
    (("--run", "ddp", "--layout", "tp=2", "--probe", "--probe-steps", "1"), "--probe-steps 1"),
    (("--run", "nope", "--layout", "dp=2"), "no run 'nope'"),
    (("--run", "ddp"), "either --layout"),
    (("--run", "ddp", "--rank-layouts", "--world-size", "0"), "--world-size 0"),
])
def test_plan_cli_bad_input_is_one_line_and_exit_2(planner_store, args, needle):
    proc = _plan(planner_store, *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert needle in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# ---------------------------------------------------------------------------------------- intervals
def _holdout(*rows) -> pd.DataFrame:
    return pd.DataFrame([{"run": f"h{i}", "ratio": r, "kinds": k} for i, (r, k) in enumerate(rows)],
                        columns=["run", "ratio", "kinds"])


def test_interval_adds_noise_and_each_extrapolation_in_quadrature_and_widens_by_the_holdout():
    point = 0.1
    low, high = interval.bounds(point, kinds=(), holdout=_holdout())
    assert (low, high) == pytest.approx((point / (1 + interval.NOISE), point * (1 + interval.NOISE)))
    lo_tp, hi_tp = interval.SPREAD["rate:TP"]
    lo_ex, hi_ex = interval.SPREAD["exposure"]
    low, high = interval.bounds(point, kinds=("rate:TP", "exposure"), holdout=_holdout())
    n = np.log1p(interval.NOISE)
    assert high == pytest.approx(point * np.exp(np.sqrt(n**2 + np.log(hi_tp) ** 2 + np.log(hi_ex) ** 2)))
    assert low == pytest.approx(point * np.exp(-np.sqrt(n**2 + np.log(lo_tp) ** 2 + np.log(lo_ex) ** 2)))
    # the user's own runs missed TP by 4x: their evidence, not the prior; a plain hold-out widens the noise
    _, wide = interval.bounds(point, kinds=("rate:TP",), holdout=_holdout((4.0, ("rate:TP",)), (1.2, ())))
    assert wide == pytest.approx(point * np.exp(np.sqrt(np.log(1.2) ** 2 + np.log(4.0) ** 2)))
    # two doublings beyond the largest world measured: the world spread twice (in log terms)
    _, far = interval.bounds(point, kinds=("world",), holdout=_holdout(), doublings=2.0)
    assert far == pytest.approx(point * np.exp(np.sqrt(n**2 + (2 * np.log(interval.SPREAD["world"][1])) ** 2)))


def _pred(label_dp: int, step: float, low: float, high: float, kinds=()) -> planner.Prediction:
    lay = layouts.Layout(dp=label_dp, tp=1, pp=1, fsdp=False, schedule="", microbatches=1, virtual_stages=1,
                         world_size=label_dp, global_batch=8, n_layers=4, d_model=64)
    return planner.Prediction(layout=lay, step_time_s=step, tokens_per_s=1 / step, mfu=0.1, peak_memory_bytes=1.0,
                              memory_fits=None, breakdown={}, extrapolated=(), step_time_low_s=low,
                              step_time_high_s=high, extrapolation_kinds=kinds)


def test_ranking_names_a_fastest_layout_only_when_the_intervals_do_not_overlap():
    cal = dataclasses.replace(_cal([]), measured=pd.DataFrame([{**LAYOUT, "run": "r0"}]))
    apart = planner.verdict([_pred(1, 0.10, 0.09, 0.11), _pred(2, 0.20, 0.18, 0.22)], cal=cal)
    assert apart["fastest"] == "dp1" and apart["tied"] == [] and apart["sentence"].startswith("Fastest: dp1")
    close = planner.verdict([_pred(1, 0.10, 0.09, 0.11), _pred(2, 0.105, 0.06, 0.30, ("rate:TP",)),
                             _pred(4, 0.5, 0.45, 0.55)], cal=cal)
    assert close["fastest"] is None and close["tied"] == ["dp1", "dp2"] and close["measure"] == "dp2"
    assert "Not decided" in close["sentence"] and "--probe" in close["sentence"] and "dp4" not in close["sentence"]
    # a run on the page that measured a shorter step than the first's interval allows: not named fastest
    seen = planner.verdict([_pred(1, 0.10, 0.09, 0.11), _pred(2, 0.20, 0.18, 0.22)], cal=cal,
                           measured=pd.DataFrame({"layout": ["dp2"], "measured_s": [0.08]}))
    assert seen["fastest"] is None and "a run of dp2 measured 0.080 s" in seen["sentence"]
    # a calibration that had a TP run: nothing to probe, the layout to run is named
    with_tp = dataclasses.replace(cal, measured=pd.DataFrame([{**LAYOUT, "run": "r0", "tp": 2, "dp": 1}]))
    again = planner.verdict([_pred(1, 0.10, 0.09, 0.11), _pred(2, 0.105, 0.06, 0.30, ("rate:TP",))], cal=with_tp)
    assert "--probe" not in again["sentence"] and "a run of dp2 would decide" in again["sentence"]


def test_looped_bfs_runs_every_forward_of_a_chunk_before_the_next_then_backwards_in_reverse():
    """torch's ScheduleLoopedBFS order (``_calculate_single_rank_operations``), which ``replay`` and the
    planner simulate; with balanced actions and free transfers rank 0 starts the first backward only after
    all 2·m forwards of its two chunks and the last stage's."""
    sim = simulate(schedule="looped-bfs", p=2, m=3, v=2, f=1.0, b=2.0)
    r0 = sim[sim["rank"] == 0].sort_values("t_start")
    assert list(zip(r0["kind"], r0["stage"], r0["microbatch"])) == (
        [("forward", 0, k) for k in range(3)] + [("forward", 2, k) for k in range(3)]
        + [("backward", 2, k) for k in (2, 1, 0)] + [("backward", 0, k) for k in (2, 1, 0)])
    assert set(sim["stage"]) == {0, 1, 2, 3} and len(sim) == 2 * 2 * 2 * 3


# ------------------------------------------------------------------------------- held out (gloo)
# Runs unlike the planner's grid (``tiny-wide``, batch 8): ``tiny``, batch 16, one per schedule and the
# layouts the held-out check predicts.
HELD_OUT_ARGS = ("--model", "tiny", "--batch-size", "16", "--steps", "10", "--seed", "3")
HELD_OUT = {
    "ddp": (), "fsdp2": ("--fsdp",), "tp": ("--tp", "2"),
    "gpipe": ("--pp", "2", "--schedule", "gpipe", "--microbatches", "4"),
    "1f1b": ("--pp", "2", "--schedule", "1f1b", "--microbatches", "4"),
    "interleaved": ("--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "4"),
    "interleaved-zb": ("--pp", "2", "--schedule", "interleaved-zb", "--virtual-stages", "2", "--microbatches", "4"),
    "looped-bfs": ("--pp", "2", "--schedule", "looped-bfs", "--virtual-stages", "2", "--microbatches", "4"),
}


@pytest.fixture(scope="module")
def held_out_store(tmp_path_factory):
    store = tmp_path_factory.mktemp("heldout")
    for name, args in HELD_OUT.items():
        torchrun(2, "--store", str(store), "--run-name", name, "--log-every", "10", *HELD_OUT_ARGS, *args)
    ingest(store)
    return store


@pytest.mark.gloo
@pytest.mark.parametrize("schedule", [s for s in HELD_OUT if s not in ("ddp", "fsdp2", "tp")])
def test_every_schedules_own_run_is_reproduced(held_out_store, schedule):
    """Calibrated from one pipeline run, its own layout within 5 % of its measured step (report's), with
    nothing extrapolated, the parts adding up to the step."""
    errors = _self_errors(held_out_store, [schedule])
    pred, measured, p = errors[schedule]
    assert abs(pred / measured - 1) <= SELF_TOLERANCE, (pred, measured)
    assert not p.extrapolated, p.extrapolated
    b = p.breakdown
    assert b["bubble_s"] > 0 and b["compute_s"] + b["optimizer_s"] + b["bubble_s"] + b["other_s"] + sum(
        b["exposed_comm_s"].values()) == pytest.approx(p.step_time_s, rel=1e-6)
    assert p.step_time_low_s < measured < p.step_time_high_s


@pytest.mark.gloo
def test_held_out_layouts_land_in_their_intervals_and_within_25_percent_once_probed(held_out_store, tmp_path):
    """The acceptance check of the planner's intervals on runs unlike its grid: calibrated from DDP and
    PP-1F1B, TP=2 and FSDP2 (which no calibration run measured) each measure a step inside the predicted
    interval; ``meshscope plan --probe`` runs the smallest TP and FSDP layouts, stores them as probes and
    lists them, and the point predictions land within 25 % of the measured runs."""
    from meshscope.agent.store.reader import Store

    load = views.direct_loader(Store.open(held_out_store))
    cal = whatif.calibrate_from(load, runs=["ddp", "1f1b"])
    assert set(cal.holdout["run"]) == {"ddp", "1f1b"}
    measured = whatif.calibrate_from(load, runs=["tp", "fsdp2"], holdout=False).measured.set_index("run")
    for run, kind in (("tp", "rate:TP"), ("fsdp2", "rate:FSDP")):
        p = planner.predict(cal, layouts.measured_layout({**measured.loc[run], "run": run}, model=cal.model))
        assert kind in p.extrapolation_kinds
        assert p.step_time_low_s <= measured.loc[run, "step_time_s"] <= p.step_time_high_s, (
            run, p.step_time_low_s, p.step_time_s, p.step_time_high_s, measured.loc[run, "step_time_s"])
    import shutil

    for target, run in (("tp=2", "tp"), ("dp=2,fsdp=1", "fsdp2")):
        # A probe is a 10-step job on 2 shared cores: now and then one is disturbed as a whole (an FSDP probe
        # read 0.081 s against the held-out run's 0.063 in a full suite); a real miss misses twice.
        tries = []
        for attempt in range(2):
            copy = tmp_path / f"store-{run}-{attempt}"
            shutil.copytree(held_out_store, copy)
            proc = _plan(copy, "--run", "ddp", "--run", "1f1b", "--layout", target, "--probe", "--json")
            assert proc.returncode == 0, proc.stderr
            out = json.loads(proc.stdout)
            (probed,) = out["probes"]
            assert probed["run"].startswith(f"probe-{probed['kind']}-") and probed["run"] in out["calibration_runs"]
            assert f"probe {probed['run']}" in proc.stderr
            table = views.direct_loader(Store.open(copy))("runs_table")
            assert probe.is_probe(views.meta_of(table, probed["run"])) and not probe.is_probe(views.meta_of(table, "ddp"))
            tries.append(out["step_time_s"] / measured.loc[run, "step_time_s"] - 1)
            if abs(tries[-1]) <= 0.25:
                break
        assert abs(tries[-1]) <= 0.25, (target, tries)
