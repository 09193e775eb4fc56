"""Tiny base models and adapters for the adapter-loader tests.

Ground truth comes from PEFT itself wherever PEFT can write the format: `peft_adapter` (in
tests/support.py, shared with the model tests) trains nothing, it fills every LoRA weight with
random values, saves the adapter and returns what `merge_and_unload()` adds to each base weight.
Per-expert-module adapters (transformers v4 layout) come from the same PEFT code run on
`PerExpertModel`, a module tree with one nn.Linear per expert projection, built from the real
model so its weights and names match.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from tests.support import (EXPERTS, FAMILIES, HIDDEN, MOE_INTER, linear_suffixes,  # noqa: F401 (re-exported)
                             peft_adapter, tiny_config, tiny_model)


def canonical_deltas(adapter) -> dict[str, torch.Tensor]:
    """The canonical adapter's deltas named and laid out like the transformers v5 parameters."""
    deltas = {}
    for layer, lora in adapter.layers.items():
        for name, module in lora.modules.items():
            deltas[f"model.layers.{layer}.{name}.weight"] = module.delta()
        if lora.experts:
            experts = range(next(iter(lora.experts.values())).a.shape[0])
            if "gate" in lora.experts:
                deltas[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
                    [torch.cat([lora.experts["gate"].delta(e), lora.experts["up"].delta(e)]) for e in experts])
            if "down" in lora.experts:
                deltas[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([lora.experts["down"].delta(e) for e in experts])
    return deltas


def assert_deltas_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected), f"changed weights differ: got {sorted(got)}, expected {sorted(expected)}"
    for name, want in expected.items():
        scale = want.abs().max().item()
        err = (got[name].float() - want.float()).abs().max().item()
        assert err <= 1e-5 * max(scale, 1.0), f"{name}: max error {err:.3g} (delta magnitude {scale:.3g})"


class PerExpertModel(nn.Module):
    """A module tree with the transformers v4 names: one nn.Linear per expert projection
    (`mlp.experts.<e>.gate_proj` or Mixtral's `block_sparse_moe.experts.<e>.w1`), the router as an
    nn.Linear, and every other linear of `model` as it is. Weights are copied from `model`."""

    def __init__(self, model: nn.Module, mixtral_names: bool = False):
        super().__init__()
        self.model = nn.Module()
        gate, up, down = ("w1", "w3", "w2") if mixtral_names else ("gate_proj", "up_proj", "down_proj")
        moe = "block_sparse_moe" if mixtral_names else "mlp"
        for name, w in model.state_dict().items():
            if ".layers." not in name:
                continue
            prefix = name.replace("model.", "", 1).rpartition(".mlp.")[0]
            if name.endswith("experts.gate_up_proj"):
                inter = w.shape[1] // 2
                for e in range(w.shape[0]):
                    self._linear(f"{prefix}.{moe}.experts.{e}.{gate}", w[e, :inter])
                    self._linear(f"{prefix}.{moe}.experts.{e}.{up}", w[e, inter:])
            elif name.endswith("experts.down_proj"):
                for e in range(w.shape[0]):
                    self._linear(f"{prefix}.{moe}.experts.{e}.{down}", w[e])
            elif name.endswith("mlp.gate.weight"):
                self._linear(f"{prefix}.{moe}.gate", w)
            elif name.endswith(".weight") and w.ndim == 2:
                self._linear(name.replace("model.", "", 1).removesuffix(".weight"), w)

    def _linear(self, path: str, weight: torch.Tensor) -> None:
        parent = self.model
        *parents, leaf = path.split(".")
        for part in parents:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight.data.copy_(weight)
        parent.add_module(leaf, linear)


def per_expert_deltas_as_v5(deltas: dict[str, torch.Tensor], mixtral_names: bool = False) -> dict[str, torch.Tensor]:
    """Deltas of a PerExpertModel renamed and stacked like the transformers v5 parameters."""
    gate, up, down = ("w1", "w3", "w2") if mixtral_names else ("gate_proj", "up_proj", "down_proj")
    out, experts = {}, {}
    for name, d in deltas.items():
        name = name.replace("block_sparse_moe.", "mlp.")
        parts = name.split(".")
        if ".mlp.experts." in name:  # model.layers.L.mlp.experts.E.proj.weight
            experts.setdefault(".".join(parts[:5]), {})[(int(parts[5]), parts[6])] = d
        else:
            out[name] = d
    for prefix, found in experts.items():
        ids = sorted({e for e, _ in found})
        assert ids == list(range(len(ids))), "tests cover all experts when comparing as v5"
        if (0, gate) in found:
            out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([found[(e, gate)], found[(e, up)]]) for e in ids])
        if (0, down) in found:
            out[f"{prefix}.down_proj"] = torch.stack([found[(e, down)] for e in ids])
    return out


def write_adapter(out_dir: Path, tensors: dict[str, torch.Tensor], **config) -> Path:
    """An adapter written by hand: safetensors + adapter_config.json with PEFT's defaults and `config`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.clone().contiguous() for k, v in tensors.items()}, out_dir / "adapter_model.safetensors")
    (out_dir / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, **config}))
    return out_dir
