"""Engines over the per-family tiny checkpoints and PEFT adapters of the model tests."""
from __future__ import annotations

import pytest

from peft import LoraConfig

from moelora.engine.engine import Engine
from tests.models.conftest import EXPERT_PARAMS, adapters, checkpoint  # noqa: F401  (session fixtures, shared)
from tests.models.families import family_config, hf_model
from tests.support import peft_adapter, tiny_tokenizer


@pytest.fixture(scope="session")
def wide_adapter(tmp_path_factory) -> str:
    """A rank-20 PEFT adapter of the tiny Qwen3-MoE on q_proj and every expert: its experts' rank is above the
    smallest rank tile's (16), so a step with it runs the experts' LoRA with the slots' rank bound."""
    path = tmp_path_factory.mktemp("qwen3_moe-wide")
    peft_adapter(hf_model(family_config("qwen3_moe")), LoraConfig(r=20, lora_alpha=20, target_modules=["q_proj"],
                                                                  target_parameters=EXPERT_PARAMS), path, seed=7)
    return str(path)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """The checkpoints have no tokenizer; prompts are token ids below the models' vocabulary."""
    path = tmp_path_factory.mktemp("tokenizer")
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def make_engine(checkpoint, adapters, tokenizer_dir):  # noqa: F811
    """make_engine(family, **EngineConfig fields) -> an fp32 engine with the family's "full" and
    "partial" adapters loaded."""
    def make(family: str, **kwargs) -> Engine:
        lora_paths = {name: str(a.path) for name, a in adapters(family).items()}
        options = dict(device="cpu", dtype="float32", tokenizer_path=str(tokenizer_dir), max_loras_per_batch=2,
                       max_lora_rank=8, lora_paths=lora_paths)
        return Engine(str(checkpoint(family)), **{**options, **kwargs})
    return make
