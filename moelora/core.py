"""The types every layer of moelora shares: what one model step sees (ForwardBatch, LoRABatch, the
KV cache's buffers), the routing output, and the LoRA slot buffers of linear and MoE layers.

This is the bottom of the package: it imports nothing of moelora, so kernels, layers, models and
the engine all use these types without importing each other upwards.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, NamedTuple

import torch

# ------------------------------------------------------------------------------------- routing


class TopKOutput(NamedTuple):
    weights: torch.Tensor  # [T, k] float32, routing weight of each chosen expert
    ids: torch.Tensor  # [T, k] int32, chosen expert ids


@dataclass(frozen=True)
class TopKConfig:
    """How a family turns router logits into (weights, expert ids).

    scoring: "softmax" (Mixtral, Qwen, OLMoE, DeepSeek-V2) or "sigmoid" (DeepSeek-V3,
        whose e_score_correction_bias shifts only the choice, not the weights).
    renormalize: make the k chosen weights sum to one (norm_topk_prob).
    num_expert_group / topk_group: DeepSeek's grouped routing; experts are chosen only from the
        topk_group best of num_expert_group groups. A group scores as its best expert, or as the
        sum of its two best when a correction bias is used (DeepSeek-V3 "noaux_tc").
    routed_scaling_factor: multiplies the final weights.
    """

    top_k: int
    renormalize: bool = True
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0


# --------------------------------------------------------------------------- LoRA slot buffers


@dataclass
class LinearLoRASlots:
    """LoRA weights of every GPU slot for one linear layer; scaling folded into B, zero beyond each rank.

    a [S, P, R, in], b [S, R, out] (B transposed, part p's columns at its output offset, so a rank-r
    part reads r dense rows), ranks [S, P] int32 (0 = part not adapted by that slot's adapter).
    """
    a: torch.Tensor
    b: torch.Tensor
    ranks: torch.Tensor
    max_rank_in_use: int | None = None  # host-side bound on `ranks` (largest loaded adapter); sizes the
    #                                     kernels' rank tile, which defaults to the buffers' R

    @property
    def num_slots(self) -> int:
        return self.a.shape[0]


@dataclass
class ExpertLoRASlots:
    """Per-expert LoRA weights of every GPU slot for one MoE layer; scaling is folded into B.

    a_gate/a_up [S, E, R, H], b_gate/b_up [S, E, R, I], a_down [S, E, R, I], b_down [S, E, R, H]
    (B stored transposed, so a rank-r slot reads r dense rows of B, not r columns of every row),
    ranks [3, S, E] int32: real rank of (gate, up, down) for each (slot, expert); 0 = not covered.
    """

    a_gate: torch.Tensor
    b_gate: torch.Tensor
    a_up: torch.Tensor
    b_up: torch.Tensor
    a_down: torch.Tensor
    b_down: torch.Tensor
    ranks: torch.Tensor
    max_rank_in_use: int | None = None  # host-side bound on `ranks` (largest loaded adapter); sizes the
    #                                     kernels' rank tile, which defaults to the buffers' max_rank

    @property
    def num_slots(self) -> int:
        return self.a_gate.shape[0]

    def validate(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> None:
        slots, max_rank = self.a_gate.shape[0], self.a_gate.shape[2]
        expected = {
            "a_gate": (slots, num_experts, max_rank, hidden), "b_gate": (slots, num_experts, max_rank, inter),
            "a_up": (slots, num_experts, max_rank, hidden), "b_up": (slots, num_experts, max_rank, inter),
            "a_down": (slots, num_experts, max_rank, inter), "b_down": (slots, num_experts, max_rank, hidden),
        }
        for name, shape in expected.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape:
                raise ValueError(f"ExpertLoRASlots.{name} has shape {tuple(t.shape)}, expected {shape}")
            if t.dtype != dtype:
                raise ValueError(f"ExpertLoRASlots.{name} has dtype {t.dtype}, expected {dtype} (the activations' dtype)")
            if not t.is_contiguous():
                raise ValueError(f"ExpertLoRASlots.{name} must be contiguous")
        if tuple(self.ranks.shape) != (3, slots, num_experts) or self.ranks.dtype != torch.int32:
            raise ValueError(
                f"ExpertLoRASlots.ranks must be int32 of shape (3, {slots}, {num_experts}), "
                f"got {self.ranks.dtype} {tuple(self.ranks.shape)}"
            )


# ---------------------------------------------------------------------------------- KV cache


class KVCache:
    """The paged KV cache: one key and one value buffer per layer, indexed by token slot (pages of one
    token), and req_to_token mapping (request row, position) to a slot. Slot 0 is never handed out:
    padded rows of a CUDA-graph batch write their keys there."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, k_head_dim: int, v_head_dim: int,
                 max_requests: int, max_context: int, dtype: torch.dtype, device: torch.device | str):
        self.num_slots, self.max_context = num_slots, max_context
        self.k = [torch.zeros(num_slots, num_kv_heads, k_head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(num_slots, num_kv_heads, v_head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.req_to_token = torch.zeros(max_requests, max_context, dtype=torch.int32, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, k_head_dim: int, v_head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * num_kv_heads * (k_head_dim + v_head_dim) * dtype.itemsize


# ------------------------------------------------------------------------------- one step


def to_device(values: list | torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Host values as a `dtype` tensor on `device`, queued without waiting for the device: PyTorch's
    blocking host-to-device copy synchronises the stream first, so building a step that way would wait
    for the step before it to finish. On CUDA the values go through pinned memory with non_blocking
    (the caching host allocator keeps the pinned block until the copy is done)."""
    t = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class StepMemo:
    """What every layer of a step derives alike from its batch, computed once per batch and key."""
    _derived: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def derived(self, key: Any, compute: Callable[[], Any]) -> Any:
        """compute(), once per batch and key (the tokens grouped by slot for the dense-layer LoRA kernels,
        attention's block table); the batch's tensors must not change while it is in use."""
        if key not in self._derived:
            self._derived[key] = compute()
        return self._derived[key]


@dataclass
class LoRABatch(StepMemo):
    """Per-token adapter slots of a step (-1 = base model), shared by every LoRA layer of the model."""
    token_slots: torch.Tensor  # [N] int32

    @property
    def any(self) -> bool:
        return self.token_slots.numel() > 0


@dataclass
class ForwardBatch(StepMemo):
    """What one model step sees: the new tokens of B sequences, where their keys and values go in the
    paged KV cache, and which LoRA slot each token uses.

    Sequence i owns the new tokens input_ids[extend_starts[i] : extend_starts[i] + extend_lens[i]];
    they sit at positions seq_lens[i] - extend_lens[i] ... seq_lens[i] - 1 of that sequence, whose
    earlier tokens are already in the cache. Prefill, chunked prefill and decode (extend_lens == 1)
    are the same thing to the model; only attention runs the first num_decode sequences (decode rows:
    one new token each) through its decode kernels and the others through its extend kernels, so a
    decode row gets the same bits in a mixed step (decode rows and prefill chunks) as in a decode step."""

    input_ids: torch.Tensor         # [N] int64
    positions: torch.Tensor         # [N] int64, position of each new token in its sequence
    req_pool_indices: torch.Tensor  # [B] int32, row of kv.req_to_token holding each sequence's cache slots
    seq_lens: torch.Tensor          # [B] int32, tokens in the cache after this step (prefix + new)
    extend_lens: torch.Tensor       # [B] int32, new tokens per sequence
    extend_starts: torch.Tensor     # [B] int32, offset of each sequence's first new token in input_ids
    out_cache_loc: torch.Tensor     # [N] int64, cache slot each new token's key and value are written to
    logits_indices: torch.Tensor    # [M] int64, rows of the last hidden states that become logits
    kv: KVCache
    lora: LoRABatch | None = None   # None: no adapter in the batch
    num_decode: int = 0             # the first num_decode sequences are decode rows (extend_len 1)

    @classmethod
    def build(cls, kv: KVCache, rows: list[int], new_tokens: list[list[int]], prefix_lens: list[int],
              out_cache_loc: torch.Tensor, logits_indices: list[int], token_slots: list[int],
              num_decode: int, cached_prefixes: Sequence[tuple[int, torch.Tensor]] = ()) -> ForwardBatch:
        """The step in which the sequence of request row rows[i] adds new_tokens[i] after its
        prefix_lens[i] cached tokens, their keys and values going to the cache slots out_cache_loc
        (int64, in token order; recorded in kv.req_to_token here). token_slots: each new token's
        adapter slot (-1: none). The first num_decode sequences are decode rows. cached_prefixes: (row, slots)
        of sequences whose prefix is cached keys and values they did not compute (prefix caching), recorded in
        their rows here. A few host-to-device copies (queued: the host does not wait for the device), no device
        read."""
        device = kv.req_to_token.device
        extend_lens = [len(t) for t in new_tokens]
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
        starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]

        def tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return to_device(values, dtype, device)

        positions = tensor([p for prefix, n in zip(prefix_lens, extend_lens) for p in range(prefix, prefix + n)],
                           torch.int64)
        token_rows = tensor([r for r, n in zip(rows, extend_lens) for _ in range(n)], torch.int64)
        out_cache_loc = to_device(out_cache_loc, torch.int64, device)
        kv.req_to_token[token_rows, positions] = out_cache_loc.to(torch.int32)
        for row, slots in cached_prefixes:
            kv.req_to_token[row, :slots.numel()] = to_device(slots, torch.int32, device)
        return cls(
            input_ids=tensor([t for seq in new_tokens for t in seq], torch.int64), positions=positions,
            req_pool_indices=tensor(rows, torch.int32), seq_lens=tensor(seq_lens, torch.int32),
            extend_lens=tensor(extend_lens, torch.int32), extend_starts=tensor(starts, torch.int32),
            out_cache_loc=out_cache_loc, logits_indices=tensor(logits_indices, torch.int64), kv=kv,
            lora=LoRABatch(tensor(token_slots, torch.int32)) if any(s >= 0 for s in token_slots) else None,
            num_decode=num_decode)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        """Every sequence is a decode row: decode kernels only, CUDA-graph replay."""
        return self.num_decode == self.batch_size

    @cached_property
    def decode_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(req_pool_indices, seq_lens, extend_lens, extend_starts) of the decode rows; views, made once a step."""
        return self._sequences(slice(None, self.num_decode))

    @cached_property
    def extend_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The same of the other sequences (prefill and its chunks)."""
        return self._sequences(slice(self.num_decode, None))

    def _sequences(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.req_pool_indices[rows], self.seq_lens[rows], self.extend_lens[rows], self.extend_starts[rows]
