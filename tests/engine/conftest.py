"""Engines over the per-family tiny checkpoints and PEFT adapters of the model tests."""
from __future__ import annotations

import pytest

from moelora.engine.engine import Engine
from tests.models.conftest import adapters, checkpoint  # noqa: F401  (session fixtures, shared)
from tests.support import tiny_tokenizer


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
