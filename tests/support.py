"""Test and benchmark support, outside the installed package: random MoE layers, tie-free router
logits, LoRA slot buffers (experts and dense layers), one expert-parallel rank's Runner with NaN wherever it
must not read, paged-attention batches, dtype-derived tolerances and the fp32 tolerance of reordered sums, a
tiny byte-level BPE tokenizer (built offline), a random-weight tiny Qwen3-MoE with random PEFT adapters
(`build_random_demo`), tiny transformers models of every family with PEFT adapters on them, a
Qwen3-30B-A3B-shaped dummy checkpoint with random PEFT adapters at its real shapes, DeepSeek-V3's and
Qwen3-235B-A22B's configs, what one rank of a parallel layout holds (`rank_memory`), and ForwardBatches over a KV
cache."""
from __future__ import annotations

import re
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from transformers import (AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config, MixtralConfig, OlmoeConfig,
                          PretrainedConfig, Qwen2MoeConfig, Qwen3MoeConfig)

from moelora.core import ExpertLoRASlots, ForwardBatch, KVCache, LinearLoRASlots, TopKConfig, TopKOutput
from moelora.distributed.state import ParallelState, parallel_state
from moelora.engine import model_runner
from moelora.engine.config import EngineConfig
from moelora.engine.lora_slots import allocate_lora_slots, slot_bytes
from moelora.layers.moe.runner import Runner
from moelora.models.config import ModelConfig
from moelora.models.loader import build_model


def random_moe_weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device="cpu",
                       generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H], w2 [E, H, I] scaled so activations stay O(1)."""
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=generator, device=device) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=generator, device=device) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


def random_topk(num_tokens: int, num_experts: int, top_k: int, device="cpu",
                generator: torch.Generator | None = None) -> TopKOutput:
    """Distinct experts per token, softmax-like weights."""
    scores = torch.rand(num_tokens, num_experts, generator=generator, device=device)
    ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=generator, device=device) + 0.1
    return TopKOutput((weights / weights.sum(-1, keepdim=True)).contiguous(), ids.contiguous())


def tie_free_router_logits(num_tokens: int, num_experts: int, config: TopKConfig,
                           correction_bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                           device="cpu", margin: float = 1e-5,
                           generator: torch.Generator | None = None) -> torch.Tensor:
    """Normal router logits [T, E] in `dtype` whose routing has no near-ties (rows are redrawn until none
    has): in float64, the k+1 best choices and, for grouped routing, the group scores on either side of
    the topk_group-th are `margin` apart. Implementations that round differently then choose the same
    experts in the same order."""
    logits = torch.randn(num_tokens, num_experts, generator=generator).to(dtype)
    bias = None if correction_bias is None else correction_bias.double().cpu()
    while (near := _routing_margins(logits, config, bias) < margin).any():
        logits[near] = torch.randn(int(near.sum()), num_experts, generator=generator).to(dtype)
    return logits.to(device)


def _routing_margins(logits: torch.Tensor, config: TopKConfig, bias: torch.Tensor | None) -> torch.Tensor:
    """Per row, the smallest gap between values whose order decides the routing."""
    x = logits.double()
    choice = x.softmax(-1) if config.scoring == "softmax" else x.sigmoid()
    if bias is not None:
        choice = choice + bias
    margins = torch.full((x.shape[0],), float("inf"), dtype=torch.float64)
    groups = config.num_expert_group or 1
    if groups > 1:
        grouped = choice.view(x.shape[0], groups, -1)
        group_scores = grouped.topk(2, -1).values.sum(-1) if bias is not None else grouped.amax(-1)
        ranked = group_scores.sort(-1, descending=True).values
        if config.topk_group < groups:
            margins = ranked[:, config.topk_group - 1] - ranked[:, config.topk_group]
        kept = (group_scores >= ranked[:, config.topk_group - 1:config.topk_group]).repeat_interleave(
            grouped.shape[2], -1)
        choice = choice.masked_fill(~kept, float("-inf"))
    best = choice.topk(min(config.top_k + 1, x.shape[1]), -1).values
    return torch.minimum(margins, (best[:, :-1] - best[:, 1:]).amin(-1))


def random_expert_lora(
    num_slots: int, num_experts: int, hidden: int, inter: int, slot_ranks: list[int], dtype: torch.dtype,
    device="cpu", coverage: float = 1.0, poison_unused: bool = False, generator: torch.Generator | None = None,
    max_rank: int | None = None, whole_experts: bool = False,
) -> ExpertLoRASlots:
    """Slot buffers of rank max_rank (default max(slot_ranks)); slot s has rank slot_ranks[s] (0: empty).

    coverage < 1 leaves a random subset of experts uncovered (rank 0) per slot: for each projection on its own
    (the kernels' hardest mix), or with whole_experts for all three at once (an adapter trained on some experts).
    poison_unused fills everything a correct kernel must not read (rows past the rank, uncovered
    experts) with NaN, so any stray read shows up in the output.
    """
    max_rank = max_rank or max(max(slot_ranks), 1)
    ranks = torch.tensor(slot_ranks, dtype=torch.int32).view(1, num_slots, 1).repeat(3, 1, num_experts)
    if coverage < 1.0:
        covered = torch.rand(1 if whole_experts else 3, num_slots, num_experts, generator=generator,
                             device=device).cpu() < coverage
        ranks = ranks * covered
    shapes = {"gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}
    tensors = {}
    for p, (name, (d_in, d_out)) in enumerate(shapes.items()):
        # A ~ 1/sqrt(in), B ~ 1/sqrt(rank): the delta is comparable to the base projection.
        a = torch.randn(num_slots, num_experts, max_rank, d_in, generator=generator, device=device) / d_in**0.5
        b = torch.randn(num_slots, num_experts, max_rank, d_out, generator=generator, device=device) / max_rank**0.5
        if poison_unused:
            r = torch.arange(max_rank, device=device)
            unused = r.view(1, 1, -1) >= ranks[p].to(device).unsqueeze(-1)  # [S, E, R]
            a = a.masked_fill(unused.unsqueeze(-1), float("nan"))
            b = b.masked_fill(unused.unsqueeze(-1), float("nan"))
        tensors[f"a_{name}"], tensors[f"b_{name}"] = a.to(dtype), b.to(dtype)
    return ExpertLoRASlots(**tensors, ranks=ranks.to(device), max_rank_in_use=max(slot_ranks))


def random_linear_lora(in_features: int, out_sizes: tuple[int, ...], slot_ranks: list[list[int]], dtype: torch.dtype,
                       device="cpu", poison_unused: bool = False, max_rank: int | None = None,
                       generator: torch.Generator | None = None) -> LinearLoRASlots:
    """Slot buffers of a dense layer with parts `out_sizes`; slot s adapts part p with rank slot_ranks[s][p]
    (0: not adapted). Past each rank (and in parts of rank 0) the buffers hold zeros, as the engine's slots do;
    poison_unused fills A there with NaN, which a correct kernel must not read, and B with finite garbage, which
    the GEMM's epilogue reads times xa's zeros."""
    ranks = torch.tensor(slot_ranks, dtype=torch.int32)
    max_rank = max_rank or max(int(ranks.max()), 1)
    num_slots, n_out = len(slot_ranks), sum(out_sizes)
    a = torch.randn(num_slots, len(out_sizes), max_rank, in_features, generator=generator) / in_features**0.5
    b = torch.randn(num_slots, max_rank, n_out, generator=generator) / max_rank**0.5
    part = torch.repeat_interleave(torch.arange(len(out_sizes)), torch.tensor(out_sizes))  # part of each out row
    unused_a = torch.arange(max_rank).view(1, 1, -1) >= ranks.unsqueeze(-1)  # [S, P, R]
    unused_b = torch.arange(max_rank).view(1, -1, 1) >= ranks[:, part].unsqueeze(1)  # [S, R, out]
    a = a.masked_fill(unused_a.unsqueeze(-1), float("nan") if poison_unused else 0.0)
    b = b.masked_fill(unused_b, 0.0)
    if poison_unused:
        b = torch.where(unused_b, 1e3 * torch.randn(b.shape, generator=generator), b)
    return LinearLoRASlots(a.to(device, dtype), b.to(device, dtype), ranks.to(device), int(ranks.max()))


def expert_share(lora: ExpertLoRASlots, experts: slice, inter: slice = slice(None)) -> ExpertLoRASlots:
    """The slot buffers of `experts` alone, and of each its rows `inter` of the intermediate dimension (B of
    gate and up, A of down), as the engine allocates them on a rank that holds that share (contiguous)."""
    def cut(t: torch.Tensor, rows: slice) -> torch.Tensor:
        return t[:, experts, :, rows].contiguous()
    return ExpertLoRASlots(cut(lora.a_gate, slice(None)), cut(lora.b_gate, inter), cut(lora.a_up, slice(None)),
                           cut(lora.b_up, inter), cut(lora.a_down, inter), cut(lora.b_down, slice(None)),
                           lora.ranks[:, :, experts].contiguous(), lora.max_rank_in_use)


def surrounded(t: torch.Tensor, pad: int, fill: float) -> torch.Tensor:
    """A contiguous copy of t that lies in storage `pad` elements longer at both ends, filled with `fill`
    there: a kernel that indexes past either end of t (a slot or expert -1, an expert id past the local
    ones) reads `fill`."""
    storage = torch.full((t.numel() + 2 * pad,), fill, dtype=t.dtype, device=t.device)
    inner = storage[pad:pad + t.numel()].view(t.shape)
    inner.copy_(t)
    return inner


def rank_runner(w13: torch.Tensor, w2: torch.Tensor, lora: ExpertLoRASlots | None, experts: slice,
                inter: slice = slice(None), backend: str = "torch") -> Runner:
    """The Runner of a rank holding `experts` of the whole layer w13 [E, 2I, H], w2 [E, H, I], lora, and of
    each the rows `inter` of the intermediate dimension, laid out so that any read beyond them shows up in the
    output: its weights are views into storage of all E experts where the others are NaN, and its LoRA slot
    buffers (this rank's experts only, as the engine has them) lie between NaN as large as a slot of all E
    experts at both ends, their ranks between claims of the full rank (a stray rank read then reads NaN rows)."""
    num_experts, hidden, full_inter = w2.shape
    rows = range(full_inter)[inter]
    runner = Runner(hidden, full_inter, num_experts, layer_id=0, backend=backend, experts=experts,
                    inter=slice(rows.start, rows.stop))
    gate_up = torch.cat([w13[:, :full_inter][:, inter], w13[:, full_inter:][:, inter]], dim=1)
    for param, w in ((runner.w13, gate_up), (runner.w2, w2[:, :, inter])):
        storage = torch.full_like(w, float("nan"))
        storage[experts] = w[experts]
        param.data = storage[experts]
    if lora is not None:
        mine = expert_share(lora, experts, inter)
        max_rank = lora.a_gate.shape[2]
        runner.lora = ExpertLoRASlots(
            **{n: surrounded(getattr(mine, n), num_experts * max_rank * getattr(mine, n).shape[-1], float("nan"))
               for n in ("a_gate", "b_gate", "a_up", "b_up", "a_down", "b_down")},
            ranks=surrounded(mine.ranks, lora.num_slots * num_experts, max_rank), max_rank_in_use=mine.max_rank_in_use)
    return runner


def record_compiles(monkeypatch) -> list[str]:
    """The names of the Triton kernels compiled from here on in this process (a compile Triton's disk cache
    answers counts too: each is a variant the process had not run yet)."""
    import triton
    compiled: list[str] = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook",
                        lambda *args, fn, **kwargs: compiled.append(fn.name))
    return compiled


def assert_gpu_finishes(seconds: float, what: str) -> None:
    """The work queued on the current CUDA stream finishes within `seconds`, else the test session ends (status 1)
    naming `what`: a kernel that spins on a counter (gemm_tiles.wait_arrivals) and waits forever ends it here,
    where a synchronize would hang the run; the tests after it could not run anyway (the GPU stays busy with it)."""
    import pytest  # here: the benchmarks import this module too
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + seconds
    while not done.query():
        if time.monotonic() > deadline:
            pytest.exit(f"{what}: not done after {seconds} s, a kernel waits forever (the GPU stays busy: the "
                        "session ends here)", returncode=1)
        time.sleep(0.01)


def rel_tolerance(dtype: torch.dtype, device: torch.device | str = "cpu") -> float:
    """Relative error allowed for a few roundings in `dtype` (fp32 tl.dot runs as tf32 on GPUs)."""
    if dtype == torch.float32:
        return 1e-5 if torch.device(device).type == "cpu" else 2 * 2.0**-10
    return 2 * torch.finfo(dtype).eps


def reordered_sums_tolerance(config: PretrainedConfig, logprobs: torch.Tensor) -> float:
    """The largest difference between fp32 log-probs `logprobs` of a model of `config` and those of a run that
    adds the same terms in other orders, as tensor and expert parallel ranks do (each rank sums its share of a
    projection's inputs, of an expert's intermediate rows or of a token's experts, and the all-reduce adds the
    shares): anything more is not rounding (a rank's partial sum lost or counted twice moves them by far more).
    - A sum of n terms, reordered, rounds differently by about sqrt(n) roundings of fp32 eps (the differences
      of its n - 1 independent roundings add as a random walk); n is the longest sum the ranks split.
    - Each of the L layers adds its output, so rounded, to the residual stream: the differences of all layers
      add up likewise, sqrt(n * L) roundings in the final hidden state.
    - Relative to the scale of what is summed: the logits' range, which a row of log-probs spans (their
      largest magnitude is at least it); log_softmax moves a log-prob by up to twice its row's largest logit
      change.
    - DeepSeek's routed_scaling_factor multiplies the routed experts' sum, reordered by the ranks, after it is
      rounded: its differences grow by that factor (2.5 for the tiny DeepSeek-V3, whose differences reached 1.6
      times the bound without it).
    The tiny test models' differences stay under 0.3 of this, one engine prompt's at 0.4; a rank's partial sum
    of the routed experts off by 1e-4 of itself already exceeds it."""
    n = max(getattr(config, name, None) or 0 for name in ("hidden_size", "intermediate_size", "moe_intermediate_size",
                                                          "shared_expert_intermediate_size"))
    scale = logprobs.abs().max().item()
    routed_scale = max(1.0, getattr(config, "routed_scaling_factor", None) or 1.0)
    return 2 * scale * routed_scale * torch.finfo(torch.float32).eps * (n * config.num_hidden_layers) ** 0.5


def assert_released(engine) -> None:
    """Nothing in flight; every request row, KV slot and adapter reference free again (KV slots: or cached)."""
    assert not engine.has_unfinished()
    assert engine.scheduler.accounting_error() is None
    cache = engine.scheduler.cache  # (prefix caching: what finished requests left cached, held by none)
    assert engine.scheduler.pool.free_slots + (cache.cached if cache is not None else 0) == engine.runner.kv.num_slots - 1
    assert cache is None or cache.evictable == cache.cached
    assert engine.scheduler.pool.free_rows == engine.config.max_running_requests
    assert engine.runner.lora.in_flight == {}


def out_of_gpu_memory_in(phase: str, monkeypatch, error: Exception | None = None) -> None:
    """Make the start's `phase` ("warm-up", "decode graphs" or "prompt graphs") raise `error` (by default the caching
    allocator's out-of-memory), the phases before it pass and the start run them all (faked: on a CPU it runs
    neither)."""
    def out_of_memory(runner_or_logits, *args, **kwargs):
        # raised, as a real one is, from a frame that holds the model (warm_up's runner, or the graphs' logits method)
        model = getattr(runner_or_logits, "__self__", runner_or_logits).model  # noqa: F841
        raise error or torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 38.00 MiB.")
    monkeypatch.setattr(EngineConfig, "warm_up_at_start", property(lambda self: True))
    monkeypatch.setattr(EngineConfig, "use_cuda_graph", property(lambda self: True))
    monkeypatch.setattr(model_runner, "GraphCapture", lambda device: None)  # a CUDA stream and memory pool
    monkeypatch.setattr(model_runner.ModelRunner, "warm_up",
                        out_of_memory if phase == "warm-up" else lambda self, max_tokens: None)
    monkeypatch.setattr(model_runner, "CudaGraphs", out_of_memory if phase == "decode graphs" else
                        lambda *args: "decode graphs")
    monkeypatch.setattr(model_runner, "PromptGraphs", out_of_memory)


def assert_rows_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "output") -> None:
    """Every row within tol relative error of the reference (rows whose reference is 0 must be 0)."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), f"{what}: non-finite values in rows {torch.nonzero(~torch.isfinite(out).all(-1)).flatten().tolist()}"
    err = (out - ref).norm(dim=-1)
    scale = ref.norm(dim=-1)
    bad = err > tol * scale
    assert not bad.any(), (
        f"{what}: rows {torch.nonzero(bad).flatten().tolist()[:10]} exceed relative error {tol:.2e} "
        f"(worst {(err / scale.clamp_min(1e-30)).max().item():.2e})"
    )


# ------------------------------------------------------------------ tiny transformers models

HIDDEN, MOE_INTER, DENSE_INTER, EXPERTS = 16, 6, 20, 4  # 2 * MOE_INTER != HIDDEN: layouts are told apart by shape
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3")
_COMMON = dict(vocab_size=32, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, num_experts_per_tok=2)
_MLA = dict(num_key_value_heads=2, moe_intermediate_size=MOE_INTER, intermediate_size=DENSE_INTER,
            n_routed_experts=EXPERTS, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=10,
            qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6, n_group=1, topk_group=1)
_FAMILY_CONFIGS = {
    "qwen3_moe": (Qwen3MoeConfig, dict(num_key_value_heads=1, head_dim=8, num_experts=EXPERTS, moe_intermediate_size=MOE_INTER,
                                       intermediate_size=DENSE_INTER, mlp_only_layers=[0])),
    "qwen2_moe": (Qwen2MoeConfig, dict(num_key_value_heads=1, num_experts=EXPERTS, moe_intermediate_size=MOE_INTER,
                                       intermediate_size=DENSE_INTER, shared_expert_intermediate_size=10)),
    "mixtral": (MixtralConfig, dict(num_key_value_heads=1, num_local_experts=EXPERTS, intermediate_size=MOE_INTER)),
    "olmoe": (OlmoeConfig, dict(num_key_value_heads=2, num_experts=EXPERTS, intermediate_size=MOE_INTER)),
    "deepseek_v2": (DeepseekV2Config, dict(**_MLA, q_lora_rank=None)),
    "deepseek_v3": (DeepseekV3Config, dict(**_MLA, q_lora_rank=12)),
}


def tiny_config(family: str, **overrides) -> PretrainedConfig:
    """2 layers; families with dense layers get layer 0 dense (Qwen via mlp_only_layers, DeepSeek via
    first_k_dense_replace). `overrides` are config fields of the family's config class."""
    config_class, fields = _FAMILY_CONFIGS[family]
    return config_class(**{**_COMMON, **fields, **overrides})


def tiny_model(config: PretrainedConfig, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def linear_suffixes(model: nn.Module) -> list[str]:
    """Last name of every nn.Linear in the decoder layers: PEFT target_modules for 'all of them'."""
    return sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n})


# ------------------------------------------------------------------ the tiny tokenizer, PEFT adapters, a random model with them

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


def build_random_demo(root: Path, adapters: dict[str, int], extra_tokens: list[str] = ()) -> None:
    """A tiny Qwen3-MoE with random weights (the engine, sampling and server tests' model): root/model
    (config, safetensors, tokenizer) and root/<name> for each adapter (name -> seed of its random LoRA
    weights, on attention and every routed expert). `extra_tokens`: added to the tokenizer (a reasoning
    model's <think> and </think>)."""
    from peft import LoraConfig

    tokenizer = tiny_tokenizer(vocab_size=1000)  # as many merges as its corpus has: whole words
    tokenizer.add_tokens(list(extra_tokens))
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


# what the bundled demo's adapters are tested for (tests/engine/test_demo.py, tests/server/test_demo_serving.py)

def upper_share(text: str) -> float:
    """Of the letters, the share in upper case."""
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(1, len(letters))


def title_share(text: str) -> float:
    """Of the words that begin with a letter, the share that begin with an upper-case one."""
    words = re.findall(r"[A-Za-z][\w']*", text)
    return sum(w[0].isupper() for w in words) / max(1, len(words))


# ------------------------------------------------------------------ real-size dummy checkpoints

QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                     moe_intermediate_size=768, norm_topk_prob=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
                     rope_parameters=dict(rope_type="default", rope_theta=1e6), tie_word_embeddings=False)
ATTENTION_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


# the same kind of model in a few MB, for running the same code on a CPU
TINY_QWEN3_MOE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      max_position_embeddings=4096)


def qwen3_30b_a3b_config(tiny: bool = False) -> Qwen3MoeConfig:
    """Qwen3-30B-A3B's config.json (tiny: TINY_QWEN3_MOE's sizes instead), as save_pretrained writes it."""
    config = Qwen3MoeConfig(**{**QWEN3_30B_A3B, **(TINY_QWEN3_MOE if tiny else {})})
    config.architectures = ["Qwen3MoeForCausalLM"]
    return config


# DeepSeek-V3's and Qwen3-235B-A22B's config.json sizes (the memory test; DeepSeek-V3 with fewer layers for the
# multi-GPU scaling benchmark)
DEEPSEEK_V3 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                   num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                   kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
                   n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
                   routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=163840,
                   rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                                        original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0,
                                        beta_fast=32, beta_slow=1))
QWEN3_235B_A22B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                       num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
                       num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
                       tie_word_embeddings=False)


def deepseek_v3_config(num_layers: int | None = None) -> DeepseekV3Config:
    """DeepSeek-V3's config.json, with num_layers decoder layers (the first dense, as many as the real one's
    three allow) when given."""
    fields = dict(DEEPSEEK_V3)
    if num_layers is not None:
        fields.update(num_hidden_layers=num_layers, first_k_dense_replace=min(3, max(1, num_layers // 4)))
    return DeepseekV3Config(**fields, architectures=["DeepseekV3ForCausalLM"])


def qwen3_235b_a22b_config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**QWEN3_235B_A22B, architectures=["Qwen3MoeForCausalLM"])


def write_dummy_checkpoint(config: PretrainedConfig, path: Path) -> Path:
    """config.json and the tiny tokenizer: all that load_format="dummy" reads. Prompts are token ids;
    ids past the tokenizer's vocabulary decode to no text."""
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def write_random_peft_adapter(config: PretrainedConfig, out_dir: Path, rank: int, seed: int, device: str = "cpu") -> Path:
    """A PEFT adapter on q/k/v/o and every routed expert of `config`'s model with random weights, written
    without building the model: PEFT wraps a copy on the meta device, so keys and shapes are exactly
    those its save_pretrained writes (target_parameters: fused 3D experts). A ~ N(0, 1/in),
    B ~ N(0, 1/rank), lora_alpha = rank: each delta is about as large as the projection of a
    dummy-weight model (std 0.02, in 768-2048)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file

    lora_config = LoraConfig(r=rank, lora_alpha=rank, target_modules=ATTENTION_MODULES, target_parameters=EXPERT_PARAMETERS)
    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(config), lora_config, low_cpu_mem_usage=True)
    gen = torch.Generator(device).manual_seed(seed)
    tensors = {}
    for name, meta in get_peft_model_state_dict(model).items():
        std = meta.shape[-1] ** -0.5 if ".lora_A." in name else rank**-0.5
        tensors[name] = (torch.randn(meta.shape, generator=gen, device=device) * std).to(torch.bfloat16).cpu()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "adapter_model.safetensors")
    model.peft_config["default"].save_pretrained(out_dir)
    return out_dir


# ------------------------------------------------------------------ batches over a KV cache


@dataclass
class RankMemory:
    weights: int
    lora_slots: int
    kv_per_token: int
    experts: list[range]  # per MoE layer, the routed experts the rank holds


def rank_memory(config: ModelConfig, state: ParallelState, dtype: torch.dtype, num_slots: int, max_rank: int,
                targets: Collection[str] | None = None) -> RankMemory:
    """What one rank of `state`'s layout holds, built on the meta device (nothing allocated), with `num_slots`
    LoRA slots of `max_rank` on `targets` (target modules; None: all)."""
    with parallel_state(state):
        model = build_model(config, dtype, "meta")
    allocate_lora_slots(model, num_slots, max_rank, targets)
    return RankMemory(sum(p.numel() * p.element_size() for p in model.parameters()), slot_bytes(model),
                      model.kv_cache_shape.bytes_per_token(dtype),
                      [range(m.experts.start, m.experts.stop) for m in model.modules() if isinstance(m, Runner)])


def toy_kv_cache(model, max_requests: int, max_context: int, dtype: torch.dtype | None = None) -> KVCache:
    """A KV cache for `model` (a moelora CausalLM) with a slot for every (request row, position), see `extend_batch`."""
    shape, weight = model.kv_cache_shape, model.model.embed_tokens.weight
    return KVCache(shape.num_layers, 1 + max_requests * max_context, shape.num_kv_heads, shape.k_head_dim,
                   shape.v_head_dim, max_requests, max_context, dtype or weight.dtype, weight.device)


def extend_batch(kv: KVCache, new_tokens: list[list[int]], prefix_lens: list[int] | None = None,
                 lora_slots: list[int] | None = None, num_decode: int | None = None) -> ForwardBatch:
    """A step in which sequence i (request row i of `kv`) adds new_tokens[i] after prefix_lens[i]
    tokens that earlier steps put in the cache; lora_slots[i] is its adapter slot (-1: none); the first
    num_decode sequences are decode rows (default: all if every sequence adds one token, else none).
    Position p of row r lives in cache slot 1 + r * max_context + p. Every new token gets logits."""
    prefix_lens = prefix_lens or [0] * len(new_tokens)
    extend_lens = [len(t) for t in new_tokens]
    rows = list(range(len(new_tokens)))
    for r, prefix in enumerate(prefix_lens):  # the prefix's slots, as earlier steps wrote them
        kv.req_to_token[r, :prefix] = 1 + r * kv.max_context + torch.arange(prefix, dtype=torch.int32)
    out_cache_loc = torch.tensor([1 + r * kv.max_context + p for r, prefix, n in zip(rows, prefix_lens, extend_lens)
                                  for p in range(prefix, prefix + n)], dtype=torch.int64)
    token_slots = [s for s, n in zip(lora_slots or [-1] * len(rows), extend_lens) for _ in range(n)]
    return ForwardBatch.build(kv, rows, new_tokens, prefix_lens, out_cache_loc, list(range(sum(extend_lens))),
                              token_slots, num_decode if num_decode is not None
                              else len(rows) if all(n == 1 for n in extend_lens) else 0)


def batch_logits(model, batch: ForwardBatch) -> torch.Tensor:
    """Logits [M, vocab] fp32 of the batch's logits_indices rows."""
    return model.compute_logits(model(batch)[batch.logits_indices])


class PagedAttentionInputs(NamedTuple):
    """The arguments of kernels.attention.attention, in order."""
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    extend_starts: torch.Tensor
    scale: float


def random_paged_attention(prefix_lens: list[int], extend_lens: list[int], num_q_heads: int, num_kv_heads: int,
                           k_dim: int, v_dim: int, dtype: torch.dtype, device="cpu", spare_slots: int = 64,
                           generator: torch.Generator | None = None) -> PagedAttentionInputs:
    """Sequences with cached prefixes whose cache slots are scattered at random (a random permutation),
    in random rows of req_to_token. Slot 0 (where req_to_token points past each length) and the spare
    slots hold NaN, so a key read past a sequence's end shows up in the output."""
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_seqs, num_slots = len(seq_lens), sum(seq_lens) + spare_slots + 1
    k_cache = torch.randn(num_slots, num_kv_heads, k_dim, generator=generator)
    v_cache = torch.randn(num_slots, num_kv_heads, v_dim, generator=generator)
    order = torch.randperm(num_slots - 1, generator=generator) + 1
    for cache in (k_cache, v_cache):
        cache[0] = cache[order[sum(seq_lens):]] = float("nan")
    req_to_token = torch.zeros(num_seqs + 3, max(seq_lens) + 5, dtype=torch.int32)
    rows = torch.randperm(num_seqs + 3, generator=generator)[:num_seqs].to(torch.int32)
    for row, n, first in zip(rows.tolist(), seq_lens, [sum(seq_lens[:i]) for i in range(num_seqs)]):
        req_to_token[row, :n] = order[first:first + n].to(torch.int32)
    starts = [sum(extend_lens[:i]) for i in range(num_seqs)]
    q = torch.randn(sum(extend_lens), num_q_heads, k_dim, generator=generator)
    ints = [torch.tensor(v, dtype=torch.int32, device=device) for v in (seq_lens, extend_lens, starts)]
    return PagedAttentionInputs(q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype),
                                req_to_token.to(device), rows.to(device), *ints, k_dim**-0.5)
