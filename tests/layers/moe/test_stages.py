"""The MoE block's four stages: TopK -> Dispatcher -> Runner -> Combine."""
import dataclasses

import pytest
import torch

from moelora.core import LoRABatch, TopKConfig, TopKOutput
from moelora.kernels.fused_moe import fused_moe_reference
from moelora.layers.mlp import MLP
from moelora.layers.moe.combine import Combine
from moelora.layers.moe.dispatcher import Dispatcher
from moelora.layers.moe.layer import MoE
from moelora.layers.moe.runner import Runner
from moelora.kernels.topk import select_experts_reference
from tests.support import (assert_rows_close, expert_share, random_expert_lora, random_moe_weights, random_topk,
                           rank_runner, rel_tolerance)

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 48, 32, 8, 3, 11


def test_dispatcher_keeps_local_experts_and_drops_the_others():
    topk = random_topk(TOKENS, EXPERTS, TOP_K, generator=torch.Generator().manual_seed(torch.seed()))
    assert Dispatcher(EXPERTS)(topk) is topk  # one GPU: the identity, not even a copy
    got = Dispatcher(EXPERTS, first_local=3, num_local=2)(topk)
    ids = topk.ids.long()
    want = torch.where((ids >= 3) & (ids < 5), ids - 3, -1)
    assert got.ids.dtype == torch.int32 and torch.equal(got.ids.long(), want)
    assert got.weights is topk.weights
    with pytest.raises(ValueError, match=r"local experts \[6, 9\) are not within the 8 experts"):
        Dispatcher(EXPERTS, first_local=6, num_local=3)


def test_runners_on_disjoint_expert_ranges_sum_to_the_whole():
    """The expert-parallel seam: every rank runs its experts on all tokens (others dispatched to -1), and the
    sum over ranks (Combine's reduction) is the single-GPU result, with and without LoRA."""
    gen = torch.Generator().manual_seed(torch.seed())
    dtype = torch.float32
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    w13, w2 = random_moe_weights(EXPERTS, HIDDEN, INTER, dtype, generator=gen)
    topk = random_topk(TOKENS, EXPERTS, TOP_K, generator=gen)
    lora = random_expert_lora(2, EXPERTS, HIDDEN, INTER, [4, 8], dtype, generator=gen)
    slots = torch.randint(-1, 2, (TOKENS,), generator=gen, dtype=torch.int32)
    batch = LoRABatch(token_slots=slots)
    whole = Runner(HIDDEN, INTER, EXPERTS, layer_id=0, backend="torch")
    whole.w13.data, whole.w2.data, whole.lora = w13, w2, lora
    for with_lora in (False, True):
        want = whole(x, topk, batch if with_lora else None)
        parts = torch.zeros_like(want)
        for first, num in ((0, 3), (3, 4), (7, 1)):
            rank = Runner(HIDDEN, INTER, EXPERTS, layer_id=0, backend="torch", experts=slice(first, first + num))
            rank.w13.data, rank.w2.data = w13[first:first + num], w2[first:first + num]
            rank.lora = expert_share(lora, slice(first, first + num))
            parts += rank(x, Dispatcher(EXPERTS, first, num)(topk), batch if with_lora else None)
        assert_rows_close(parts, want, rel_tolerance(dtype))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_other_ranks_experts_and_unused_slots_are_never_read(backend, device):
    """Each rank's expert weights are a view into storage of all experts where the others are NaN, so a kernel
    that took the -1 of another rank's expert for an index would read the NaN expert before the view (the
    illegal read of SGLang's EP + LoRA bug). Its LoRA slot buffers hold its experts alone (as the engine's do),
    so they lie between NaN as large as a slot of all experts (what expert -1 of slot 0, slot -1 or a global
    expert id would read); slot 1, which no token uses, is NaN with its full rank claimed, and so are the rows
    past each expert's rank in slot 0 and the experts it leaves uncovered. Experts 6 and 7 get no token: the
    rank holding them returns zeros. The ranks' sum is the whole. (On a GPU machine the Triton backend runs on
    the GPU, elsewhere in the interpreter.)"""
    gen = torch.Generator().manual_seed(torch.seed())
    dtype = torch.float16 if device == "cuda" else torch.float32  # (fp32 tl.dot is tf32 on a GPU)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(device, dtype)
    w13, w2 = (w.to(device) for w in random_moe_weights(EXPERTS, HIDDEN, INTER, dtype, generator=gen))
    topk = TopKOutput(*(t.to(device) for t in random_topk(TOKENS, EXPERTS - 2, TOP_K, generator=gen)))
    lora = random_expert_lora(2, EXPERTS, HIDDEN, INTER, [4, 8], dtype, coverage=0.75, poison_unused=True,
                              generator=gen)
    lora = dataclasses.replace(lora, **{n: t.to(device) for n, t in vars(lora).items() if isinstance(t, torch.Tensor)})
    for name in ("a_gate", "b_gate", "a_up", "b_up", "a_down", "b_down"):
        getattr(lora, name)[1] = float("nan")
    batch = LoRABatch(torch.randint(-1, 1, (TOKENS,), generator=gen, dtype=torch.int32).to(device))
    whole = Runner(HIDDEN, INTER, EXPERTS, layer_id=0, backend="torch")
    whole.w13.data, whole.w2.data, whole.lora = w13, w2, lora
    want = whole(x, topk, batch)
    parts = torch.zeros_like(want)
    for first, num in ((0, 3), (3, 3), (6, 2)):
        rank = rank_runner(w13, w2, lora, slice(first, first + num), backend=backend)
        out = rank(x, Dispatcher(EXPERTS, first, num)(topk), batch)
        if first == 6:
            assert torch.equal(out, torch.zeros_like(out)), "a rank whose experts got no token"
        parts += out
    assert_rows_close(parts, want, rel_tolerance(dtype, device))


def test_moe_block_is_its_stages():
    """MoE.forward = Combine(Runner(Dispatcher(TopK(x)))) against the references composed by hand, with a
    gated shared expert (Qwen2-MoE) and a correction bias (DeepSeek-V3)."""
    torch.manual_seed(torch.seed())
    config = TopKConfig(top_k=TOP_K, renormalize=True, scoring="sigmoid")
    shared = MLP(HIDDEN, INTER, "mlp.shared_expert", 0, reduce_output=False)
    moe = MoE(HIDDEN, INTER, EXPERTS, config, 0, shared_experts=shared, shared_expert_gate=True,
              correction_bias=True, backend="torch")
    for p in moe.parameters():
        p.data.normal_(0, HIDDEN**-0.5)
    x = torch.randn(TOKENS, HIDDEN)
    topk = select_experts_reference(x @ moe.gate.weight.T, config, moe.gate.e_score_correction_bias)
    routed = fused_moe_reference(x, moe.experts.w13, moe.experts.w2, topk)
    gate = torch.sigmoid(x @ moe.combine.shared_expert_gate.weight.T)
    want = routed + gate * shared(x, None)
    assert_rows_close(moe(x, None), want, rel_tolerance(torch.float32))
    assert {n for n, _ in moe.named_parameters()} >= {"gate.weight", "gate.e_score_correction_bias",
                                                       "experts.w13", "experts.w2"}


@pytest.mark.parametrize("num_local", [EXPERTS, 2])
def test_experts_alone_run_each_row_on_k_of_them(num_local, monkeypatch):
    """MoE.run_experts_alone (the warm-up's run of a rank's experts): every row goes to min(k, the rank's experts)
    distinct experts of the rank, the rest -1, weights summing to one, with the slot asked for (-1: no LoRABatch)."""
    moe = MoE(HIDDEN, INTER, EXPERTS, TopKConfig(top_k=TOP_K), 0, backend="torch")
    moe.experts = Runner(HIDDEN, INTER, EXPERTS, 0, backend="torch", experts=slice(0, num_local))
    seen = []
    monkeypatch.setattr(Runner, "forward", lambda self, x, topk, lora: seen.append((x, topk, lora)) or x)
    for slot in (-1, 3):
        moe.run_experts_alone(TOKENS, slot)
        x, (weights, ids), lora = seen.pop()
        assert x.shape == (TOKENS, HIDDEN) and not x.any() and ids.shape == (TOKENS, TOP_K)
        for row in ids.tolist():
            local = [e for e in row if e >= 0]
            assert len(set(local)) == len(local) == min(TOP_K, num_local) and max(local) < num_local
            assert row.count(-1) == TOP_K - len(local)
        assert set(ids[:, 0].tolist()) == set(range(num_local))  # every expert runs rows
        assert torch.allclose(weights.sum(1), torch.ones(TOKENS))
        assert (lora is None) if slot < 0 else lora.token_slots.tolist() == [slot] * TOKENS


def test_stage_arguments_are_checked():
    with pytest.raises(ValueError, match="MoE backend must be one of"):
        Runner(HIDDEN, INTER, EXPERTS, 0, backend="cuda")
    with pytest.raises(ValueError, match="a shared_expert_gate needs shared_experts"):
        Combine(HIDDEN, 0, None, shared_expert_gate=True)
    with pytest.raises(ValueError, match="shared experts must leave their partial sums to Combine"):
        Combine(HIDDEN, 0, MLP(HIDDEN, INTER, "mlp.shared_expert", 0))
    assert isinstance(Dispatcher(EXPERTS)(TopKOutput(torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32))),
                      TopKOutput)
