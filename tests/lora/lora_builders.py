"""Tiny base models and adapters for the adapter-loader tests.

Ground truth comes from PEFT itself wherever PEFT can write the format: `peft_adapter` (in
tests/support.py, shared with the model tests) trains nothing, it fills every LoRA weight with
random values, saves the adapter and returns what `merge_and_unload()` adds to each base weight.
Per-expert-module adapters (transformers v4 layout) come from the same PEFT code run on
`PerExpertModel`, a module tree with one nn.Linear per expert projection, built from the real
model so its weights and names match. Formats PEFT does not write are written by hand (`HandLoRA`,
`HAND_FORMATS`) for any transformers model's shapes, with the deltas of each tool's own formula.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import PretrainedConfig

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


def edit_config(adapter_dir: Path, drop: tuple[str, ...] = (), **fields: Any) -> None:
    """Rewrite the adapter's adapter_config.json without the fields `drop` and with `fields` set."""
    path = adapter_dir / "adapter_config.json"
    raw = {k: v for k, v in json.loads(path.read_text()).items() if k not in drop}
    path.write_text(json.dumps(raw | fields))


def peft_loaded_deltas(config: PretrainedConfig, adapter_dir: Path) -> dict[str, torch.Tensor]:
    """What PEFT itself makes of the adapter as it is on disk: {base parameter name: merged - base} of a fresh tiny
    model after PeftModel.from_pretrained (its reading of adapter_config.json, defaults included) and merging."""
    from peft import PeftModel  # importing peft takes seconds; only adapter-building tests need it

    model = tiny_model(config)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().state_dict()
    return {k: merged[k] - base[k] for k in base if not torch.equal(merged[k], base[k])}


# ------------------------------------------------------------------ formats PEFT does not write, by hand

@dataclass
class HandLoRA:
    """An adapter written by hand from a tool's documented layout: its file's tensors, its adapter_config.json
    fields, and the delta each transformers parameter it adapts gets by that tool's own formula (computed
    from the tensors here, not by the loader)."""
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    deltas: dict[str, torch.Tensor]  # merged - base, per transformers v5 parameter

    def __or__(self, other: HandLoRA) -> HandLoRA:
        """One file holding both adapters' tensors (of different modules, with the same r and lora_alpha)."""
        assert not self.tensors.keys() & other.tensors.keys(), "the two adapt the same modules"
        assert all(self.config[k] == v for k, v in other.config.items() if k in self.config), "configs disagree"
        return HandLoRA({**self.tensors, **other.tensors}, {**self.config, **other.config},
                        {**self.deltas, **other.deltas})

    def write(self, out_dir: Path) -> Path:
        return write_adapter(out_dir, self.tensors, **self.config)


_EXPERT_PARAM = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")


def _expert_params(model: nn.Module) -> dict[str, torch.Size]:
    """The transformers v5 fused expert parameters of every MoE layer: name -> [E, out, in]."""
    return {n: t.shape for n, t in model.state_dict().items() if _EXPERT_PARAM.match(n)}


def _lora_randn(generator: torch.Generator, *shape: int) -> torch.Tensor:
    """N(0, 1 / last dim): B @ A then stays of the order of the tiny models' weights."""
    return torch.randn(*shape, generator=generator) / shape[-1] ** 0.5


def target_parameters_lora(model: nn.Module, rank: int, alpha: float, *,
                           params: tuple[str, ...] = ("gate_up_proj", "down_proj"), old_orientation: bool = False,
                           grouped: bool = False, seed: int = 0, **config: Any) -> HandLoRA:
    """PEFT target_parameters LoRA on the fused experts `params` of every MoE layer, as other writers lay it
    out: A [E*r, X], B [Y, E*r]. PEFT >= 0.19.1 takes X, Y = in, out of the projection; old_orientation
    (PEFT 0.17-0.18) took them from dims 1, 2 of the [E, out, in] parameter (X = out, Y = in), its delta
    einsum('o r e, e r i -> e i o') (PEFT 0.18's get_delta_weight). B's columns are (r, E), expert fastest, or
    (E, r) with older Unsloth's lora_B_layout grouped_by_expert (`grouped`). Of two parameters, PEFT nests
    the wrappers: gate_up_proj, defined first, is the inner one (`experts.base_layer`). `config`: more
    adapter_config.json fields (peft_version)."""
    generator = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    for name, (e, out, inp) in _expert_params(model).items():
        prefix, _, param = name.rpartition(".")
        if param not in params:
            continue
        x, y = (out, inp) if old_orientation else (inp, out)
        a, b = _lora_randn(generator, e * rank, x), _lora_randn(generator, y, e * rank)
        wrapper = "base_layer." if len(params) == 2 and param == "gate_up_proj" else ""
        tensors[f"base_model.model.{prefix}.{wrapper}lora_A.weight"] = a
        tensors[f"base_model.model.{prefix}.{wrapper}lora_B.weight"] = b
        b3 = b.reshape(y, e, rank) if grouped else b.reshape(y, rank, e)
        pattern = ("oer" if grouped else "ore") + ",eri->" + ("eio" if old_orientation else "eoi")
        deltas[name] = alpha / rank * torch.einsum(pattern, b3, a.reshape(e, rank, x))
    layout = {"lora_B_layout": "grouped_by_expert"} if grouped else {}
    return HandLoRA(tensors, dict(r=rank, lora_alpha=alpha, target_parameters=[f"mlp.experts.{p}" for p in params],
                                  **layout, **config), deltas)


def stacked_lora(model: nn.Module, rank: int, alpha: float, *,
                 names: tuple[str, str | None, str] = ("gate_up_proj", None, "down_proj"), suffix: str = ".weight",
                 shared_outer: bool = False, seed: int = 0) -> HandLoRA:
    """Stacked 3D LoRA of the experts of every MoE layer: per projection `<experts>.<name>.lora_A<suffix>`
    A [E, r, in] and B [E, out, r], delta[e] = scaling * B[e] @ A[e]. `names`: gate, up, down (up None: gate
    is the fused gate_up). shared_outer: the outer sides, A of gate/up and B of down, are [1, ...], shared by
    every expert."""
    generator = torch.Generator().manual_seed(seed)
    gate, up, down = names
    tensors, deltas = {}, {}
    for name, (e, out, inp) in _expert_params(model).items():
        prefix, _, param = name.rpartition(".")
        if param == "down_proj":
            projections, a_experts, b_experts = [(down, out)], e, 1 if shared_outer else e
        else:
            projections = [(gate, out)] if up is None else [(gate, out // 2), (up, out // 2)]
            a_experts, b_experts = 1 if shared_outer else e, e
        parts = []
        for proj, rows in projections:
            a, b = _lora_randn(generator, a_experts, rank, inp), _lora_randn(generator, b_experts, rows, rank)
            tensors[f"base_model.model.{prefix}.{proj}.lora_A{suffix}"] = a
            tensors[f"base_model.model.{prefix}.{proj}.lora_B{suffix}"] = b
            parts.append(alpha / rank * b @ a)  # a side of 1 broadcasts over the experts
        deltas[name] = torch.cat(parts, dim=1)  # gate then up, as transformers' gate_up_proj chunks
    return HandLoRA(tensors, dict(r=rank, lora_alpha=alpha), deltas)


# fused linear -> its parts, in the order of the fused output's rows (SGLang's and vLLM's layers)
_FUSED_LINEARS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fused_linears_lora(model: nn.Module, rank: int, alpha: float, *, seed: int = 0) -> HandLoRA:
    """LoRA of implementations that fuse projections: `self_attn.qkv_proj` and each MLP's (dense or shared
    expert's) `gate_up_proj` in every layer that has all their parts, one A [r, in] and B [sum of the parts'
    outs, r]; each part's delta is its rows of scaling * B @ A."""
    generator = torch.Generator().manual_seed(seed)
    weights = {n: t.shape for n, t in model.state_dict().items() if ".layers." in n and n.endswith(".weight")}
    tensors, deltas = {}, {}
    for name, shape in weights.items():
        for fused, parts in _FUSED_LINEARS.items():
            if not name.endswith(f".{parts[0]}.weight"):
                continue
            prefix = name.removesuffix(f".{parts[0]}.weight")
            part_names = [f"{prefix}.{p}.weight" for p in parts]
            if not all(p in weights for p in part_names):
                continue
            outs = [weights[p][0] for p in part_names]
            a, b = _lora_randn(generator, rank, shape[1]), _lora_randn(generator, sum(outs), rank)
            tensors[f"base_model.model.{prefix}.{fused}.lora_A.weight"] = a
            tensors[f"base_model.model.{prefix}.{fused}.lora_B.weight"] = b
            deltas.update(zip(part_names, (alpha / rank * b @ a).split(outs)))
    return HandLoRA(tensors, dict(r=rank, lora_alpha=alpha), deltas)


def _fused_linears_and_stacked_experts(model: nn.Module, rank: int, alpha: float, *, seed: int = 0) -> HandLoRA:
    return (fused_linears_lora(model, rank, alpha, seed=seed)
            | stacked_lora(model, rank, alpha, names=("gate_proj", "up_proj", "down_proj"), seed=seed + 1))


# Every layout the loader reads (moelora/lora/formats.py, experts.py) that PEFT 0.21 does not write, each on
# the routed experts of every MoE layer: (model, rank, alpha, seed=...) -> HandLoRA. The fused linears come
# with stacked experts under their third naming, so that each adapter adapts the routed experts.
HAND_FORMATS: dict[str, Callable[..., HandLoRA]] = {
    "target_parameters, peft 0.17-0.18 orientation": partial(target_parameters_lora, old_orientation=True,
                                                             peft_version="0.18.0"),
    "target_parameters, unsloth grouped_by_expert": partial(target_parameters_lora, grouped=True),
    "stacked 3d gate_up_proj/down_proj": stacked_lora,
    "stacked 3d w1/w3/w2, bare keys": partial(stacked_lora, names=("w1", "w3", "w2"), suffix=""),
    "stacked 3d, shared outer sides": partial(stacked_lora, suffix="", shared_outer=True),
    "fused qkv_proj/gate_up_proj + stacked 3d gate_proj/up_proj/down_proj": _fused_linears_and_stacked_experts,
}
