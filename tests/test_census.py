"""The layout and the FLOPs zero-code reads off a job's structure (``agent.zerocode.census``), on every
data / tensor parallel layout torch builds (tests/workers/census_layouts.py, 4 gloo ranks), against the
layout that was built and the model's shape (6·N + 12·L·D·S with the TP plan's split; under context
parallelism a rank's sequence is 1/cp of the one attended over). One launch, eight layouts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshscope.agent.contract.formulas import canonical_strategy, strategy_name

WORKER = Path(__file__).resolve().parent / "workers" / "census_layouts.py"
# layout: (strategy, dp, tp, cp). fsdp+cp is torchtitan's: FSDP over dp_shard × cp flattened, the cp dim on
# a mesh no parameter lives on.
EXPECTED = {"ddp": ("ddp", 4, 1, 1), "replicate": ("ddp", 4, 1, 1), "fsdp": ("fsdp", 4, 1, 1),
            "replicate-shard1": ("ddp", 4, 1, 1), "hsdp": ("hsdp", 4, 1, 1), "tp": ("tp", 1, 4, 1),
            "fsdp+tp": ("fsdp+tp", 2, 2, 1), "fsdp+cp": ("fsdp+cp", 2, 1, 2)}


@pytest.mark.gloo
def test_census_names_each_layout_and_counts_its_flops(tmp_path):
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                          str(WORKER), *EXPECTED], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["layout"]: r for r in map(json.loads, (line for line in out.stdout.splitlines() if line.startswith("{")))}
    assert set(rows) == set(EXPECTED)
    for name, (strategy, dp, tp, cp) in EXPECTED.items():
        r = rows[name]
        assert (r["strategy"], r["sizes"]["dp"], r["sizes"]["tp"], r["sizes"].get("cp", 1)) == (strategy, dp, tp, cp), r
        assert r["flops_per_token"] == pytest.approx(r["expected"], rel=1e-9), r


def test_one_spelling_of_each_layout():
    assert strategy_name(dp="fsdp", tp=2) == "fsdp+tp" == canonical_strategy("tp+fsdp")
    assert strategy_name(dp="fsdp", tp=2, pp=2) == "pp+fsdp+tp" == canonical_strategy("pp+tp+fsdp")
    assert strategy_name(dp="hsdp", tp=2, cp=2, pp=2) == "pp+hsdp+cp+tp"
    assert strategy_name(world_size=1) == "single" and strategy_name(world_size=4) == "manual"
    assert canonical_strategy("single") == "single" and canonical_strategy("weird+x") == "weird+x"
    with pytest.raises(ValueError, match="'zero'"):
        strategy_name(dp="zero")
