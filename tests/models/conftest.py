"""Per-family checkpoints and PEFT adapters, built once per test session."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from peft import LoraConfig

from tests.models.families import family_config, hf_model
from tests.support import linear_suffixes, peft_adapter

EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@dataclass
class Adapter:
    path: Path
    deltas: dict[str, torch.Tensor]  # merged - base, per transformers parameter


def _cached(factory):
    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = factory(family)
        return cache[family]
    return get


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """family -> directory of the family's tiny model saved by transformers' save_pretrained."""
    def build(family: str) -> Path:
        path = tmp_path_factory.mktemp(f"{family}-model")
        hf_model(family_config(family)).save_pretrained(path)
        return path
    return _cached(build)


@pytest.fixture(scope="session")
def adapters(tmp_path_factory):
    """family -> two PEFT adapters: "full" on every linear of the decoder layers (attention, dense and
    shared MLPs), the routed experts and the router; "partial", rank 2 on some attention projections
    (parts of a fused qkv stay without LoRA) and the experts' down projection."""
    def build(family: str) -> dict[str, Adapter]:
        config = family_config(family)
        configs = {
            "full": LoraConfig(r=4, lora_alpha=8, target_modules=linear_suffixes(hf_model(config)),
                               target_parameters=[*EXPERT_PARAMS, "mlp.gate.weight"]),
            "partial": LoraConfig(r=2, lora_alpha=3, target_parameters=["mlp.experts.down_proj"], target_modules=[
                s for s in linear_suffixes(hf_model(config)) if s in ("q_proj", "v_proj", "q_b_proj", "kv_b_proj")]),
        }
        out = {}
        for name, lora_config in configs.items():
            path = tmp_path_factory.mktemp(f"{family}-{name}")
            out[name] = Adapter(path, peft_adapter(hf_model(config), lora_config, path, seed=len(out) + 1))
        return out
    return _cached(build)
