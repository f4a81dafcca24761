"""Model, data and FLOPs: shapes, parameter counts, determinism, and the analytic FLOPs formula against
torch's FlopCounterMode (the independent truth) on a meta-device copy."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from meshscope.agent.instrument.flops import sdpa_flop_mapping
from meshscope.trainer import data
from meshscope.trainer.model import FLAVORS, GPT, count_params, flops_per_token, loss_fn


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_analytic_param_count_matches_module(flavor):
    f = FLAVORS[flavor]
    with torch.device("meta"):
        m = GPT(f, seq_len=8)
    total, non_emb = count_params(f)
    assert total == sum(p.numel() for p in m.parameters())
    assert non_emb == total - m.tok_emb.weight.numel()


def test_flavor_sizes():
    assert 115e6 < count_params(FLAVORS["small"])[0] < 135e6  # ~125M
    assert 0.95e9 < count_params(FLAVORS["1b"])[0] < 1.15e9


@pytest.mark.parametrize(("flavor", "seq"), [("tiny", 64), ("small", 1024), ("1b", 2048)])
def test_flops_formula_within_2_percent_of_flop_counter(flavor, seq):
    f = FLAVORS[flavor]
    batch = 2
    with torch.device("meta"):
        m = GPT(f, seq_len=seq)
        x = torch.zeros(batch, seq, dtype=torch.long)
    counter = FlopCounterMode(display=False, custom_mapping=sdpa_flop_mapping())
    with counter:
        loss = loss_fn(m(x), x)
        loss.backward()
    measured = counter.get_total_flops() / (batch * seq)
    analytic = flops_per_token(f, seq_len=seq)
    assert measured > 0
    assert abs(analytic - measured) / measured < 0.02, (analytic, measured)


def test_data_is_deterministic_and_dp_slices_tile_the_global_batch():
    kw = dict(grad_accum=1, global_batch=8, source="synthetic", seed=3, seq_len=16, vocab=256,
              device=torch.device("cpu"))
    full_x, full_y = data.batch(5, micro_step=0, dp_rank=0, dp=1, **kw)
    parts = [data.batch(5, micro_step=0, dp_rank=r, dp=4, **kw)[0] for r in range(4)]
    assert torch.equal(torch.cat(parts), full_x)
    again, _ = data.batch(5, micro_step=0, dp_rank=0, dp=1, **kw)
    assert torch.equal(again, full_x)
    assert torch.equal(full_x[:, 1:], full_y[:, :-1])  # targets are inputs shifted by one
    kw2 = dict(kw, grad_accum=2)
    halves = [data.batch(5, micro_step=m, dp_rank=0, dp=1, **kw2)[0] for m in range(2)]
    assert torch.equal(torch.cat(halves), full_x)
    other, _ = data.batch(6, micro_step=0, dp_rank=0, dp=1, **kw)
    assert not torch.equal(other, full_x)


def test_corpus_source_is_real_text():
    toks = data.corpus_tokens()
    assert len(toks) > 100_000 and int(toks.max()) < 256
    text = bytes(toks[:2000].tolist()).decode("utf-8", errors="replace")
    assert "Python" in text
    x, _ = data.batch(0, micro_step=0, grad_accum=1, global_batch=2, dp_rank=0, dp=1, source="corpus", seed=0,
                      seq_len=32, vocab=256, device=torch.device("cpu"))
    assert x.shape == (2, 32)


def test_compiled_blocks_train_as_eager_blocks_do_with_one_graph_for_all():
    """`--compile` (each block's body through torch.compile): the same loss and gradients as eager on the
    same weights and batch, and one compiled graph serves every block (parameters are graph inputs), so
    compiling costs one block's worth whatever the depth."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    f = FLAVORS["tiny"]
    torch.manual_seed(0)
    eager = GPT(f, seq_len=32)
    compiled = GPT(f, seq_len=32)
    compiled.load_state_dict(eager.state_dict())
    for block in compiled.layers.values():
        block.compile_body()
    tokens = torch.randint(0, f.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (eager, compiled):
        loss = loss_fn(model(tokens), tokens)
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert f.n_layers > 1 and counters["stats"]["unique_graphs"] == 1
