"""The plain-torch fused MoE: the reference the kernels are tested against, and the CPU backend."""
from __future__ import annotations

import torch

from moelora.core import ExpertLoRASlots, TopKOutput


def _lora_delta_reference(inp: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """(inp A^T) B^T in fp32 for A [r, in] and B^T [r, out], rounding the shrink to the weights'
    dtype as the kernel does."""
    return (inp @ a.float().T).to(a.dtype).float() @ b_t.float()


def fused_moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk: TopKOutput,
    lora: ExpertLoRASlots | None = None,
    token_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch: loop over the experts (and slots) present; fp32 math, dtype at the same points
    as the kernels (h, the shrink result, and each weighted expert output)."""
    num_tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    top_k = topk.ids.shape[1]
    experts = topk.ids.flatten().long()
    weights = topk.weights.flatten().float()
    tokens = torch.arange(num_tokens, device=x.device).repeat_interleave(top_k)
    valid = (experts >= 0) & (experts < num_experts)
    slots = None
    if lora is not None:
        slots = token_slots.long()[tokens]
        slots = torch.where((slots >= 0) & (slots < lora.num_slots), slots, -1)

    pair_out = torch.zeros(num_tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    for e in experts[valid].unique().tolist():
        pairs = torch.nonzero(valid & (experts == e)).flatten()
        xe = x[tokens[pairs]].float()
        gate = xe @ w13[e, :inter].float().T
        up = xe @ w13[e, inter:].float().T
        lora_rows = []
        if lora is not None:
            for s in slots[pairs].unique().tolist():
                if s >= 0:
                    lora_rows.append((s, torch.nonzero(slots[pairs] == s).flatten()))
        for s, rows in lora_rows:
            rg, ru = int(lora.ranks[0, s, e]), int(lora.ranks[1, s, e])
            gate[rows] += _lora_delta_reference(xe[rows], lora.a_gate[s, e, :rg], lora.b_gate[s, e, :rg])
            up[rows] += _lora_delta_reference(xe[rows], lora.a_up[s, e, :ru], lora.b_up[s, e, :ru])
        h = (torch.nn.functional.silu(gate) * up).to(x.dtype).float()
        out = h @ w2[e].float().T
        for s, rows in lora_rows:
            rd = int(lora.ranks[2, s, e])
            out[rows] += _lora_delta_reference(h[rows], lora.a_down[s, e, :rd], lora.b_down[s, e, :rd])
        pair_out[pairs] = (out * weights[pairs, None]).to(x.dtype).float()
    return pair_out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
