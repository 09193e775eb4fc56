"""The routed experts' LoRA of each file format -> per-expert (A [n, r, in], B [n, out, r]) pieces.

PEFT target_parameters (ParamWrapper on a fused 3D parameter) stores A [E*r, X] read as (E, r, X)
and B [Y, E*r] read as (Y, r, E), expert index fastest (or (Y, E, r) with Unsloth's
`lora_B_layout: grouped_by_expert`). PEFT >= 0.19.1 writes X = in, Y = out of the projection;
0.17-0.18 took X, Y from dims 1, 2 of the [E, out, in] parameter, so X = out, Y = in and the
roles swap: the projection's A is B^T per expert, its B is A^T.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora.lora.config import AdapterConfig
from moelora.lora.errors import AdapterError
from moelora.lora.formats import Kind, LoRAPair
from moelora.lora.model_shapes import ModelShapes, format_ranges

PARAM_NAMES = {"gate_up": "gate_up_proj", "down": "down_proj"}  # transformers v5 fused expert parameters


@dataclass
class ExpertPiece:
    """LoRA of some experts of one (layer, projection) as found in one A/B pair, scaling not applied."""
    projection: str        # 'gate', 'up', 'down'
    experts: list[int]
    a: torch.Tensor        # [n, r, in]
    b: torch.Tensor        # [n, out, r]
    peft_path: str         # for rank/alpha patterns
    keys: tuple[str, str]
    scaling: float = 0.0   # set by the loader once the rank is checked against the config

    @property
    def rank(self) -> int:
        return self.a.shape[1]


def expert_pieces(pair: LoRAPair, wrappers: set[str], shapes: ModelShapes, config: AdapterConfig) -> list[ExpertPiece]:
    """Pieces of one expert pair; `wrappers`: the ParamWrapper pairs (inner/outer) present in its layer."""
    if pair.layer not in shapes.moe_layers:
        raise AdapterError(f"{pair.a_key}: layer {pair.layer} of this {shapes.model_type} model has no routed experts "
                           f"(MoE layers: {format_ranges(shapes.moe_layers)})")
    if pair.kind is Kind.EXPERT_MODULE:
        return [_expert_module(pair, shapes)]
    if pair.kind is Kind.STACKED:
        return _split_gate_up(pair.name, *_stacked(pair, shapes), pair, pair.peft_path, shapes)
    param, a, b = _param_wrapper(pair, wrappers, shapes, config)
    return _split_gate_up(param, a, b, pair, f"{pair.peft_path}.{PARAM_NAMES[param]}", shapes)


def _expert_module(pair: LoRAPair, shapes: ModelShapes) -> ExpertPiece:
    if pair.expert >= shapes.num_experts:
        raise AdapterError(f"{pair.a_key}: expert {pair.expert} out of range (the model has {shapes.num_experts} experts)")
    a, b = pair.a, pair.b
    in_f, out_f = shapes.expert_shape(pair.name)
    a_fits, b_fits = a.ndim == 2 and a.shape[1] == in_f, b.ndim == 2 and b.shape[0] == out_f
    if not (a_fits and b_fits and a.shape[0] == b.shape[1]):
        raise pair.misfit(a_fits, b_fits, f"expert {pair.name}", f"A [r, {in_f}], B [{out_f}, r]")
    return ExpertPiece(pair.name, [pair.expert], a[None], b[None], pair.peft_path, (pair.a_key, pair.b_key))


def _stacked(pair: LoRAPair, shapes: ModelShapes) -> tuple[torch.Tensor, torch.Tensor]:
    """A [E or 1, r, in], B [E or 1, out, r]; a side with E = 1 is shared by all experts."""
    a, b, e = pair.a, pair.b, shapes.num_experts
    in_f, out_f = _projection_shape(pair.name, shapes)
    a_fits = a.ndim == 3 and a.shape[0] in (1, e) and a.shape[2] == in_f
    b_fits = b.ndim == 3 and b.shape[0] in (1, e) and b.shape[1] == out_f
    if not (a_fits and b_fits and a.shape[1] == b.shape[2]):
        raise pair.misfit(a_fits, b_fits, f"stacked experts {pair.name}",
                          f"A [{e} or 1, r, {in_f}], B [{e} or 1, {out_f}, r]")
    return a.expand(e, -1, -1), b.expand(e, -1, -1)


def _param_wrapper(pair: LoRAPair, wrappers: set[str], shapes: ModelShapes,
                   config: AdapterConfig) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(parameter 'gate_up' | 'down', A [E, r, in], B [E, out, r]) of a ParamWrapper pair."""
    a, b, e = pair.a, pair.b, shapes.num_experts
    params = wrapped_params(pair, wrappers, config)
    layouts = [(param, fixed, *((i, o) if fixed else (o, i)))  # (param, orientation, A's columns, B's rows)
               for param in params for i, o in [_projection_shape(param, shapes)] for fixed in (True, False)]
    a_fits = a.ndim == 2 and a.shape[0] % e == 0 and any(a.shape[1] == x for *_, x, _ in layouts)
    b_fits = b.ndim == 2 and b.shape[1] % e == 0 and any(b.shape[0] == y for *_, y in layouts)
    candidates = [(param, fixed) for param, fixed, x, y in layouts
                  if a_fits and b_fits and (a.shape[1], b.shape[0]) == (x, y)]
    if not (candidates and a.shape[0] == b.shape[1]):
        expected = " or ".join(f"{PARAM_NAMES[p]} A [{e}*r, {i}], B [{o}, {e}*r]"
                               for p in params for i, o in [_projection_shape(p, shapes)])
        alone = bool(candidates) or not (a_fits and b_fits)  # else each fits some layout, but not the same one
        raise pair.misfit(a_fits and alone, b_fits and alone, f"a target_parameters LoRA of {e} experts",
                          f"{expected}, or in/out swapped as peft < 0.19.1 wrote")
    if len(candidates) > 1:  # only when dims coincide (e.g. hidden == 2 * intermediate): PEFT's version decides
        candidates = [c for c in candidates if c[1] == config.param_orientation_fixed()]
        if len(candidates) != 1:
            raise AdapterError(f"{pair.a_key}: A {tuple(a.shape)} / B {tuple(b.shape)} fit both the peft >= 0.19.1 "
                               f"and the older orientation, and peft_version={config.peft_version!r} does not decide")
    (param, fixed), = candidates
    r = a.shape[0] // e
    a3 = a.reshape(e, r, a.shape[1])
    if config.lora_b_layout == "grouped_by_expert":
        b3 = b.reshape(b.shape[0], e, r).permute(1, 0, 2)
    else:
        b3 = b.reshape(b.shape[0], r, e).permute(2, 0, 1)
    if fixed:
        return param, a3, b3
    return param, b3.transpose(1, 2), a3.transpose(1, 2)


def wrapped_params(pair: LoRAPair, wrappers: set[str], config: AdapterConfig) -> list[str]:
    """The fused parameter(s), 'gate_up' and/or 'down', a ParamWrapper pair can belong to; the shapes
    decide between two. PEFT wraps parameters in definition order: the inner wrapper (base_layer)
    is gate_up_proj, the outer one down_proj; a lone wrapper is what target_parameters names."""
    if pair.name == "inner" or "inner" in wrappers:
        return ["gate_up" if pair.name == "inner" else "down"]
    named = [p for p, n in PARAM_NAMES.items() if config.targets_parameter(f"{pair.peft_path}.{n}")]
    return named if len(named) == 1 else list(PARAM_NAMES)


def _split_gate_up(name: str, a: torch.Tensor, b: torch.Tensor, pair: LoRAPair, peft_path: str,
                   shapes: ModelShapes) -> list[ExpertPiece]:
    """gate_up splits into gate and up by halves of the output (transformers' chunk(2)); each keeps A."""
    experts, keys = list(range(shapes.num_experts)), (pair.a_key, pair.b_key)
    if name != "gate_up":
        return [ExpertPiece(name, experts, a, b, peft_path, keys)]
    i = shapes.moe_intermediate_size
    return [ExpertPiece("gate", experts, a, b[:, :i], peft_path, keys),
            ExpertPiece("up", experts, a, b[:, i:], peft_path, keys)]


def _projection_shape(name: str, shapes: ModelShapes) -> tuple[int, int]:
    if name == "gate_up":
        return shapes.hidden_size, 2 * shapes.moe_intermediate_size
    return shapes.expert_shape(name)

