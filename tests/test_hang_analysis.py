"""``dashboard.hang.analyse`` on hang rows whose truth is known by construction: the cases the real jobs of
tests/test_hang_rootcause.py do not reach (a chain of waits, a rank without a record, every rank outside
communication, a stall that resolved, a two-rank mismatch)."""

from __future__ import annotations

import json

import pandas as pd

from meshscope.dashboard import hang


def _group(name, ranks, entered, completed, dim="dp"):
    return {"group": name, "dim": dim, "mesh_dim": dim, "size": len(ranks), "ranks": list(ranks),
            "entered": entered, "completed": completed, "completed_op": "all_reduce", "completed_t": 1.0}


def _row(rank, *, op="", groups=(), t=100.0, step=7, since=12.0, frames=(("meshscope/trainer/train.py", 1, "run"),)):
    stacks = [{"thread": "MainThread", "training": True, "frames": [list(f) for f in frames]},
              {"thread": "meshscope-flush", "training": False, "frames": []}]
    return {"rank": rank, "t": t, "step": step, "since_s": since, "phase": "forward" if op else "", "in_collective": bool(op),
            "op": op, "where": op or "run", "groups": json.dumps(list(groups)), "stacks": json.dumps(stacks)}


def _last(**t_end):
    return pd.DataFrame([{"rank": int(r[1:]), "step": 6, "t_end": t} for r, t in t_end.items()])


def test_a_chain_of_waits_ends_at_the_rank_that_waits_in_nothing():
    # tp groups {0,1} and {2,3}, dp groups {0,2} and {1,3}: rank 3 is stuck in its data loader; rank 1
    # waits for it on dp, rank 0 waits for rank 1 on tp, rank 2 waits for rank 3 on tp.
    rows = pd.DataFrame([
        _row(0, op="all_reduce", groups=[_group("tp0", (0, 1), 41, 40, "tp"), _group("dp0", (0, 2), 20, 20)]),
        _row(1, op="all_reduce", groups=[_group("tp0", (0, 1), 40, 40, "tp"), _group("dp1", (1, 3), 21, 20)]),
        _row(2, op="all_reduce", groups=[_group("tp1", (2, 3), 41, 40, "tp"), _group("dp0", (0, 2), 20, 20)]),
        _row(3, groups=[_group("tp1", (2, 3), 40, 40, "tp"), _group("dp1", (1, 3), 20, 20)],
             frames=[("meshscope/trainer/data.py", 9, "next_batch")]),
    ])
    h = hang.analyse(rows, _last(r0=90, r1=90, r2=90, r3=90), world_size=4)
    assert h["status"] == "hung" and h["culprit_ranks"] == [3] and h["mismatch"] is None
    assert h["culprit_frames"] == {"3": "meshscope/trainer/data.py:9 next_batch"}
    assert "Rank 3 holds the job" in h["verdict"]


def test_a_rank_without_a_record_is_named_only_when_no_reported_rank_explains_the_wait():
    rows = pd.DataFrame([_row(r, op="all_gather", groups=[_group("0", range(3), 9, 8, "fsdp")]) for r in (0, 1)])
    h = hang.analyse(rows, _last(r0=90, r1=90), world_size=3)
    assert h["culprit_ranks"] == [2] and h["missing_ranks"] == [2]
    assert "sent no hang record" in h["verdict"]


def test_every_rank_outside_communication_names_no_culprit():
    rows = pd.DataFrame([_row(r, groups=[_group("0", (0, 1), 8, 8)]) for r in (0, 1)])
    h = hang.analyse(rows, _last(r0=90, r1=90), world_size=2)
    assert h["culprit_ranks"] == [] and h["waiting"] is None
    assert h["verdict"].startswith("Every reporting rank is stalled outside communication")


def test_a_stall_the_ranks_recovered_from_is_resolved_and_no_rows_is_no_hang():
    rows = pd.DataFrame([_row(0, op="all_reduce", groups=[_group("0", (0, 1), 9, 8)]), _row(1, groups=[_group("0", (0, 1), 8, 8)])])
    h = hang.analyse(rows, _last(r0=130, r1=131), world_size=2)  # both ranks ended a step after the records
    assert h["status"] == "resolved" and h["culprit_ranks"] == [1] and "resolved" in h["verdict"]
    none = hang.analyse(rows.iloc[:0], _last(r0=1), world_size=2)
    assert none["status"] == "none" and none["verdict"].startswith("No hang")


def test_a_two_rank_mismatch_names_both_ranks_and_the_since_grows_with_now():
    rows = pd.DataFrame([_row(0, op="all_reduce", groups=[_group("0", (0, 1), 13, 12)]),
                         _row(1, op="all_gather", groups=[_group("0", (0, 1), 13, 12)])])
    h = hang.analyse(rows, _last(r0=90, r1=90), world_size=2, now=130.0)
    m = h["mismatch"]
    assert m == {"group": "0", "dim": "dp", "seq": 13, "ops": {"0": "all_reduce", "1": "all_gather"}, "odd_ranks": [0, 1]}
    assert h["culprit_ranks"] == [0, 1]  # two ranks, two ops: neither is the odd one
    assert h["since_s"] == 12.0 + 30.0


def test_the_cli_names_a_bad_store_or_run_in_one_line_and_exits_2(tmp_path, capsys):
    from meshscope.dashboard import hangcli

    assert hangcli.main(["--store", str(tmp_path / "nowhere"), "--run", "r"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nowhere" in err[0] and "Traceback" not in err[0]
    (tmp_path / "empty").mkdir()
    assert hangcli.main(["--store", str(tmp_path / "empty"), "--run", "r"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no run 'r'" in err[0]
