"""The space of parallel layouts the planner predicts: a layout as the trainer resolves it, parsed from
``meshscope plan --layout``, checked by the trainer's own rules (``agent/contract/layout.py``), enumerated for a
world size, and read back from a measured run. No prediction here (``dashboard/planner/predict.py``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshscope.dashboard.planner.calibration import ModelShape
from meshscope.agent.contract import layout as rules

SIMULATED = rules.SCHEDULES  # every schedule the trainer runs (``dashboard.pipeline_sim``)
KEYS = ("dp", "tp", "pp", "fsdp", "schedule", "microbatches", "virtual_stages", "batch", "layers", "width")


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """A resolved, checked layout (``resolve``)."""

    dp: int
    tp: int
    pp: int
    fsdp: bool
    schedule: str  # "" without a pipeline
    microbatches: int  # 1 without a pipeline
    virtual_stages: int
    world_size: int
    global_batch: int
    n_layers: int
    d_model: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def label(self) -> str:
        parts = [f"dp{self.dp}{'-fsdp' if self.fsdp and self.dp > 1 else ''}"]
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.pp > 1:
            v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"pp{self.pp} {self.schedule} m{self.microbatches}{v}")
        return " · ".join(parts)


# ---------------------------------------------------------------------------------------------- layouts
def parse_layout(text: str) -> dict:
    """``dp=2,tp=1,pp=1,fsdp=0,schedule=1f1b,microbatches=4`` → {key: value}; a bad key or value raises
    ``rules.LayoutError`` naming it."""
    out: dict = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in KEYS:
            raise rules.LayoutError(f"--layout item {item!r} must be KEY=VALUE with KEY one of {', '.join(KEYS)}")
        if key == "schedule":
            out[key] = value
        elif key == "fsdp":
            if value.lower() not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
                raise rules.LayoutError(f"fsdp={value!r} must be 0 or 1")
            out[key] = value.lower() in ("1", "true", "yes", "on")
        else:
            try:
                out[key] = int(value)
            except ValueError:
                raise rules.LayoutError(f"{key}={value!r} must be a whole number") from None
    return out


def resolve(spec: dict, *, model: ModelShape, world_size: int, global_batch: int) -> Layout:
    """A layout from ``parse_layout``'s dict, with the trainer's defaults (dp auto, microbatches = pp,
    two virtual stages for the multi-stage schedules) and checked by the trainer's own rules."""
    tp, pp = spec.get("tp", 1), spec.get("pp", 1)
    schedule = spec.get("schedule", "1f1b")
    m, v = spec.get("microbatches", 0), spec.get("virtual_stages", 2)
    rules.check_degrees(dp=spec.get("dp", 0), tp=tp, pp=pp, microbatches=m, virtual_stages=v, schedule=schedule)
    if pp > 1 and schedule not in SIMULATED:
        raise rules.LayoutError(f"the planner cannot simulate the {schedule} schedule (choose from {', '.join(SIMULATED)})")
    m = m or pp
    v = v if pp > 1 and schedule in rules.MULTI_STAGE else 1
    layers, width = spec.get("layers", model.n_layers), spec.get("width", model.d_model)
    if layers < 1 or width < 1:
        raise rules.LayoutError(f"layers={layers} and width={width} must be positive")
    heads = model.n_heads
    if heads and width != model.d_model:  # a wider model keeps its head size
        heads = max(1, heads * width // model.d_model)
    rules.check_model_fit(tp=tp, n_stages=pp * v, n_heads=heads or tp, n_layers=layers)
    dp = rules.resolve_dp(world_size=world_size, dp=spec.get("dp", 0), tp=tp, pp=pp)
    batch = spec.get("batch", global_batch)
    if batch < 1:
        raise rules.LayoutError(f"batch={batch} must be >= 1")
    fsdp = bool(spec.get("fsdp", False))
    rules.check_batch(dp=dp, tp=tp, pp=pp, fsdp=fsdp, batch_size=batch, grad_accum=1, microbatches=m, schedule=schedule)
    return Layout(dp=dp, tp=tp, pp=pp, fsdp=fsdp and dp > 1, schedule=schedule if pp > 1 else "",
                  microbatches=m if pp > 1 else 1, virtual_stages=v, world_size=world_size, global_batch=batch,
                  n_layers=layers, d_model=width)


def candidates(*, model: ModelShape, world_size: int, global_batch: int) -> list[Layout]:
    """Every layout of ``world_size`` ranks the trainer can run with this model and batch: tp and pp over
    the divisors, DDP or FSDP for the rest, for a pipeline every schedule the trainer has (the multi-stage
    ones with 2 virtual stages) with pp, 2·pp or 4·pp microbatches."""
    out = []
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    for tp in divisors:
        for pp in (d for d in divisors if (world_size // tp) % d == 0):
            dp = world_size // (tp * pp)
            for fsdp in ((False, True) if dp > 1 and tp == 1 and pp == 1 else (dp > 1,)):
                pipes = [("", 1, 1)] if pp == 1 else [
                    (s, m * pp, 2 if s in rules.MULTI_STAGE else 1) for s in SIMULATED for m in (1, 2, 4)]
                for schedule, m, v in pipes:
                    spec = {"dp": dp, "tp": tp, "pp": pp, "fsdp": fsdp, "microbatches": m, "virtual_stages": v}
                    if schedule:
                        spec["schedule"] = schedule
                    try:
                        out.append(resolve(spec, model=model, world_size=world_size, global_batch=global_batch))
                    except rules.LayoutError:
                        continue
    return out


def measured_layout(row: dict, *, model: ModelShape) -> Layout:
    """A measured run's layout (``calibration.layout_of``) as a ``Layout``."""
    return Layout(dp=row["dp"], tp=row["tp"], pp=row["pp"], fsdp=bool(row["fsdp"]) and row["dp"] > 1,
                  schedule=row["schedule"], microbatches=row["microbatches"], virtual_stages=row["virtual_stages"],
                  world_size=row["world_size"], global_batch=row["global_batch"], n_layers=model.n_layers,
                  d_model=model.d_model)


def family(lay: Layout) -> str:
    """The layout family a comparison groups by: DDP, FSDP, TP, PP-<schedule>, or their combination."""
    parts = []
    if lay.pp > 1:
        parts.append(f"PP-{lay.schedule}")
    if lay.tp > 1:
        parts.append("TP")
    if lay.dp > 1:
        parts.append("FSDP" if lay.fsdp else "DDP")
    return "+".join(parts) or "single"
