"""The metric catalog: naming conventions, cardinality budget, the docs/metrics.md table."""

from __future__ import annotations

import re

from meshscope.agent import catalog
from meshscope.agent.catalog import BASE_UNITS, CATALOG, PREFIX, SERIES_PER_RANK_MAX


def test_names_follow_the_conventions():
    seen = set()
    for spec in CATALOG:
        name = spec.name
        assert name not in seen, f"duplicate {name}"
        seen.add(name)
        assert re.fullmatch(r"meshscope_[a-z][a-z0-9_]*", name), name
        assert spec.type in catalog.TYPES and spec.help.endswith(".") and spec.source
        assert not name.endswith("_created")
        assert name.endswith("_total") == (spec.type == "counter"), name
        assert name.endswith("_info") == (spec.type == "info"), name
        stem = name.removesuffix("_total")
        if spec.unit:
            assert spec.unit in BASE_UNITS and stem.endswith("_" + spec.unit), name
        else:
            assert not any(stem.endswith("_" + u) for u in BASE_UNITS), f"{name} lacks unit {stem.rsplit('_', 1)[1]}"
        if "timestamp" in name:
            assert stem.endswith("_timestamp_seconds"), name
        assert name.startswith(PREFIX)


def test_labels_never_churn():
    # Step, span id, pod or restart attempt as labels would create series without bound.
    for spec in CATALOG:
        assert not {"step", "pod", "span", "attempt", "pid"} & set(spec.labels), spec.name
        assert all(re.fullmatch(r"[a-z][a-z0-9_]*", lab) for lab in spec.labels + spec.info_labels)
        if spec.scope == "rank":
            assert spec.labels[:2] == ("run", "rank") and spec.per_rank in ("fixed", "dim", "op_dim")
        else:
            assert "rank" not in spec.labels and not spec.per_rank, spec.name
        if spec.type == "histogram":
            assert spec.scope != "rank", "histograms are per job, never per rank"


def test_the_rank_budget_leaves_room_for_collectives():
    budget = catalog.rank_budget()
    # fixed series + a few dims + the overflow label set must leave room for real op x dim series
    assert budget.fixed + 4 * budget.per_dim + 2 * budget.per_op_dim <= SERIES_PER_RANK_MAX
    assert budget.per_op_dim == 3 and budget.per_dim == 1


def test_sample_names_expand_histograms_and_keep_counter_suffixes():
    names = catalog.sample_names()
    assert {"meshscope_step_wall_seconds_bucket", "meshscope_step_wall_seconds_sum",
            "meshscope_step_wall_seconds_count"} <= names
    assert "meshscope_rank_steps_total" in names and "meshscope_step_wall_seconds" not in names
    assert catalog.spec("rank_steps_total").family_name == "meshscope_rank_steps"
    assert catalog.spec("meshscope_run_info").family_name == "meshscope_run"


def test_markdown_table_lists_every_metric():
    table = catalog.markdown_table()
    rows = [ln for ln in table.splitlines() if ln.startswith("| `")]
    assert len(rows) == len(CATALOG)
    assert all(row.count(" | ") == 5 for row in rows)
    assert "| `meshscope_rank_collective_seconds_total` | counter | seconds | run, rank, op, dim |" in table
    assert "Present when value >= 0" in table
