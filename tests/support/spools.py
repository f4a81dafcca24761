"""Synthetic spool files: realistic record streams for tests, the ingest benchmark and demos.

Everything is built column-wise with numpy and framed directly (no per-row Python), so benchmarks measure
the agent, not the generator.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import numpy as np
import pyarrow as pa

from meshscope.agent.contract import DIMS, OPS, SCHEMAS, mfu, spool_path
from meshscope.agent.transport.frame import encode_data_frame, encode_file_header

# A 3-D parallel layout's collectives: (op, dim) pairs a rank issues every step.
DEFAULT_OPS_DIMS = (("all_gather", "fsdp"), ("reduce_scatter", "fsdp"), ("all_reduce", "tp"),
                    ("send", "pp"), ("recv", "pp"))


def _table(kind: str, columns: dict) -> pa.Table:
    schema = SCHEMAS[kind]
    return pa.Table.from_arrays([pa.array(columns[f.name], type=f.type) for f in schema], schema=schema)


def run_table(*, rank: int, world_size: int, attempt: int = 0, t0: float, mesh: dict | None = None,
              host: str = "node0") -> pa.Table:
    mesh = mesh or {"fsdp": world_size}
    values = {f.name: [None] for f in SCHEMAS["run"]}
    values.update({
        "rank": [rank], "world_size": [world_size], "local_rank": [rank % 8], "host": [host], "pid": [1000 + rank],
        "attempt": [attempt], "t_start": [t0], "strategy": ["+".join(mesh)], "mesh": [json.dumps(mesh)],
        "coords": ["{}"], "schedule": [""], "microbatches": [1], "virtual_stages": [1], "model": ["synthetic"],
        "n_params": [10**9], "n_params_nonembedding": [9 * 10**8], "n_layers": [16], "d_model": [2048],
        "seq_len": [2048], "global_batch": [64], "flops_per_token": [6e9], "peak_flops": [989e12],
        "peak_source": ["table:H100"], "device": ["cpu"], "backend": ["gloo"], "dtype": ["bf16"],
        "torch_version": ["2.13"], "meshscope_version": ["0.1.0"], "python_version": ["3.11"], "config": ["{}"],
    })
    return _table("run", values)


def step_table(*, steps: np.ndarray, t0: float, rank: int, rng: np.random.Generator, step_s: float = 1.0,
               slow: float = 1.0) -> pa.Table:
    n = len(steps)
    compute = rng.uniform(0.55, 0.65, n) * step_s * slow
    exposed = np.full(n, 0.2 * step_s)
    bubble = np.full(n, 0.05 * step_s)
    other = np.maximum(step_s * slow - compute - exposed - bubble, 0.0)
    wall = compute + exposed + bubble + other
    t_start = t0 + steps * step_s * slow
    loss = 3.0 - 0.001 * steps
    return _table("step", {
        "step": steps, "t_start": t_start, "t_end": t_start + wall, "wall_s": wall, "compute_s": compute,
        "exposed_comm_s": exposed, "bubble_s": bubble, "other_s": other, "data_s": 0.01 * wall,
        "forward_s": compute / 3, "backward_s": 2 * compute / 3, "optimizer_s": 0.02 * wall,
        "tokens": np.full(n, 4096), "flops": np.full(n, 4096 * 6e9), "mfu": np.array([mfu(flops=4096 * 6e9, seconds=w, peak_flops=989e12) for w in wall]),
        "loss": loss, "loss_nonfinite": np.zeros(n, bool), "grad_norm": np.ones(n), "lr": np.full(n, 3e-4),
        "skipped": np.zeros(n, bool), "n_collectives": np.full(n, 40), "dropped_records_total": np.zeros(n),
        "cpu_s": compute + other, "cpu_wait_s": np.zeros(n),
    })


def collective_table(*, n: int, seq0: int, step0: int, per_step: int, t0: float, rng: np.random.Generator,
                     ops_dims=DEFAULT_OPS_DIMS, group_size: int = 8) -> pa.Table:
    which = np.arange(seq0, seq0 + n) % len(ops_dims)
    ops = np.array([op for op, _ in ops_dims])[which]
    dims = np.array([dim for _, dim in ops_dims])[which]
    seq = np.arange(seq0, seq0 + n)
    nbytes = rng.integers(1 << 20, 1 << 28, n)
    duration = rng.uniform(1e-4, 5e-3, n)
    # Collectives spread over the first 80 % of their step (steps are 1 s apart, see step_table).
    t_start = t0 + step0 + seq // per_step + (seq % per_step) * (0.8 / per_step)
    algbw = nbytes / duration
    peer = np.where(np.isin(ops, ["send", "recv"]), 1, -1)
    return _table("collective", {
        "step": step0 + seq // per_step, "op": ops.tolist(), "dim": dims.tolist(),
        "group": [f"{d}0" for d in dims.tolist()], "group_size": np.full(n, group_size), "seq": seq,
        "bytes": nbytes, "t_start": t_start, "t_end": t_start + duration, "duration_s": duration,
        "wait_s": duration * 0.3, "algbw": algbw, "busbw": algbw * 2 * (group_size - 1) / group_size,
        "peer": peer, "source": ["c10d"] * n, "mesh_dim": dims.tolist(),
    })


def memory_table(*, steps: np.ndarray, t0: float) -> pa.Table:
    n = len(steps)
    return _table("memory", {
        "step": steps, "t": t0 + steps.astype(float), "rss_bytes": np.full(n, 2 << 30),
        "rss_peak_bytes": np.full(n, 3 << 30), "allocated_bytes": np.full(n, -1),
        "allocated_peak_bytes": np.full(n, -1), "reserved_bytes": np.full(n, -1),
        "reserved_peak_bytes": np.full(n, -1), "active_bytes": np.full(n, -1), "active_peak_bytes": np.full(n, -1),
        "alloc_retries": np.zeros(n), "ooms": np.zeros(n), "device_free_bytes": np.full(n, -1),
        "device_total_bytes": np.full(n, -1), "param_bytes": np.full(n, -1), "grad_bytes": np.full(n, -1),
        "optimizer_bytes": np.full(n, -1),
    })


def write_run(store: str | Path, *, run: str, world_size: int, steps: int, collectives_per_step: int = 40,
              frame_rows: int = 4000, attempt: int = 0, t0: float = 1.7e9, seed: int = 0,
              ops_dims=DEFAULT_OPS_DIMS, slow_rank: int | None = None, ranks: range | None = None,
              ) -> dict[str, int]:
    """Write one spool per rank: a run record, then per frame ``frame_rows`` collectives and the step and
    memory records of the steps they cover. Returns record counts per kind (all ranks)."""
    counts = {"run": 0, "step": 0, "collective": 0, "memory": 0}
    for rank in (ranks if ranks is not None else range(world_size)):
        rng = np.random.default_rng(seed * 100_003 + rank)
        path = spool_path(store, run=run, rank=rank, attempt=attempt)
        path.parent.mkdir(parents=True, exist_ok=True)
        slow = 1.5 if rank == slow_rank else 1.0
        with open(path, "wb") as fh:
            fh.write(encode_file_header(run=run, rank=rank, attempt=attempt, host="node0",
                                        stream_id=secrets.token_hex(8), created=t0))
            fh.write(encode_data_frame("run", run_table(rank=rank, world_size=world_size, attempt=attempt, t0=t0)))
            counts["run"] += 1
            total = steps * collectives_per_step
            for seq0 in range(0, total, frame_rows):
                n = min(frame_rows, total - seq0)
                fh.write(encode_data_frame("collective", collective_table(
                    n=n, seq0=seq0, step0=0, per_step=collectives_per_step, t0=t0, rng=rng, ops_dims=ops_dims)))
                covered = np.arange(seq0 // collectives_per_step, (seq0 + n) // collectives_per_step)
                if covered.size:
                    fh.write(encode_data_frame("step", step_table(steps=covered, t0=t0, rank=rank, rng=rng,
                                                                  slow=slow)))
                    fh.write(encode_data_frame("memory", memory_table(steps=covered, t0=t0)))
                counts["collective"] += n
                counts["step"] += covered.size
                counts["memory"] += covered.size
    return counts


ALL_OPS_DIMS = tuple((op, dim) for op in OPS for dim in DIMS)  # the cardinality worst case
