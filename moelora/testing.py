"""Random MoE layers, LoRA slot buffers (experts and dense layers) and paged-attention batches for tests
and benchmarks, plus dtype-derived tolerances."""
from __future__ import annotations

from typing import NamedTuple

import torch

from moelora.kernels.fused_moe import ExpertLoRA
from moelora.kernels.lora_linear import LinearLoRASlots
from moelora.layers.moe.topk import TopKOutput


def random_moe_weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device="cpu",
                       generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H], w2 [E, H, I] scaled so activations stay O(1)."""
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=generator, device=device) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=generator, device=device) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


def random_topk(num_tokens: int, num_experts: int, top_k: int, device="cpu",
                generator: torch.Generator | None = None) -> TopKOutput:
    """Distinct experts per token, softmax-like weights."""
    scores = torch.rand(num_tokens, num_experts, generator=generator, device=device)
    ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=generator, device=device) + 0.1
    return TopKOutput((weights / weights.sum(-1, keepdim=True)).contiguous(), ids.contiguous())


def random_expert_lora(
    num_slots: int, num_experts: int, hidden: int, inter: int, slot_ranks: list[int], dtype: torch.dtype,
    device="cpu", coverage: float = 1.0, poison_unused: bool = False, generator: torch.Generator | None = None,
    max_rank: int | None = None,
) -> ExpertLoRA:
    """Slot buffers of rank max_rank (default max(slot_ranks)); slot s has rank slot_ranks[s] (0: empty).

    coverage < 1 leaves a random subset of experts uncovered (rank 0) per slot and projection.
    poison_unused fills everything a correct kernel must not read (rows past the rank, uncovered
    experts) with NaN, so any stray read shows up in the output.
    """
    max_rank = max_rank or max(max(slot_ranks), 1)
    ranks = torch.tensor(slot_ranks, dtype=torch.int32).view(1, num_slots, 1).repeat(3, 1, num_experts)
    if coverage < 1.0:
        covered = torch.rand(3, num_slots, num_experts, generator=generator, device=device).cpu() < coverage
        ranks = ranks * covered
    shapes = {"gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}
    tensors = {}
    for p, (name, (d_in, d_out)) in enumerate(shapes.items()):
        # A ~ 1/sqrt(in), B ~ 1/sqrt(rank): the delta is comparable to the base projection.
        a = torch.randn(num_slots, num_experts, max_rank, d_in, generator=generator, device=device) / d_in**0.5
        b = torch.randn(num_slots, num_experts, d_out, max_rank, generator=generator, device=device) / max_rank**0.5
        if poison_unused:
            r = torch.arange(max_rank, device=device)
            unused = r.view(1, 1, -1) >= ranks[p].to(device).unsqueeze(-1)  # [S, E, R]
            a = a.masked_fill(unused.unsqueeze(-1), float("nan"))
            b = b.masked_fill(unused.unsqueeze(-2), float("nan"))
        tensors[f"a_{name}"], tensors[f"b_{name}"] = a.to(dtype), b.to(dtype)
    return ExpertLoRA(**tensors, ranks=ranks.to(device), max_rank_in_use=max(slot_ranks))


def random_linear_lora(in_features: int, out_sizes: tuple[int, ...], slot_ranks: list[list[int]], dtype: torch.dtype,
                       device="cpu", poison_unused: bool = False, max_rank: int | None = None,
                       generator: torch.Generator | None = None) -> LinearLoRASlots:
    """Slot buffers of a dense layer with parts `out_sizes`; slot s adapts part p with rank slot_ranks[s][p]
    (0: not adapted). poison_unused fills what a correct kernel must not read (past each rank, parts of
    rank 0) with NaN; otherwise it is zero, as the slot buffers hold it."""
    ranks = torch.tensor(slot_ranks, dtype=torch.int32)
    max_rank = max_rank or max(int(ranks.max()), 1)
    num_slots, n_out = len(slot_ranks), sum(out_sizes)
    a = torch.randn(num_slots, len(out_sizes), max_rank, in_features, generator=generator) / in_features**0.5
    b = torch.randn(num_slots, n_out, max_rank, generator=generator) / max_rank**0.5
    part = torch.repeat_interleave(torch.arange(len(out_sizes)), torch.tensor(out_sizes))  # part of each out row
    unused_a = torch.arange(max_rank).view(1, 1, -1) >= ranks.unsqueeze(-1)  # [S, P, R]
    unused_b = torch.arange(max_rank).view(1, 1, -1) >= ranks[:, part].unsqueeze(-1)  # [S, out, R]
    fill = float("nan") if poison_unused else 0.0
    a, b = a.masked_fill(unused_a.unsqueeze(-1), fill), b.masked_fill(unused_b, fill)
    return LinearLoRASlots(a.to(device, dtype), b.to(device, dtype), ranks.to(device), int(ranks.max()))


def rel_tolerance(dtype: torch.dtype, device: torch.device | str = "cpu") -> float:
    """Relative error allowed for a few roundings in `dtype` (fp32 tl.dot runs as tf32 on GPUs)."""
    if dtype == torch.float32:
        return 1e-5 if torch.device(device).type == "cpu" else 2 * 2.0**-10
    return 2 * torch.finfo(dtype).eps


def assert_rows_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "output") -> None:
    """Every row within tol relative error of the reference (rows whose reference is 0 must be 0)."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), f"{what}: non-finite values in rows {torch.nonzero(~torch.isfinite(out).all(-1)).flatten().tolist()}"
    err = (out - ref).norm(dim=-1)
    scale = ref.norm(dim=-1)
    bad = err > tol * scale
    assert not bad.any(), (
        f"{what}: rows {torch.nonzero(bad).flatten().tolist()[:10]} exceed relative error {tol:.2e} "
        f"(worst {(err / scale.clamp_min(1e-30)).max().item():.2e})"
    )


class PagedAttentionInputs(NamedTuple):
    """The arguments of kernels.attention.attention, in order."""
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    extend_starts: torch.Tensor
    scale: float


def random_paged_attention(prefix_lens: list[int], extend_lens: list[int], num_q_heads: int, num_kv_heads: int,
                           k_dim: int, v_dim: int, dtype: torch.dtype, device="cpu", spare_slots: int = 64,
                           generator: torch.Generator | None = None) -> PagedAttentionInputs:
    """Sequences with cached prefixes whose cache slots are scattered at random (a random permutation),
    in random rows of req_to_token. Slot 0 (where req_to_token points past each length) and the spare
    slots hold NaN, so a key read past a sequence's end shows up in the output."""
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_seqs, num_slots = len(seq_lens), sum(seq_lens) + spare_slots + 1
    k_cache = torch.randn(num_slots, num_kv_heads, k_dim, generator=generator)
    v_cache = torch.randn(num_slots, num_kv_heads, v_dim, generator=generator)
    order = torch.randperm(num_slots - 1, generator=generator) + 1
    for cache in (k_cache, v_cache):
        cache[0] = cache[order[sum(seq_lens):]] = float("nan")
    req_to_token = torch.zeros(num_seqs + 3, max(seq_lens) + 5, dtype=torch.int32)
    rows = torch.randperm(num_seqs + 3, generator=generator)[:num_seqs].to(torch.int32)
    for row, n, first in zip(rows.tolist(), seq_lens, [sum(seq_lens[:i]) for i in range(num_seqs)]):
        req_to_token[row, :n] = order[first:first + n].to(torch.int32)
    starts = [sum(extend_lens[:i]) for i in range(num_seqs)]
    q = torch.randn(sum(extend_lens), num_q_heads, k_dim, generator=generator)
    ints = [torch.tensor(v, dtype=torch.int32, device=device) for v in (seq_lens, extend_lens, starts)]
    return PagedAttentionInputs(q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype),
                                req_to_token.to(device), rows.to(device), *ints, k_dim**-0.5)
