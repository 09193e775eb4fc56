"""`moelora demo`: a tiny Qwen3-MoE model with a tiny tokenizer and two PEFT adapters (attention and
every routed expert), built deterministically on first run and cached; then one mixed batch of
prompts on the base model and on each adapter. The weights are random, so the text is a random walk
over the tokenizer's words: what the demo shows is one batch serving three different models, on a
CPU."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

DEFAULT_DIR = Path.home() / ".cache" / "moelora" / "demo"
ADAPTERS = {"alpha": 1, "beta": 2}  # name -> seed of its random LoRA weights
PROMPTS = ["Hello world", "the quick brown fox", "naïve café"]


def build(root: Path, adapters: dict[str, int] = ADAPTERS) -> None:
    """root/model (config, safetensors, tokenizer) and root/<name> for each adapter (name -> seed)."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from moelora.testing import peft_adapter, tiny_tokenizer

    tokenizer = tiny_tokenizer(vocab_size=1000)  # as many merges as its corpus has: whole words
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
        max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id, architectures=["Qwen3MoeForCausalLM"])

    # Only whole words keep their lm_head rows (the others' logits are 0, below the best word's), so
    # the random model's noise reads as words rather than stray bytes.
    pieces = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    not_words = [i for i, p in enumerate(pieces) if not (p.startswith(" ") and len(p) > 2 and p.isprintable()
                                                         and "\ufffd" not in p)]

    def model():
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(config).eval()
        m.lm_head.weight.data[not_words] = 0.0
        return m

    model().save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    lora_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    for name, seed in adapters.items():
        peft_adapter(model(), lora_config, root / name, seed=seed)


def ensure_built(root: Path) -> None:
    """Build once: into a temporary directory, renamed into place when complete."""
    if (root / "model" / "config.json").is_file() and all((root / name).is_dir() for name in ADAPTERS):
        return
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=root.parent))
    try:
        build(tmp)
        shutil.rmtree(root, ignore_errors=True)
        tmp.rename(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(root: Path = DEFAULT_DIR, max_tokens: int = 12) -> list[tuple[str, str, str]]:
    """(adapter, prompt, completion) of every prompt on the base model and each adapter, in one mixed batch."""
    from moelora.engine.engine import Engine
    from moelora.engine.sampling_params import SamplingParams

    ensure_built(root)
    engine = Engine(str(root / "model"), lora_paths={n: str(root / n) for n in ADAPTERS}, device="cpu",
                    dtype="float32", max_loras_per_batch=len(ADAPTERS))
    adapters = [None, *ADAPTERS]
    jobs = [(a, p) for p in PROMPTS for a in adapters]
    outputs = engine.generate([p for _, p in jobs], SamplingParams(max_tokens=max_tokens, temperature=0.0),
                              lora=[a for a, _ in jobs])
    return [(a or "base", p, o.text) for (a, p), o in zip(jobs, outputs)]
