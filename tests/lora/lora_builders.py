"""Tiny base models and adapters for the adapter-loader tests.

Ground truth comes from PEFT itself wherever PEFT can write the format: `peft_adapter` trains
nothing, it fills every LoRA weight with random values, saves the adapter and returns what
`merge_and_unload()` adds to each base weight. Per-expert-module adapters (transformers v4
layout) come from the same PEFT code run on `PerExpertModel`, a module tree with one nn.Linear
per expert projection, built from the real model so its weights and names match.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from torch import nn
from transformers import (AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config, MixtralConfig, OlmoeConfig,
                          PretrainedConfig, Qwen2MoeConfig, Qwen3MoeConfig)

HIDDEN, MOE_INTER, DENSE_INTER, EXPERTS = 16, 6, 20, 4  # 2 * MOE_INTER != HIDDEN: layouts are told apart by shape
_COMMON = dict(vocab_size=32, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, num_experts_per_tok=2)
_MLA = dict(num_key_value_heads=2, moe_intermediate_size=MOE_INTER, intermediate_size=DENSE_INTER,
            n_routed_experts=EXPERTS, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=10,
            qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6, n_group=1, topk_group=1)


def tiny_config(family: str) -> PretrainedConfig:
    """2 layers; families with dense layers get layer 0 dense (Qwen via mlp_only_layers, DeepSeek via first_k_dense_replace)."""
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**_COMMON, num_key_value_heads=1, head_dim=8, num_experts=EXPERTS,
                              moe_intermediate_size=MOE_INTER, intermediate_size=DENSE_INTER, mlp_only_layers=[0])
    if family == "qwen2_moe":
        return Qwen2MoeConfig(**_COMMON, num_key_value_heads=1, num_experts=EXPERTS, moe_intermediate_size=MOE_INTER,
                              intermediate_size=DENSE_INTER, shared_expert_intermediate_size=10)
    if family == "mixtral":
        return MixtralConfig(**_COMMON, num_key_value_heads=1, num_local_experts=EXPERTS, intermediate_size=MOE_INTER)
    if family == "olmoe":
        return OlmoeConfig(**_COMMON, num_key_value_heads=2, num_experts=EXPERTS, intermediate_size=MOE_INTER)
    if family == "deepseek_v2":
        return DeepseekV2Config(**_COMMON, **_MLA, q_lora_rank=None)
    if family == "deepseek_v3":
        return DeepseekV3Config(**_COMMON, **_MLA, q_lora_rank=12)
    raise ValueError(family)


FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3")


def tiny_model(config: PretrainedConfig, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def linear_suffixes(model: nn.Module) -> list[str]:
    """Last name of every nn.Linear in the decoder layers: PEFT target_modules for 'all of them'."""
    return sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n})


def peft_adapter(model: nn.Module, lora_config: LoraConfig, out_dir: Path, seed: int = 1,
                 safe_serialization: bool = True) -> dict[str, torch.Tensor]:
    """Save a PEFT adapter with random LoRA weights in the model's dtype; return {base parameter
    name: merged - base} for every parameter the adapter changes."""
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    peft_model = get_peft_model(model, lora_config, autocast_adapter_dtype=False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    peft_model.save_pretrained(out_dir, safe_serialization=safe_serialization)
    merged = peft_model.merge_and_unload().state_dict()
    return {k: merged[k] - base[k] for k in base if not torch.equal(merged[k], base[k])}


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
