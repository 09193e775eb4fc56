"""A dummy-weight Qwen3-MoE engine (Qwen3-30B-A3B's sizes, or tiny) serving 8 random rank-16 PEFT
adapters on attention and every routed expert, and the check that they all serve in one batch."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from moelora.engine.engine import Engine
from moelora.engine.sampling_params import SamplingParams
from tests.support import qwen3_30b_a3b_config, write_dummy_checkpoint, write_random_peft_adapter

NAMES = [None] + [f"a{i}" for i in range(8)]


def dummy_qwen3_engine(root: Path, tiny: bool, device: str, **kwargs) -> Engine:
    """config.json and the tiny tokenizer in root/model, the adapters in root/a0..a7; bf16 on GPUs."""
    config = qwen3_30b_a3b_config(tiny=tiny)
    model_dir = write_dummy_checkpoint(config, root / "model")
    adapters = {n: str(write_random_peft_adapter(config, root / n, rank=16, seed=i, device=device))
                for i, n in enumerate(NAMES[1:])}
    return Engine(str(model_dir), lora_paths=adapters, load_format="dummy", device=device,
                  dtype="bfloat16" if device == "cuda" else "float32", max_loras_per_batch=8, max_lora_rank=16, **kwargs)


def check_adapters_in_one_batch(engine: Engine) -> list[list[int]]:
    """The base model and the 8 adapters on one prompt in one batch: finite log-probs everywhere, and
    9 different greedy continuations. Returns them."""
    prompt = torch.randint(0, engine.vocab_size, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = engine.generate([prompt] * len(NAMES), params, lora=NAMES)
    for name, out in zip(NAMES, outs):
        assert len(out.token_ids) == 8
        assert all(math.isfinite(v) for step in out.logprobs for v in step.values()), f"{name}: non-finite log-probs"
    tokens = {name: tuple(out.token_ids) for name, out in zip(NAMES, outs)}
    assert len(set(tokens.values())) == len(NAMES), f"adapters with the same tokens: {tokens}"
    logprobs = engine.prompt_logprobs([prompt] * len(NAMES), lora=NAMES)
    assert all(bool(torch.isfinite(lp).all()) for lp in logprobs)
    return [out.token_ids for out in outs]
