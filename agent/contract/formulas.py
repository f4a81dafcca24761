"""Formulas every side computes the same way: training FLOPs per token, MFU, the strategy vocabulary and
a pipeline schedule's bubble.

The reference trainer (from its model's shape), the zero-code driver (from a job's module census) and the
pages (from the run record) all name a layout and count model FLOPs here, so the same layout is one series
and the same model one MFU, whichever side recorded it.
"""

from __future__ import annotations

# The data-parallel flavours, one per run: DDP / composable ``replicate`` (ddp), FSDP2 ``fully_shard`` on
# one mesh dim (fsdp), FSDP2 over replicate × shard (hsdp).
DATA_PARALLEL = ("ddp", "fsdp", "hsdp")
# A strategy's parts in this order, outer mesh dim first (torchtitan's mesh order: pp, dp_replicate,
# dp_shard, cp, tp; expert parallel borrows data-parallel ranks and is named after them).
STRATEGY_PARTS = ("pp", "ddp", "hsdp", "fsdp", "cp", "ep", "tp")
SINGLE, MANUAL = "single", "manual"  # one process; several processes and none of the wrappers


def strategy_name(*, dp: str = "", tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, world_size: int = 1) -> str:
    """The one spelling of a layout: its parts joined by ``+`` in ``STRATEGY_PARTS`` order, e.g. ``fsdp``,
    ``fsdp+tp``, ``pp+hsdp+tp``; ``single`` for one process, ``manual`` for several with no parallel part."""
    if dp and dp not in DATA_PARALLEL:
        raise ValueError(f"data-parallel kind {dp!r}: not one of {', '.join(DATA_PARALLEL)}")
    present = {"pp": pp > 1, dp: bool(dp), "cp": cp > 1, "ep": ep > 1, "tp": tp > 1}
    parts = [p for p in STRATEGY_PARTS if present.get(p)]
    return "+".join(parts) or (SINGLE if world_size <= 1 else MANUAL)


def canonical_strategy(name: str) -> str:
    """Any spelling of a strategy (``tp+fsdp``, ``pp+tp+fsdp``, older stores' order) in the one order."""
    parts = [p for p in (name or "").lower().replace(" ", "").split("+") if p]
    known = [p for p in STRATEGY_PARTS if p in parts]
    if not parts or len(known) != len(parts):
        return name  # single / manual / a name this vocabulary does not know: as written
    return "+".join(known)


def training_flops_per_token(*, n_matmul_params: float, n_attention_layers: int, attention_dim: int,
                             seq_len: int) -> float:
    """Model FLOPs to train on one token: 6·N + 12·L·D·S.

    6·N covers forward (2 FLOPs per multiply-add) and backward (twice the forward) of every matmul with a
    parameter (N: the non-embedding parameters; an embedding is a lookup); 12·L·D·S is attention's scores
    (QKᵀ) and values (AV) matmuls over a sequence of S, forward and backward, in L layers of width D (heads
    × head dim), the causal mask NOT discounted (torchtitan's convention; Megatron halves it)."""
    return 6.0 * n_matmul_params + 12.0 * n_attention_layers * attention_dim * seq_len


def mfu(*, flops: float, seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the model FLOPs done / the time taken / the device's peak FLOP/s. NaN (not
    known, never 0) without a positive time or a peak to compare with (an unknown device, none given)."""
    return flops / seconds / peak_flops if seconds > 0 and peak_flops > 0 else float("nan")


# A pipeline schedule's names and closed-form bubble: the pages, the planner, the test store and the docs.
_GPIPE_LIKE = {"gpipe", "1f1b"}
_INTERLEAVED = {"interleaved1f1b", "loopedbfs"}


# Names the trainer, torch and users write for the same schedule (the trainer stores "interleaved").
_SCHEDULE_ALIASES = {"interleaved": "interleaved1f1b", "interleavedzb": "interleavedzerobubble"}


def normalize_schedule(name: str | None) -> str:
    """'Interleaved1F1B', 'interleaved-1f1b', 'interleaved' -> 'interleaved1f1b'."""
    s = "".join(ch for ch in (name or "").lower() if ch.isalnum())
    return _SCHEDULE_ALIASES.get(s, s)


def bubble_theory(*, schedule: str | None, p: int, m: int, v: int = 1) -> float | None:
    """Idle fraction of a stage's step (balanced stages, equal F and B cost):
    GPipe and 1F1B (p-1)/(m+p-1); interleaved 1F1B (p-1)/(v*m+p-1). None when no closed form applies
    (zero-bubble schedules, unknown names). This is the idle *fraction of the step*, not (p-1)/m (bubble
    relative to ideal compute)."""
    s = normalize_schedule(schedule)
    if p < 1 or m < 1:
        return None
    if s in _GPIPE_LIKE:
        return (p - 1) / (m + p - 1)
    if s in _INTERLEAVED:
        return (p - 1) / (max(v, 1) * m + p - 1)
    return None
