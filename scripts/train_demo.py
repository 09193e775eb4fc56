"""Train the bundled demo (moelora/demo_assets/): a small Qwen3-MoE that writes English, and two LoRA
adapters with a skill anyone can see, in the two adapter formats users have.

    python3 scripts/train_demo.py [--out moelora/demo_assets] [--threads 1] [--base-steps N] [--adapter-steps N] [--adapters-only]

- corpus: the docstrings of Python's own standard library (on every machine with Python), read from
  the source files with `ast` in sorted order, so nothing is imported and the order is fixed;
- tokenizer: byte-level BPE (GPT-2/Qwen style) trained on that corpus, ChatML special tokens;
- base: Qwen3-MoE, 4 layers, 8 experts, top-2, trained from scratch (plain AdamW, fixed seeds), saved
  in bf16; the adapters are then trained on the saved weights, as they are served;
- `shout`: answers in UPPER CASE. PEFT `target_parameters` on the fused 3D experts of transformers v5
  (`mlp.experts.gate_up_proj` / `down_proj`) + LoRA on q/k;
- `title`: Answers In Title Case. PEFT on per-expert modules (`mlp.experts.E.gate_proj`, ... as
  transformers v4 names them), on experts 0-3 of each layer only, + LoRA on q/k.

Each adapter sees a normal prompt followed by its transformed continuation; the loss is on the
continuation only. On one CPU thread it takes about 8 minutes. It ends with SHA256SUMS, which
`moelora demo` checks before loading.

Reproducible bit for bit: with `--threads 1` (the default), two full runs to different --out
directories, under different PYTHONHASHSEED, wrote the same bytes in every file, equal to the committed
SHA256SUMS, with Python 3.11.7 (its docstrings are the corpus), torch 2.13.0+cpu (CPU capability AVX2,
x86-64), transformers 5.23.0, tokenizers 0.23.3 (the tokenizer is the same at any RAYON_NUM_THREADS)
and peft 0.21.2 (which writes its version in adapter_config.json). Other torch thread counts change the
weights (the float sums are split differently), as may another torch version or CPU kernel; the files
name no path of the machine that wrote them (see save_adapter).
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import random
import re
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

SEED = 0
SEQ_LEN = 128
VOCAB = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The adapters' attention LoRA is on q and k only: they change where attention looks, but cannot add a
# fixed direction to the residual stream as v and o can, which is all "write in upper case" needs; so
# the skill is learnt by the experts (the demo shows it by running each adapter without them).
ATTENTION = ["q_proj", "k_proj"]
TITLE_EXPERTS = range(4)  # the experts of every layer that the per-expert adapter covers
# the adapters' base_model_name_or_path: the base's directory relative to OUT, where it lies beside
# them (from OUT, PEFT's AutoPeftModelForCausalLM.from_pretrained("shout") finds it)
BASE_NAME = "model"
HELD_OUT = 10  # every HELD_OUT-th paragraph is kept out of every training set (the tests' prompts come from it)


# ------------------------------------------------------------------ corpus

def docstrings() -> list[str]:
    """Paragraphs of prose from the docstrings of the standard library's modules, classes and functions."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paragraphs = []
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        if "test" in path.parent.name or path.name.startswith("test"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    paragraphs += [p for p in map(_prose, doc.split("\n\n")) if p]
    return list(dict.fromkeys(paragraphs))  # each paragraph once, first occurrence's order


def _prose(paragraph: str) -> str | None:
    """One line of English, or None for code, tables, doctests and argument lists."""
    lines = paragraph.strip().splitlines()
    if not lines or any(l.lstrip().startswith((">>>", "...", "$", "|", "+-", "-- ", "* ", "- ")) for l in lines):
        return None
    if len(lines) > 1 and lines[1].startswith(" " * 8):  # a term and its indented description
        return None
    text = " ".join(l.strip() for l in lines)
    words = text.split()
    letters = sum(c.isalpha() or c == " " for c in text)
    if len(words) < 6 or letters < 0.85 * len(text) or not text[0].isupper() or not text.isascii():
        return None
    return text


def title_case(text: str) -> str:
    """Every word's first letter upper case, the rest as they were ('the HTTP reply' -> 'The HTTP Reply')."""
    return re.sub(r"(?<![\w'])([a-z])", lambda m: m[1].upper(), text)


TASKS: dict[str, Callable[[str], str]] = {"shout": str.upper, "title": title_case}


# ------------------------------------------------------------------ tokenizer and base model

def train_tokenizer(paragraphs: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(paragraphs, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[0],
                                   clean_up_tokenization_spaces=False, chat_template=CHAT_TEMPLATE)


def base_documents(paragraphs: list[str]) -> list[str]:
    """The base model's documents: the paragraphs, every 20th also in UPPER CASE and in Title Case, so
    the base model has the upper-case tokens in its vocabulary and knows how to write them; the
    adapters teach when to."""
    docs = []
    for i, p in enumerate(paragraphs):
        docs.append(p)
        if i % 20 == 0:
            docs.append(p.upper())
        if i % 20 == 10:
            docs.append(title_case(p))
    return docs


def model_config(tokenizer):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, intermediate_size=256,
        norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
        router_aux_loss_coef=0.01, architectures=["Qwen3MoeForCausalLM"])


def packed_batches(ids: torch.Tensor, batch: int, gen: torch.Generator) -> Iterator[torch.Tensor]:
    """Random SEQ_LEN windows of the concatenated token stream, forever."""
    while True:
        starts = torch.randint(0, len(ids) - SEQ_LEN, (batch,), generator=gen)
        yield torch.stack([ids[s:s + SEQ_LEN] for s in starts.tolist()])


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over 5% of the steps, then cosine to a tenth of the peak."""
    warm = max(1, steps // 20)
    if step < warm:
        return peak * (step + 1) / warm
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm))))


def train(model: nn.Module, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], steps: int, peak_lr: float,
          what: str, aux_loss: bool = False) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.01)
    model.train()
    start, shown = time.monotonic(), 0.0
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr)
        ids, labels = next(batches)
        out = model(input_ids=ids, labels=labels, output_router_logits=aux_loss)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        shown = 0.98 * shown + 0.02 * out.loss.item() if step else out.loss.item()
        if step % 50 == 0 or step == steps - 1:
            print(f"{what}: step {step + 1}/{steps} loss {shown:.3f} ({time.monotonic() - start:.0f} s)", flush=True)
    model.eval()


def train_base(tokenizer, paragraphs: list[str], steps: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(model_config(tokenizer))
    eos = tokenizer.eos_token_id
    ids = torch.tensor([t for doc in base_documents(paragraphs) for t in tokenizer(doc).input_ids + [eos]])
    print(f"base: {len(ids)} training tokens, {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")
    gen = torch.Generator().manual_seed(SEED)
    train(model, ((x, x) for x in packed_batches(ids, 16, gen)), steps, 3e-3, "base", aux_loss=True)
    return model


# ------------------------------------------------------------------ adapters

def task_examples(tokenizer, paragraphs: list[str], task: Callable[[str], str], gen: random.Random,
                  length: int = 64) -> Iterator[tuple[list[int], list[int]]]:
    """(input ids, labels) of `length` tokens: a paragraph's first 3-8 words as they are, the rest
    transformed by `task`; labels are -100 on the prompt, so only the continuation is learnt."""
    while True:
        words = gen.choice(paragraphs).split()
        cut = gen.randint(3, min(8, len(words) - 2))
        prompt = tokenizer(" ".join(words[:cut])).input_ids
        answer = tokenizer(" " + task(" ".join(words[cut:]))).input_ids + [tokenizer.eos_token_id]
        ids = (prompt + answer)[:length]
        labels = ([-100] * len(prompt) + answer)[:length]
        pad = length - len(ids)
        yield ids + [tokenizer.eos_token_id] * pad, labels + [-100] * pad


def task_batches(examples: Iterator[tuple[list[int], list[int]]], batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:
        rows = [next(examples) for _ in range(batch)]
        yield torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])


class ExpertMLP(nn.Module):
    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (_linear(w) for w in (gate, up, down))
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PerExpertExperts(nn.ModuleList):
    """transformers v5's fused Qwen3MoeExperts as one module per expert (the v4 layout, whose names
    per-expert adapters carry), same forward: PEFT can then put LoRA on some experts only."""

    def __init__(self, fused: nn.Module):
        inter = fused.intermediate_dim
        super().__init__(ExpertMLP(w[:inter], w[inter:], d, fused.act_fn)
                         for w, d in zip(fused.gate_up_proj.data, fused.down_proj.data))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e, expert in enumerate(self):
            token, k = torch.where(top_k_index == e)
            if len(token):
                out.index_add_(0, token, expert(hidden[token]) * top_k_weights[token, k, None])
        return out


def _linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data.copy_(weight)
    return linear


def train_adapter(base: nn.Module, name: str, tokenizer, paragraphs: list[str], steps: int, out: Path) -> None:
    import copy

    from peft import LoraConfig, get_peft_model

    model = copy.deepcopy(base)
    if name == "shout":
        config = LoraConfig(r=8, lora_alpha=16, target_modules=ATTENTION,
                            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    else:
        for layer in model.model.layers:
            layer.mlp.experts = PerExpertExperts(layer.mlp.experts)
        # PEFT rewrites a qwen3_moe config's per-expert targets to v5's fused parameters (to load v4
        # adapters); this model has v4's layout, so it must keep them
        model.config.model_type = "qwen3_moe_per_expert"
        experts = "|".join(map(str, TITLE_EXPERTS))
        config = LoraConfig(r=8, lora_alpha=16, target_modules=(
            rf".*\.layers\.\d+\.(self_attn\.({'|'.join(ATTENTION)})|mlp\.experts\.({experts})\.(gate|up|down)_proj)"))
    torch.manual_seed(SEED + 1)
    peft_model = get_peft_model(model, config)
    examples = task_examples(tokenizer, paragraphs, TASKS[name], random.Random(f"{SEED}-{name}"))
    train(peft_model, task_batches(examples, 16), steps, 2e-3, name)
    save_adapter(peft_model, out / name)


def save_adapter(peft_model: nn.Module, out: Path) -> None:
    """PEFT's save_pretrained, made path-free and byte-reproducible: base_model_name_or_path is
    BASE_NAME (PEFT would write the path the base was loaded from), target_modules / target_parameters
    are sorted (PEFT writes them in a set's order, which changes with PYTHONHASHSEED), and PEFT's model
    card (README.md: a template with the base's path and nothing about the adapter) is not kept."""
    peft_model.peft_config["default"].base_model_name_or_path = BASE_NAME
    peft_model.save_pretrained(out)
    (out / "README.md").unlink()
    path = out / "adapter_config.json"
    config = json.loads(path.read_text())
    for key in ("target_modules", "target_parameters"):
        if isinstance(config[key], list):
            config[key] = sorted(config[key])
    path.write_text(json.dumps(config, indent=2, sort_keys=True))  # as PEFT writes it


# ------------------------------------------------------------------ main

def held_out(paragraphs: list[str]) -> tuple[list[str], list[str]]:
    """(training paragraphs, held-out paragraphs): every HELD_OUT-th is held out."""
    return ([p for i, p in enumerate(paragraphs) if i % HELD_OUT],
            [p for i, p in enumerate(paragraphs) if i % HELD_OUT == 0])


def write_sums(out: Path) -> None:
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "SHA256SUMS")
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(out).as_posix()}" for p in files]
    (out / "SHA256SUMS").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "moelora" / "demo_assets")
    parser.add_argument("--base-steps", type=int, default=1000)
    parser.add_argument("--adapter-steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on a shared machine two threads that wait for each "
                             "other at every step run many times slower than one; and only 1 reproduces the "
                             "committed SHA256SUMS)")
    parser.add_argument("--adapters-only", action="store_true",
                        help="train only the adapters, on the base model and tokenizer already in OUT/model")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    random.seed(SEED)
    start = time.monotonic()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    paragraphs = docstrings()
    train_set, _ = held_out(paragraphs)
    print(f"corpus: {len(paragraphs)} paragraphs, {sum(map(len, paragraphs)) / 1e6:.2f} MB of docstrings "
          f"({len(train_set)} for training)")
    if not args.adapters_only:
        tokenizer = train_tokenizer(base_documents(train_set))
        train_base(tokenizer, train_set, args.base_steps).to(torch.bfloat16).save_pretrained(args.out / "model")
        tokenizer.save_pretrained(args.out / "model")
    # the adapters learn on the shipped (bf16) weights, as they are served
    tokenizer = AutoTokenizer.from_pretrained(args.out / "model")
    base = AutoModelForCausalLM.from_pretrained(args.out / "model", dtype=torch.float32).eval()
    for name in TASKS:
        train_adapter(base, name, tokenizer, train_set, args.adapter_steps, args.out)
    write_sums(args.out)
    print(f"done in {time.monotonic() - start:.0f} s: {args.out}")


if __name__ == "__main__":
    main()
