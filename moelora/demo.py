"""`moelora demo`: the bundled demo model and its two adapters, served in one mixed batch.

The files under demo_assets/ were written by scripts/train_demo.py (the commands to make them again
are there): a 4-layer Qwen3-MoE with 8 experts, top-2, trained on CPU on the docstrings of Python's
standard library, and two PEFT adapters, `shout` (answers in UPPER CASE; target_parameters on the
fused experts + q/k attention) and `title` (Answers In Title Case; per-expert modules on experts 0-3
of every layer + q/k attention). The demo checks the files against SHA256SUMS, then generates every prompt
with the base model, each adapter, and each adapter with its expert part removed (a copy of the
adapter without its expert tensors, in a temporary directory), greedy and sampled, in one batch.
"""
from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "demo_assets"
ADAPTERS = {"shout": "answers in UPPER CASE", "title": "Answers In Title Case"}
NO_EXPERTS = "-experts"  # suffix of an adapter's name with its expert LoRA removed
# Written for the demo: none is in the training corpus, so what the adapters do to them is learnt, not recalled.
PROMPTS = ["If the file does not exist, the", "The default value of this option is", "A new list is returned with"]


@dataclass
class Completion:
    model: str     # 'base', an adapter, or an adapter + NO_EXPERTS
    prompt: str
    greedy: str
    sampled: str


@dataclass
class DemoRun:
    completions: list[Completion]
    tokens: int       # generated in the batch
    seconds: float    # the batch's wall time


def verify(root: Path) -> None:
    """Every file of root's SHA256SUMS is there with its hash; otherwise a ValueError naming the files."""
    sums = root / "SHA256SUMS"
    if not sums.is_file():
        raise ValueError(f"{root}: no SHA256SUMS (the demo files are written by scripts/train_demo.py)")
    try:
        lines = sums.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{sums}: not UTF-8 text ({e})") from None
    entries = []
    for number, line in enumerate(lines, 1):
        digest, sep, name = line.partition("  ")
        if not (sep and name and re.fullmatch("[0-9a-f]{64}", digest)):
            raise ValueError(f"{sums}, line {number}: expected '<sha256 in hex>  <file>' (sha256sum's format), got "
                             f"{line[:100]!r}")
        entries.append((digest, name))
    needed = ["model/config.json", *(f"{name}/adapter_config.json" for name in ADAPTERS)]
    unlisted = [name for name in needed if name not in {n for _, n in entries}]
    if unlisted:
        raise ValueError(f"{sums}: does not list {', '.join(unlisted)}: not the demo's files")
    bad = []
    for digest, name in entries:
        path = root / name
        if not path.is_file():
            bad.append(f"{name} (missing)")
        elif hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            bad.append(f"{name} (changed)")
    if bad:
        raise ValueError(f"{root}: files differ from SHA256SUMS: {', '.join(bad)}; restore them "
                         "(git checkout moelora/demo_assets) or write them again with scripts/train_demo.py")


def without_experts(adapter: Path, out: Path) -> Path:
    """A copy of the adapter without its routed experts' tensors: what is left of it is attention."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    tensors = load_file(adapter / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".mlp.experts" not in k}, out / "adapter_model.safetensors")
    shutil.copy(adapter / "adapter_config.json", out / "adapter_config.json")
    return out


def describe(root: Path) -> list[str]:
    """What the demo loads: the model's shape and each adapter's format, rank and the experts it covers."""
    from moelora.lora import load_adapter
    from moelora.lora.model_shapes import format_ranges
    from moelora.models.config import ModelConfig

    config = ModelConfig.from_pretrained(root / "model")
    size = sum(p.stat().st_size for p in (root / "model").glob("*.safetensors"))
    lines = [f"model  {root / 'model'}: {config.architectures[0]}, {config.num_layers} layers, {config.num_experts} "
             f"experts (top-{config.topk.top_k}), hidden {config.hidden_size}, vocabulary {config.vocab_size} "
             f"(byte-level BPE), {size / 1e6:.1f} MB of {str(config.saved_dtype).removeprefix('torch.')}; trained on CPU on Python's "
             "docstrings by scripts/train_demo.py (not random weights)"]
    for name, skill in ADAPTERS.items():
        adapter = load_adapter(root / name, root / "model")
        covered = {layer: format_ranges(lora.experts["down"].covered.nonzero().flatten().tolist())
                   for layer, lora in adapter.layers.items() if "down" in lora.experts}
        where = sorted(set(covered.values()))
        experts = (f"experts {where[0]} of layers {format_ranges(sorted(covered))}" if len(where) == 1
                   else "; ".join(f"layer {layer}: experts {e}" for layer, e in covered.items()))
        lines.append(f"adapter {name}: {skill}; {root / name}: PEFT {', '.join(adapter.formats)} + attention, "
                     f"rank {adapter.max_rank}, covers {experts}")
    return lines


def run(root: Path = ASSETS, max_tokens: int = 20, temperature: float = 0.7, seed: int = 0,
        prompts: list[str] = PROMPTS) -> DemoRun:
    """Every prompt on the base model, each adapter and each adapter without its experts, greedy and
    sampled (seeded), all in one engine.generate call."""
    from moelora.engine import Engine, SamplingParams

    verify(root)
    with tempfile.TemporaryDirectory(prefix="moelora-demo-") as tmp:
        paths = {name: root / name for name in ADAPTERS}
        paths |= {name + NO_EXPERTS: without_experts(root / name, Path(tmp) / name) for name in ADAPTERS}
        engine = Engine(str(root / "model"), lora_paths={n: str(p) for n, p in paths.items()}, device="cpu",
                        dtype="float32", max_loras_per_batch=len(paths))
        models = [None, *[m for name in ADAPTERS for m in (name, name + NO_EXPERTS)]]
        greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        sampled = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        jobs = [(p, m, sp) for p in prompts for m in models for sp in (greedy, sampled)]
        start = time.perf_counter()
        outputs = engine.generate([p for p, _, _ in jobs], [sp for _, _, sp in jobs], lora=[m for _, m, _ in jobs])
        seconds = time.perf_counter() - start
    texts = iter(o.text for o in outputs)
    completions = [Completion(m or "base", p, next(texts), next(texts)) for p in prompts for m in models]
    return DemoRun(completions, sum(len(o.token_ids) for o in outputs), seconds)
