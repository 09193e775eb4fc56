"""`moelora demo`: a tiny Qwen3-MoE model with a tiny tokenizer and two PEFT adapters (attention and
every routed expert), built deterministically on first run and cached; then one mixed batch of
prompts on the base model and on each adapter. The weights are random, so the text is a random walk
over the tokenizer's words: what the demo shows is one batch serving three different models, on a
CPU."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_DIR = Path.home() / ".cache" / "moelora" / "demo"
ADAPTERS = {"alpha": 1, "beta": 2}  # name -> seed of its random LoRA weights
PROMPTS = ["Hello world", "the quick brown fox", "naïve café"]


def build(root: Path, adapters: dict[str, int] = ADAPTERS) -> None:
    """root/model (config, safetensors, tokenizer) and root/<name> for each adapter (name -> seed)."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

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


# ------------------------------------------------------------------ what build() makes its assets with

# Accents, CJK and emoji: characters of 2, 3 and 4 UTF-8 bytes, which a small vocabulary splits
# over several tokens.
_TOKENIZER_CORPUS = [
    "héllo wörld, naïve café, déjà vu",
    "你好，世界。日本語のテキスト",
    "🙂 🎉 emoji and text mixed 🙂🙂",
    "the quick brown fox jumps over the lazy dog. Hello world!",
]
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML over the special tokens above, as Qwen's tokenizers have it
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer (GPT-2/Qwen style) trained on a few lines, as a transformers
    PreTrainedTokenizerFast with EOS <|endoftext|> and a ChatML chat template; no hub access."""
    # imported here: transformers takes seconds to load and the kernel tests do not need it
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=TINY_SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_TOKENIZER_CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=TINY_SPECIAL_TOKENS[0],
                                   clean_up_tokenization_spaces=False, chat_template=TINY_CHAT_TEMPLATE)


def peft_adapter(model: torch.nn.Module, lora_config, out_dir: Path, seed: int = 1,
                 safe_serialization: bool = True) -> dict[str, torch.Tensor]:
    """Save a PEFT adapter (lora_config: peft.LoraConfig) with random LoRA weights in the model's
    dtype; return {base parameter name: merged - base} for every parameter the adapter changes.
    `model` is wrapped and merged in place."""
    import torch
    from peft import get_peft_model  # importing peft takes seconds; only adapter-building tests need it

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
