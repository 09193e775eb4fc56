"""Adapters in each layout the loader reads that PEFT does not write (tests.lora.lora_builders.HAND_FORMATS: the
routed experts' target_parameters LoRA in PEFT 0.17-0.18's orientation and in older Unsloth's grouped_by_expert
layout, stacked 3D experts under their three namings and with shared outer sides, fused qkv_proj / gate_up_proj
linears), written for Qwen2-MoE's tiny checkpoint, in six slots of one batch with base-model sequences, at tp 2
with the experts whole (ep 1) and split (ep 2, by all-reduce and all-to-all): fp32 log-probs of a prefill and a
decode step equal the one-process run's within the rounding differences of the reordered sums
(tests.support.reordered_sums_tolerance). The formats PEFT writes run in test_tp_models.

Every adapter's routed-expert LoRA counts: the one-process log-probs of each adapter's sequences move by far more
than that tolerance when the adapters are served without it (Case.routed_experts=False, what a loader that
dropped it would serve), so a format whose experts were lost or mis-sharded cannot pass."""
from dataclasses import replace

from tests.distributed.model_cases import SEQUENCES, Case, check_layouts, run_case
from tests.lora.lora_builders import HAND_FORMATS
from tests.models.families import family_config, hf_model
from tests.support import reordered_sums_tolerance

# fused qkv (with a bias), dense MLPs and a shared expert for the fused linears; 6 experts, 3 a rank at ep 2
FAMILY = "qwen2_moe"
RANKS = (2, 3, 4, 5, 6, 8)  # per format: different ranks, up to the slots' max rank
SEQS = (*SEQUENCES, (12, 40, 6, 6, 81), (3, 3, 90), (44, 45, 46, 47, 48, 49))
SLOTS = (0, 1, -1, 2, 3, 4, -1, 5)  # per sequence (-1: base model)
# how far the routed experts' LoRA must move an adapter's log-probs: not rounding, which the tolerance bounds
EXPERTS_MOVE = 100


def _rows(step: int, sequence: int) -> slice:
    """The sequence's logits rows in the step's logits (the prefill gives each token but the last one a row)."""
    if step == 1:
        return slice(sequence, sequence + 1)
    start = sum(len(s) - 1 for s in SEQS[:sequence])
    return slice(start, start + len(SEQS[sequence]) - 1)


def test_hand_formats_at_two_ranks_equal_one(checkpoint, tmp_path):
    model = hf_model(family_config(FAMILY))
    assert len(HAND_FORMATS) == len(RANKS) == max(SLOTS) + 1
    paths = tuple(str(write(model, rank, 2 * rank, seed=i).write(tmp_path / f"format-{i}"))
                  for i, (write, rank) in enumerate(zip(HAND_FORMATS.values(), RANKS)))
    case = Case(str(checkpoint(FAMILY)), paths, SLOTS, sequences=SEQS)
    want = check_layouts(2, [(1, "all_reduce"), (2, "all_reduce"), (2, "all_to_all")],
                         {(FAMILY, "hand formats"): case})[FAMILY, "hand formats"]

    without = run_case(replace(case, routed_experts=False))
    for step, (w, wo) in enumerate(zip(want, without)):
        tolerance = reordered_sums_tolerance(family_config(FAMILY), w.log_softmax(-1))
        for sequence, slot in enumerate(SLOTS):
            if slot < 0:
                continue
            rows = _rows(step, sequence)
            moved = (w[rows].log_softmax(-1) - wo[rows].log_softmax(-1)).abs().max().item()
            assert moved > EXPERTS_MOVE * tolerance, (
                f"{list(HAND_FORMATS)[slot]}: its routed experts' LoRA moves the log-probs of step {step} by "
                f"{moved:.2e} only (tolerance {tolerance:.1e})")
