"""Record columns built from buffers (agent/transport/columns.py) against ``pyarrow.array`` itself, the truth:
equal arrays where the values are accepted, the same refusal where not; and a rank's telemetry never
imports pandas."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshscope.agent.contract import SCHEMAS
from meshscope.agent.transport.columns import column
from tests.support.hookcost import free_port

TYPES = sorted({field.type for schema in SCHEMAS.values() for field in schema}, key=str)


def reference(values, arrow_type):
    """pyarrow.array's answer: the array, or the exception type it raised."""
    try:
        return pa.array(values, type=arrow_type)
    except Exception as exc:
        return type(exc)


def check(values, arrow_type):
    want = reference(values, arrow_type)
    if isinstance(want, type):
        with pytest.raises(want):
            column(values, arrow_type)
        return
    got = column(values, arrow_type)
    got.validate(full=True)
    assert got.type == arrow_type and got.null_count == want.null_count
    # equals() treats NaN != NaN: compare the values, NaN by NaN
    assert [(type(v), "nan") if isinstance(v, float) and math.isnan(v) else v for v in got.to_pylist()] == \
        [(type(v), "nan") if isinstance(v, float) and math.isnan(v) else v for v in want.to_pylist()]


def test_the_schemas_use_only_the_types_built_from_buffers():
    assert {str(t) for t in TYPES} == {"double", "int64", "int32", "bool", "string"}


@pytest.mark.parametrize("values, arrow_type", [
    ((1.0, -2.5, None, float("nan"), float("inf"), -0.0, 1e308, 5e-324), pa.float64()),
    ((1, 2 ** 53, -(2 ** 53), 3.5), pa.float64()),  # ints a double holds exactly, mixed with floats
    ((np.float64(1.25), 2.0), pa.float64()),  # a float subclass
    ((0, -1, 2 ** 63 - 1, -(2 ** 63), None), pa.int64()),
    ((2 ** 31 - 1, -(2 ** 31), None, 0), pa.int32()),
    ((True, False, None, True, True, False, True, False, True), pa.bool_()),  # past one bitmap byte
    (("", "a", "ünïcødé ✓", None, "x" * 1000), pa.string()),
    ((None, None), pa.string()),
    ((None,), pa.float64()),
])
def test_well_typed_columns_equal_pyarrow_array(values, arrow_type):
    check(values, arrow_type)


@pytest.mark.parametrize("values, arrow_type", [
    (("not a float", 1.0), pa.float64()),
    ((2 ** 53 + 1,), pa.float64()),  # not exact in a double: pyarrow refuses it
    ((True,), pa.int64()),  # a bool in an integer column: refused
    ((2 ** 63,), pa.int64()),
    ((2 ** 31,), pa.int32()),
    ((1.5,), pa.int64()),  # pyarrow truncates it: the same here (its own path)
    ((1,), pa.bool_()),
    (("a\ud800",), pa.string()),  # a lone surrogate cannot be UTF-8
    ((b"bytes",), pa.string()),  # pyarrow takes bytes as a string: the same here
    ((np.int64(3), 4), pa.int64()),
    ((np.float32(0.5),), pa.float64()),
])
def test_other_values_get_pyarrow_arrays_answer(values, arrow_type):
    check(values, arrow_type)


VALUES = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2 ** 64), max_value=2 ** 64),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))


@settings(max_examples=300, deadline=None)
@given(values=st.lists(VALUES, min_size=1, max_size=20), arrow_type=st.sampled_from(TYPES))
def test_any_column_is_what_pyarrow_array_makes_of_it(values, arrow_type):
    check(tuple(values), arrow_type)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), arrow_type=st.sampled_from(TYPES))
def test_columns_of_their_own_type_equal_pyarrow_array(data, arrow_type):
    own = {"double": st.floats(), "int64": st.integers(-(2 ** 63), 2 ** 63 - 1),
           "int32": st.integers(-(2 ** 31), 2 ** 31 - 1), "bool": st.booleans(), "string": st.text()}[str(arrow_type)]
    check(tuple(data.draw(st.lists(st.one_of(st.none(), own), min_size=1, max_size=40))), arrow_type)


def test_a_ranks_telemetry_does_not_import_pandas(tmp_path):
    # A real DDP job of one gloo rank through the telemetry core: steps, collectives, an event, its run
    # record (torch's version is a str subclass), every record written to the spool; pandas never imported.
    script = textwrap.dedent(f"""
        import os, sys
        import torch, torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str({free_port()}))
        dist.init_process_group("gloo", rank=0, world_size=1)
        from meshscope.agent.instrument.telemetry import Telemetry, TelemetryConfig
        tel = Telemetry(config=TelemetryConfig(store={str(tmp_path)!r}, run="nopandas"), rank=0, world_size=1)
        tel.start({{"strategy": "ddp"}})
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
        tel.attach(model_parts=[model])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(20):
            with tel.step(i) as ctx:
                loss = model(torch.randn(4, 8)).square().mean()
                loss.backward(); opt.step(); opt.zero_grad()
                dist.all_reduce(loss.detach())
                ctx.update(loss=loss.detach(), tokens=4)
        tel.event("note", "hello")
        tel.close()
        w = tel._writer
        print(w.written_records, w.dropped_records, w.encode_errors, "pandas" in sys.modules)
        dist.destroy_process_group()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-2000:]
    written, dropped, encode_errors, pandas = out.stdout.split()
    assert int(written) >= 20 + 20 + 1 + 1 and (dropped, encode_errors, pandas) == ("0", "0", "False")
