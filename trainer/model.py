"""A decoder-only transformer (pre-norm, causal SDPA attention with rotary positions, GELU MLP).

No parallelism in this file: ``trainer.parallel`` applies it. Layers live in a ``ModuleDict`` keyed by
their global index so that a pipeline stage that keeps only some of them still has the same parameter
names (checkpoints of any layout load into any other), and the embedding / final norm / head may be
``None`` on stages that do not own them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# The flavors and their analytic counts live in a torch-free module (the planner reads them too); re-exported.
from meshscope.agent.contract.layout import FLAVORS, Flavor, count_params, flops_per_token  # noqa: F401


def rotary_tables(seq_len: int, head_dim: int, *, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, S, Dh). Rotates channel pairs (even, odd) by position-dependent angles."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = d_model // n_heads
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism q/k/v are column-sharded and this rank holds n_heads / tp.
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    # Set by the trainer: recompute this block's activations in backward instead of keeping them.
    activation_checkpoint: bool = False

    def __init__(self, flavor: Flavor) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(flavor.d_model, eps=1e-6)
        self.attn = Attention(flavor.d_model, flavor.n_heads)
        self.mlp_norm = nn.RMSNorm(flavor.d_model, eps=1e-6)
        self.mlp = MLP(flavor.d_model, flavor.mlp_ratio * flavor.d_model)

    def compile_body(self) -> None:
        """torch.compile this block's body, not its ``__call__``: hooks that instrumentation or faults put
        on the block stay eager, and activation checkpointing wraps the compiled body. Blocks share one
        compiled graph (their parameters are graph inputs), so compiling costs one block's worth."""
        self._forward = torch.compile(self._forward)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpoint and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Out-of-place residual adds: FSDP2 warns about in-place updates of views it hands out.
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, flavor: Flavor, *, seq_len: int) -> None:
        super().__init__()
        self.flavor = flavor
        self.seq_len = seq_len
        self.tok_emb: nn.Embedding | None = nn.Embedding(flavor.vocab_size, flavor.d_model)
        self.layers = nn.ModuleDict({str(i): Block(flavor) for i in range(flavor.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(flavor.d_model, eps=1e-6)
        self.head: nn.Linear | None = nn.Linear(flavor.d_model, flavor.vocab_size, bias=False)
        cos, sin = rotary_tables(seq_len, flavor.d_model // flavor.n_heads)
        # Not persistent: derived from the shape, so checkpoints hold only learned state.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 style init; residual projections scaled by 1/sqrt(2·L)."""
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)  # RMSNorm weights
            elif name.endswith(("attn.wo.weight", "mlp.down.weight")):
                nn.init.normal_(p, mean=0.0, std=std / (2 * self.flavor.n_layers) ** 0.5)
            else:
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, S) int64 on the first stage, hidden states (B, S, D) on later stages; returns logits
        (B, S, V) on the last stage, hidden states otherwise."""
        h = self.tok_emb(tokens) if self.tok_emb is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.head is not None:
            h = self.head(h)
        return h


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))
