"""Deterministic, rank-aware batches.

A global sample index fully determines a sample (its own seeded generator), so every layout sees the same
data: optimizer step ``s`` consumes global samples ``[s·B, (s+1)·B)``; data-parallel replica ``d`` takes the
contiguous slice ``d·B/dp ..``; tensor- and pipeline-parallel ranks of one replica get the same batch. A
1-process run and any parallel run therefore see exactly the same tokens, which is what loss parity
needs, and resuming at step k needs no loader state.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

import torch

CORPUS_FILE = "corpus.txt"


@lru_cache(maxsize=1)
def corpus_tokens() -> torch.Tensor:
    """The shipped text corpus, tokenized byte-level (vocabulary 256)."""
    data = resources.files("trainer").joinpath("data", CORPUS_FILE).read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def _synthetic_sample(index: int, *, seed: int, seq_len: int, vocab: int) -> torch.Tensor:
    """A learnable synthetic sequence: an arithmetic progression modulo the vocabulary (random start and
    stride) with 10 % of positions replaced by noise. Predictable from context, so the loss falls."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    start = int(torch.randint(vocab, (1,), generator=g))
    stride = int(torch.randint(1, 8, (1,), generator=g))
    seq = (start + stride * torch.arange(seq_len + 1)) % vocab
    noise = torch.rand(seq_len + 1, generator=g) < 0.1
    return torch.where(noise, torch.randint(vocab, (seq_len + 1,), generator=g), seq)


def _corpus_sample(index: int, *, seed: int, seq_len: int) -> torch.Tensor:
    tokens = corpus_tokens()
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    start = int(torch.randint(len(tokens) - seq_len - 1, (1,), generator=g))
    return tokens[start : start + seq_len + 1]


def sample(index: int, *, source: str, seed: int, seq_len: int, vocab: int) -> torch.Tensor:
    if source == "corpus":
        return _corpus_sample(index, seed=seed, seq_len=seq_len)
    return _synthetic_sample(index, seed=seed, seq_len=seq_len, vocab=vocab)


def batch(
    step: int, *, micro_step: int, grad_accum: int, global_batch: int, dp_rank: int, dp: int, source: str,
    seed: int, seq_len: int, vocab: int, device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of shape (global_batch / dp / grad_accum, seq_len) for one replica's micro-step."""
    per_replica = global_batch // dp
    per_micro = per_replica // grad_accum
    first = step * global_batch + dp_rank * per_replica + micro_step * per_micro
    rows = torch.stack(
        [sample(first + i, source=source, seed=seed, seq_len=seq_len, vocab=vocab) for i in range(per_micro)]
    )
    rows = rows.to(device, non_blocking=True)
    return rows[:, :-1], rows[:, 1:]
