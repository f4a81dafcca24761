"""The reference model's flavors and the rules of a parallel layout, without torch: the trainer's config
checks a layout with these functions and the planner (``dashboard/planner/predict.py``) checks the layouts it
predicts with the same ones, so a layout the planner offers is one the trainer runs, and a bad one gets
the trainer's message. They live in the contract so that neither side imports the other. Every check raises ``ValueError`` naming the bad value (the trainer's
``ConfigError`` is one)."""

from __future__ import annotations

from dataclasses import dataclass

from meshscope.agent.contract.formulas import training_flops_per_token

SCHEDULES = ("gpipe", "1f1b", "interleaved", "interleaved-zb", "looped-bfs")
MULTI_STAGE = ("interleaved", "interleaved-zb", "looped-bfs")  # several stages per rank (virtual_stages)
# Schedules that need at least pp microbatches (a 1F1B steady state).
NEEDS_P_MICROBATCHES = ("1f1b", "interleaved", "interleaved-zb")


class LayoutError(ValueError):
    """A layout the trainer cannot run; the message names the bad value."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise LayoutError(msg)


@dataclass(frozen=True, kw_only=True)
class Flavor:
    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    max_seq_len: int
    mlp_ratio: int = 4


FLAVORS: dict[str, Flavor] = {
    # CPU tests: a step well under a second on 2 gloo ranks. vocab 256 = byte-level.
    "tiny": Flavor(n_layers=4, d_model=64, n_heads=4, vocab_size=256, max_seq_len=64),
    # Wide enough that the blocks dominate (embedding and head are a few % of a stage): balanced pipeline
    # stages for bubble measurements on CPU.
    "tiny-wide": Flavor(n_layers=4, d_model=512, n_heads=8, vocab_size=256, max_seq_len=64),
    # ~123M parameters (GPT-2 small's shape, untied head, 24k vocabulary).
    "small": Flavor(n_layers=12, d_model=768, n_heads=12, vocab_size=24576, max_seq_len=1024),
    # ~1.04B parameters (GPU).
    "1b": Flavor(n_layers=18, d_model=2048, n_heads=16, vocab_size=32000, max_seq_len=2048),
}



def count_params(flavor: Flavor) -> tuple[int, int]:
    """(total, non-embedding) parameter counts of the full model, analytically (no allocation).
    Non-embedding excludes only the token embedding: the untied output head does real matmul FLOPs."""
    d, f, v = flavor.d_model, flavor.mlp_ratio * flavor.d_model, flavor.vocab_size
    per_layer = 4 * d * d + 2 * d * f + 2 * d
    non_emb = flavor.n_layers * per_layer + d + v * d
    return non_emb + v * d, non_emb


def flops_per_token(flavor: Flavor, *, seq_len: int) -> float:
    """Training FLOPs per token: 6·N_nonembedding + 12·L·D·S.

    6·N covers forward (2 FLOPs per multiply-add) and backward (twice the forward) of every matmul with a
    parameter; 12·L·D·S is attention's scores (QKᵀ) and values (AV) matmuls, forward and backward, with the
    causal mask NOT discounted (torchtitan's convention; Megatron halves it)."""
    _, non_emb = count_params(flavor)
    return training_flops_per_token(n_matmul_params=non_emb, n_attention_layers=flavor.n_layers,
                                    attention_dim=flavor.d_model, seq_len=seq_len)


def check_degrees(*, dp: int, tp: int, pp: int, microbatches: int, virtual_stages: int, schedule: str,
                  sequence_parallel: bool = False) -> None:
    """The degrees alone (no world size, no model)."""
    for name, v in (("tp", tp), ("pp", pp), ("virtual_stages", virtual_stages)):
        _check(isinstance(v, int) and v >= 1, f"{name}={v} must be a positive integer")
    _check(isinstance(dp, int) and dp >= 0, f"dp={dp} must be a positive integer (0 = auto)")
    _check(microbatches >= 0, f"microbatches={microbatches} must be >= 1 (0 = pp)")
    _check(schedule in SCHEDULES, f"unknown schedule {schedule!r} (choose from {', '.join(SCHEDULES)})")
    _check(not sequence_parallel or tp > 1, "sequence_parallel needs tp > 1")


def check_model_fit(*, tp: int, n_stages: int, n_heads: int, n_layers: int) -> None:
    """tp divides the heads, the pipeline's stages (pp × virtual stages) divide the layers."""
    _check(n_heads % tp == 0, f"tp={tp} does not divide n_heads={n_heads}")
    _check(n_layers % n_stages == 0, f"pp*virtual_stages = {n_stages} stages do not divide n_layers={n_layers}")


def resolve_dp(*, world_size: int, dp: int, tp: int, pp: int) -> int:
    """dp (0: whatever is left, world // (tp·pp)), checked to multiply with tp and pp to the world size."""
    dp = dp or world_size // (tp * pp)
    _check(dp >= 1, f"tp*pp = {tp * pp} exceeds the world size {world_size}")
    _check(dp * tp * pp == world_size, f"dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp} but the world size is {world_size}")
    return dp


def check_batch(*, dp: int, tp: int, pp: int, fsdp: bool, batch_size: int, grad_accum: int, microbatches: int,
                schedule: str) -> None:
    """What the resolved degrees ask of the batch (and of the data-parallel flavour)."""
    if dp > 1 and (tp > 1 or pp > 1):
        _check(fsdp, f"dp={dp} with tp={tp} and pp={pp} needs --fsdp: DDP over a tensor- or "
                     "pipeline-parallel model is not supported in this torch; FSDP2 shards the dp dimension")
    _check(batch_size % dp == 0, f"batch_size={batch_size} is not divisible by dp={dp}")
    per_replica = batch_size // dp
    _check(per_replica % grad_accum == 0, f"grad_accum={grad_accum} does not divide the per-replica batch {per_replica}")
    per_micro_step = per_replica // grad_accum
    if pp > 1:
        _check(per_micro_step % microbatches == 0,
               f"microbatches={microbatches} does not divide the per-replica batch {per_micro_step}")
        if schedule in NEEDS_P_MICROBATCHES:
            _check(microbatches >= pp, f"microbatches={microbatches} must be >= pp={pp} for the {schedule} schedule")
