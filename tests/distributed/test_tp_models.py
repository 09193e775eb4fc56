"""Every family on 2 and 4 gloo ranks, tensor parallel with the experts whole (ep 1) or split (ep 2, and 4
where the experts divide: Qwen2-MoE's 6 experts, 3 a rank at ep 2, do not), dispatched by all-reduce or
all-to-all, with and without LoRA (two adapters and the base model in one batch; an adapter on the experts of
one rank with adapters of ranks 4, 16 and 64; a spare slot and the experts' rows past each rank poisoned with
NaN), and DeepSeek-V3 routed so that the experts of one expert-parallel rank of two get no token: fp32 log-probs
of a prefill and a decode step equal the one-process run's within the rounding differences of the reordered sums
(tests.support.reordered_sums_tolerance)."""
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moelora.layers.moe.topk import TopK
from moelora.models.loader import load_model
from tests.distributed.model_cases import SEQUENCES, Case, check_layouts, num_experts
from tests.models.families import FAMILIES


def _cases(checkpoint, adapters, split_adapters, kinds: tuple[str, ...]) -> dict[tuple[str, str], Case]:
    """kinds: "base" (no adapter), "lora" (two adapters and base-model sequences in one batch), "split" (an
    adapter on the first half of the experts alone, which one expert-parallel rank of two holds, and adapters
    of ranks 4, 16 and 64, all in one batch)."""
    cases = {}
    for family in FAMILIES:
        found = adapters(family)
        if "split" in kinds:
            split = split_adapters(family)
            cases[family, "split"] = Case(str(checkpoint(family)), tuple(split[n] for n in ("first_half", "r4", "r16", "r64")),
                                          (0, 1, 2, 3, 0), max_rank=64)
        if "base" in kinds:
            cases[family, "base"] = Case(str(checkpoint(family)))
        if "lora" in kinds:
            cases[family, "lora"] = Case(str(checkpoint(family)), (str(found["full"].path), str(found["partial"].path)),
                                     (0, -1, 1, 0, 1))
    return cases


def test_two_ranks_equal_one(checkpoint, adapters, split_adapters):
    check_layouts(2, [(1, "all_reduce"), (2, "all_reduce"), (2, "all_to_all")],
                  _cases(checkpoint, adapters, split_adapters, ("base", "lora", "split")))


def test_four_ranks_equal_one(checkpoint, adapters, split_adapters):
    # not the split adapters (four ranks share two cores here); the base model alone too: a LoRA batch's
    # base-model sequences still take the kernels' LoRA paths (slot -1), a model without slot buffers the others
    check_layouts(4, [(1, "all_reduce"), (2, "all_to_all"), (4, "all_reduce"), (4, "all_to_all")],
                  _cases(checkpoint, adapters, split_adapters, ("base", "lora")))


def _routed_to_first_half(checkpoint: Path, out: Path) -> str:
    """A copy of the DeepSeek-V3 checkpoint whose correction bias, which picks the experts but leaves their weights
    alone, is 10 higher on the first half of the experts of every MoE layer: above any other expert's biased score
    (sigmoid scores are in (0, 1)), whatever the token or its adapter's router LoRA."""
    shutil.copytree(checkpoint, out)
    tensors = load_file(out / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith("mlp.gate.e_score_correction_bias"):
            t[:t.shape[0] // 2] += 10.0
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return str(out)


def test_a_rank_whose_experts_get_no_tokens(checkpoint, adapters, tmp_path):
    """Every token's experts among those ep rank 0 of 2 holds: rank 1's experts get no pair in any step (a prefill,
    a decode of five tokens and one of a single token), by all-reduce and all-to-all; the logits are still one
    process's."""
    path = _routed_to_first_half(checkpoint("deepseek_v3"), tmp_path / "model")
    gates = [m for m in load_model(path, torch.float32, "cpu").modules() if isinstance(m, TopK)]
    hidden = torch.randn(64, gates[0].in_features, generator=torch.Generator().manual_seed(0)) * 10
    assert gates and all(g(hidden).ids.max() < num_experts("deepseek_v3") // 2 for g in gates)
    full = str(adapters("deepseek_v3")["full"].path)
    check_layouts(2, [(2, "all_reduce"), (2, "all_to_all")], {
        ("deepseek_v3", "rank 1 idle"): Case(path, (full,), (0, -1, 0, -1, 0)),
        ("deepseek_v3", "rank 1 idle, one token"): Case(path, (full,), (0,), sequences=SEQUENCES[:1])})
