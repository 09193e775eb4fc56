"""The canonical in-memory adapter: what every file format is parsed into and all later code reads.

Per decoder layer: for the routed experts, per projection (gate, up, down) A [E, r, in] and
B [E, out, r]; for every other linear module A [r, in] and B [out, r]. Scaling is folded into B,
so the delta of a weight is B @ A (per expert). Ranks below the projection's r are zero-padded;
`ranks[e] == 0` means the adapter does not cover expert e (its A and B are zero).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from moelora.lora.config import AdapterConfig


@dataclass
class LinearLoRA:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r], scaling folded in
    scaling: float
    keys: tuple[str, ...]  # the file's tensors this came from

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def delta(self) -> torch.Tensor:
        """[out, in] float32: what the adapter adds to the module's weight."""
        return self.b.float() @ self.a.float()


@dataclass
class ExpertsLoRA:
    a: torch.Tensor        # [E, r, in]
    b: torch.Tensor        # [E, out, r], scaling folded in
    ranks: torch.Tensor    # [E] int32, 0 = expert not covered
    scaling: torch.Tensor  # [E] float32, 0 where not covered
    keys: tuple[str, ...]

    @property
    def rank(self) -> int:
        return self.a.shape[1]

    @property
    def covered(self) -> torch.Tensor:
        return self.ranks > 0

    def delta(self, expert: int) -> torch.Tensor:
        """[out, in] float32: what the adapter adds to one expert's projection weight."""
        return self.b[expert].float() @ self.a[expert].float()


@dataclass
class LayerLoRA:
    # Names are relative to the decoder layer, as in transformers v5; what is absent is not adapted.
    experts: dict[str, ExpertsLoRA] = field(default_factory=dict)   # 'gate' | 'up' | 'down'
    modules: dict[str, LinearLoRA] = field(default_factory=dict)    # 'self_attn.q_proj', 'mlp.gate', ...


@dataclass
class Adapter:
    path: Path
    config: AdapterConfig
    formats: tuple[str, ...]     # expert formats found in the file, see formats.Kind
    layers: dict[int, LayerLoRA]
    version: tuple[tuple[str, int, int], ...] = ()  # its files' (adapter.files_version) when they were read

    @property
    def max_rank(self) -> int:
        ranks = [m.rank for layer in self.layers.values() for m in (*layer.experts.values(), *layer.modules.values())]
        return max(ranks, default=0)

    def num_bytes(self) -> int:
        """Bytes of all A and B tensors as held here (padded to each projection's rank)."""
        return sum(t.numel() * t.element_size() for layer in self.layers.values()
                   for m in (*layer.experts.values(), *layer.modules.values()) for t in (m.a, m.b))
