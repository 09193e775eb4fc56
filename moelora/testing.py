"""Random MoE layers and LoRA slot buffers for tests and benchmarks, dtype-derived tolerances, and a
tiny byte-level BPE tokenizer built offline."""
from __future__ import annotations

import torch

from moelora.kernels.fused_moe import ExpertLoRA
from moelora.layers.moe.topk import TopKOutput


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


def random_expert_lora(
    num_slots: int, num_experts: int, hidden: int, inter: int, slot_ranks: list[int], dtype: torch.dtype,
    device="cpu", coverage: float = 1.0, poison_unused: bool = False, generator: torch.Generator | None = None,
    max_rank: int | None = None,
) -> ExpertLoRA:
    """Slot buffers of rank max_rank (default max(slot_ranks)); slot s has rank slot_ranks[s] (0: empty).

    coverage < 1 leaves a random subset of experts uncovered (rank 0) per slot and projection.
    poison_unused fills everything a correct kernel must not read (rows past the rank, uncovered
    experts) with NaN, so any stray read shows up in the output.
    """
    max_rank = max_rank or max(max(slot_ranks), 1)
    ranks = torch.tensor(slot_ranks, dtype=torch.int32).view(1, num_slots, 1).repeat(3, 1, num_experts)
    if coverage < 1.0:
        covered = torch.rand(3, num_slots, num_experts, generator=generator, device=device).cpu() < coverage
        ranks = ranks * covered
    shapes = {"gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}
    tensors = {}
    for p, (name, (d_in, d_out)) in enumerate(shapes.items()):
        # A ~ 1/sqrt(in), B ~ 1/sqrt(rank): the delta is comparable to the base projection.
        a = torch.randn(num_slots, num_experts, max_rank, d_in, generator=generator, device=device) / d_in**0.5
        b = torch.randn(num_slots, num_experts, d_out, max_rank, generator=generator, device=device) / max_rank**0.5
        if poison_unused:
            r = torch.arange(max_rank, device=device)
            unused = r.view(1, 1, -1) >= ranks[p].to(device).unsqueeze(-1)  # [S, E, R]
            a = a.masked_fill(unused.unsqueeze(-1), float("nan"))
            b = b.masked_fill(unused.unsqueeze(-2), float("nan"))
        tensors[f"a_{name}"], tensors[f"b_{name}"] = a.to(dtype), b.to(dtype)
    return ExpertLoRA(**tensors, ranks=ranks.to(device), max_rank_in_use=max(slot_ranks))


def rel_tolerance(dtype: torch.dtype, device: torch.device | str = "cpu") -> float:
    """Relative error allowed for a few roundings in `dtype` (fp32 tl.dot runs as tf32 on GPUs)."""
    if dtype == torch.float32:
        return 1e-5 if torch.device(device).type == "cpu" else 2 * 2.0**-10
    return 2 * torch.finfo(dtype).eps


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


# Accents, CJK and emoji: characters of 2, 3 and 4 UTF-8 bytes, which a small vocabulary splits
# over several tokens.
_TOKENIZER_CORPUS = [
    "héllo wörld, naïve café, déjà vu",
    "你好，世界。日本語のテキスト",
    "🙂 🎉 emoji and text mixed 🙂🙂",
    "the quick brown fox jumps over the lazy dog. Hello world!",
]
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer (GPT-2/Qwen style) trained on a few lines, as a transformers
    PreTrainedTokenizerFast with EOS <|endoftext|>; no hub access."""
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
                                   clean_up_tokenization_spaces=False)
