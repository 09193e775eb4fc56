"""One model step pair (a prefill of several sequences with adapters mixed, then a decode step) run alike at
one rank and on every rank of a world, and the check that every layout's logits equal one process's."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moelora.core import ExpertLoRASlots, LinearLoRASlots
from moelora.distributed.state import get_parallel, parallel_state
from moelora.engine.lora_slots import allocate_lora_slots, write_adapter_to_slot
from moelora.lora import load_adapter, load_model_shapes
from moelora.models.config import ModelConfig
from moelora.models.loader import load_model
from tests.distributed.ranks import run_ranks
from tests.models.families import assert_logprobs_close, family_config
from tests.support import batch_logits, extend_batch, reordered_sums_tolerance, toy_kv_cache

SEQUENCES = ((5, 17, 2, 93, 41, 8, 8, 60, 3), (11, 4, 77), (30, 1, 2, 3, 4, 5, 6), (9, 9), (70, 2, 50, 1))


@dataclass(frozen=True)
class Case:
    checkpoint: str
    adapters: tuple[str, ...] = ()  # in slots 0, 1, ...; one more slot, never used, is poisoned with NaN, and so
    #                                 are the experts' rows past each adapter's rank
    slots: tuple[int, ...] = ()     # per sequence (-1: base model); none: all base
    max_rank: int = 8
    sequences: tuple[tuple[int, ...], ...] = SEQUENCES
    routed_experts: bool = True     # False: the adapters without their routed experts' LoRA, as a loader that
    #                                 dropped it would serve them


def run_case(case: Case) -> list[torch.Tensor]:
    """[prefill logits, decode logits] of the case's sequences (all but the last token, then the last) with their
    slots."""
    model = load_model(case.checkpoint, dtype=torch.float32, device="cpu")
    sequences = [list(s) for s in case.sequences]
    slots = list(case.slots) or [-1] * len(sequences)
    if case.adapters:
        shapes = load_model_shapes(case.checkpoint)
        allocate_lora_slots(model, len(case.adapters) + 1, case.max_rank)
        for slot, path in enumerate(case.adapters):
            adapter = load_adapter(path, shapes)
            if not case.routed_experts:
                for layer in adapter.layers.values():
                    layer.experts.clear()
            write_adapter_to_slot(model, adapter, slot)
        _poison_past_ranks(model)
        _poison_slot(model, len(case.adapters))
    kv = toy_kv_cache(model, len(sequences), 16)
    prefill = batch_logits(model, extend_batch(kv, [s[:-1] for s in sequences], lora_slots=slots))
    decode = batch_logits(model, extend_batch(kv, [s[-1:] for s in sequences], [len(s) - 1 for s in sequences], slots))
    return [prefill, decode]


def _poison_past_ranks(model: torch.nn.Module) -> None:
    """NaN in the rows of the experts' slot buffers past each (slot, expert)'s rank (all of them for the experts
    an adapter leaves out), on each rank in the buffers of its share of the experts and rows as written there:
    a read past the rank a (slot, expert) claims, or a claim above what was written for it there, turns NaN.
    (Dense layers' buffers stay zero there, as LinearLoRASlots promises.)"""
    for m in model.modules():
        lora = getattr(m, "lora", None)
        if isinstance(lora, ExpertLoRASlots):
            rows = torch.arange(lora.a_gate.shape[2])
            for p, name in enumerate(("gate", "up", "down")):
                past = (rows >= lora.ranks[p, :, :, None])[..., None]  # [S, E, R, 1]
                for t in (getattr(lora, f"a_{name}"), getattr(lora, f"b_{name}")):
                    t.masked_fill_(past, float("nan"))


def _poison_slot(model: torch.nn.Module, slot: int) -> None:
    """NaN in every buffer of the slot and its full rank claimed everywhere: a token of another slot that read
    any of it would turn NaN."""
    for m in model.modules():
        lora = getattr(m, "lora", None)
        if isinstance(lora, (ExpertLoRASlots, LinearLoRASlots)):
            for name, t in vars(lora).items():
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    t[slot].fill_(float("nan"))
            max_rank = (lora.a_gate if isinstance(lora, ExpertLoRASlots) else lora.a).shape[2]
            if isinstance(lora, ExpertLoRASlots):
                lora.ranks[:, slot] = max_rank
            else:
                lora.ranks[slot] = max_rank


def run_layouts(layouts: list[tuple[int, str]], cases: list[Case]) -> dict | None:
    """On each rank of the world: every case under every (ep_size, moe_dispatch) layout whose ep_size divides
    the case's experts; rank 0 returns {(ep_size, dispatch, case index): logits}."""
    world = get_parallel()
    out = {}
    for ep_size, dispatch in layouts:
        with parallel_state(replace(world, ep_size=ep_size, moe_dispatch=dispatch)):
            for i, case in enumerate(cases):
                if ModelConfig.from_pretrained(case.checkpoint).num_experts % ep_size == 0:
                    out[ep_size, dispatch, i] = run_case(case)
    return out if world.rank == 0 else None


def num_experts(family: str) -> int:
    config = family_config(family)
    return next(getattr(config, n) for n in ("num_experts", "num_local_experts", "n_routed_experts") if hasattr(config, n))


def check_layouts(world: int, layouts: list[tuple[int, str]], cases: dict[tuple[str, str], Case]
                  ) -> dict[tuple[str, str], list[torch.Tensor]]:
    """Every case (keyed by family and what it is) on `world` gloo ranks under every (ep_size, moe_dispatch)
    layout whose ep_size divides the family's experts (some of which must split them): fp32 log-probs of the
    prefill and the decode step equal the one-process run's within reordered_sums_tolerance. Returns the
    one-process logits."""
    got = run_ranks(world, run_layouts, layouts, list(cases.values()))[0]
    wants = {}
    for i, ((family, kind), case) in enumerate(cases.items()):
        wants[family, kind] = want = run_case(case)
        split = [(ep_size, dispatch) for ep_size, dispatch in layouts if num_experts(family) % ep_size == 0]
        assert any(ep_size > 1 for ep_size, _ in split), f"tp {world}: {family}'s experts are never split"
        for ep_size, dispatch in split:  # (run_layouts skipped the others too)
            for step, g, w in zip(("prefill", "decode"), got[ep_size, dispatch, i], want):
                tolerance = reordered_sums_tolerance(family_config(family), w.log_softmax(-1))
                assert_logprobs_close(g, w, f"tp {world} ep {ep_size} {dispatch}: {family} {kind} {step}", tolerance)
    return wants
