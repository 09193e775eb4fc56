"""GPU slots of a model's LoRA layers: `allocate_lora_slots` gives the LoRA-able Linear and Runner layers of
the target modules zeroed buffers for `num_slots` adapters up to `max_rank`; `write_adapter_to_slot` puts one
canonical adapter into one slot of all of them (the LoRA manager calls both). A layer without buffers keeps
`lora = None` and launches no LoRA kernels.

Target modules are named as the decoder layer names them ("self_attn.q_proj", "mlp.gate" the router,
"mlp.shared_expert.gate_proj"), the routed experts' projections "mlp.experts.gate_proj" / "up_proj" /
"down_proj"; EngineConfig.lora_target_modules names them by their last name, as SGLang's
--lora-target-modules does ("gate_proj" is every gate_proj: dense MLPs, shared and routed experts).

Under tensor and expert parallelism the buffers are this rank's: a layer's shard of each projection and the
experts it holds, and the adapter's A and B are cut as the weights are (a column-parallel part's rows of B, a
row-parallel layer's columns of A; the experts' rows likewise over their intermediate dimension). Adapters are
still checked against the whole model's shapes; `share_of` then cuts one to this rank (`RankShare`), which is
what the LoRA manager keeps in host memory and `write_share_to_slot` copies: each rank holds its share of an
adapter, not all of it."""
from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moelora.core import ExpertLoRASlots, LinearLoRASlots
from moelora.layers.linear import Linear
from moelora.layers.moe.runner import Runner
from moelora.lora.canonical import Adapter, ExpertsLoRA, LayerLoRA, LinearLoRA
from moelora.lora.errors import AdapterError
from moelora.lora.model_shapes import EXPERT_PROJECTIONS, FUSED_MODULES, format_ranges

logger = logging.getLogger(__name__)

# the canonical adapter's expert projection -> its target module name
EXPERT_MODULES = {p: f"mlp.experts.{p}_proj" for p in EXPERT_PROJECTIONS}


def _lora_layers(model: nn.Module) -> list[Linear | Runner]:
    return [m for m in model.modules() if isinstance(m, Runner) or (isinstance(m, Linear) and m.part_names)]


def _modules_of(m: Linear | Runner) -> tuple[str, ...]:
    """The target modules a LoRA layer serves: its parts."""
    return tuple(EXPERT_MODULES.values()) if isinstance(m, Runner) else m.part_names


def _short(module: str) -> str:
    """The --lora-target-modules name of a module: its last name."""
    return module.rpartition(".")[2]


def model_modules(model: nn.Module) -> list[str]:
    """The model's LoRA-able target modules, in the order of its layers."""
    return list(dict.fromkeys(name for m in _lora_layers(model) for name in _modules_of(m)))


def slotted_modules(model: nn.Module) -> list[str]:
    """The target modules that have slot buffers (every part of a Linear that has them, targeted or not)."""
    return list(dict.fromkeys(name for m in _lora_layers(model) if m.lora is not None for name in _modules_of(m)))


def adapted_layers(adapter: Adapter) -> dict[str, tuple[int, ...]]:
    """The target modules an adapter adapts, each with the layers it adapts it in."""
    layers: dict[str, list[int]] = defaultdict(list)
    for layer_id, layer in sorted(adapter.layers.items()):
        for name in (*(EXPERT_MODULES[p] for p in layer.experts), *layer.modules):
            layers[name].append(layer_id)
    return {name: tuple(ids) for name, ids in layers.items()}


def resolve_targets(requested: Sequence[str] | str | None, model: nn.Module, adapted: Iterable[Collection[str]]
                    ) -> frozenset[str]:
    """The target modules that get slot buffers, from EngineConfig.lora_target_modules: "all"; names (the last
    name of modules, SGLang's qkv_proj and gate_up_proj for their parts); or None: the modules the adapters at start
    adapt (`adapted`: each one's), all of them when they adapt none (no adapters at start: any may be loaded
    later). ValueError for a name the model lacks."""
    modules, adapted = model_modules(model), frozenset().union(*adapted)
    if requested == "all" or (requested is None and not adapted):
        return frozenset(modules)
    if requested is None:  # by module, not last name: an experts-only adapter gives dense MLPs no slots
        return adapted
    short = set(map(_short, modules))
    valid = short | {fused for fused, parts in FUSED_MODULES.items() if set(parts) <= short}
    unknown = [n for n in requested if n not in valid]
    if unknown:
        raise ValueError(f"EngineConfig.lora_target_modules (--lora-target-modules): the model has no module "
                         f"{', '.join(map(repr, unknown))}; its modules are {', '.join(sorted(valid))}, or all")
    names = {part for n in requested for part in FUSED_MODULES.get(n, (n,))}
    return frozenset(m for m in modules if _short(m) in names)


def allocate_lora_slots(model: nn.Module, num_slots: int, max_rank: int, targets: Collection[str] | None = None
                        ) -> None:
    """Slot buffers for every layer with a part among `targets` (target modules, see resolve_targets; None: all)."""
    for m, shapes in _slot_shapes(model, num_slots, max_rank, targets):
        weight = _weight(m)
        buffers = {name: torch.zeros(shape, dtype=torch.int32 if name == "ranks" else weight.dtype,
                                     device=weight.device) for name, shape in shapes.items()}
        m.lora = (ExpertLoRASlots if isinstance(m, Runner) else LinearLoRASlots)(**buffers)


def slot_buffer_bytes(model: nn.Module, num_slots: int, max_rank: int, targets: Collection[str] | None = None) -> int:
    """Bytes allocate_lora_slots would allocate, before it does (a request for more than there is: an error, not an
    allocation that fails, or that the system's out-of-memory killer ends)."""
    total = 0
    for m, shapes in _slot_shapes(model, num_slots, max_rank, targets):
        element = _weight(m).element_size()
        total += sum(math.prod(shape) * (4 if name == "ranks" else element) for name, shape in shapes.items())
    return total


def _weight(m: Linear | Runner) -> torch.Tensor:
    """The layer's weight (the experts' gate/up for a Runner): its dtype and device are its slot buffers'."""
    return m.w13 if isinstance(m, Runner) else m.weight


def _slot_shapes(model: nn.Module, s: int, r: int, targets: Collection[str] | None
                 ) -> Iterator[tuple[Linear | Runner, dict[str, tuple[int, ...]]]]:
    """Each layer that gets slot buffers, with their shapes (ranks int32, the others the layer's weights' dtype)."""
    for m in _lora_layers(model):
        if targets is not None and not any(name in targets for name in _modules_of(m)):
            continue
        if isinstance(m, Runner):
            e, h, i = m.num_experts, m.hidden_size, m.intermediate_size
            yield m, dict(a_gate=(s, e, r, h), b_gate=(s, e, r, i), a_up=(s, e, r, h), b_up=(s, e, r, i),
                          a_down=(s, e, r, i), b_down=(s, e, r, h), ranks=(3, s, e))
        else:
            parts = len(m.out_sizes)
            yield m, dict(a=(s, parts, r, m.in_features), b=(s, r, m.out_features), ranks=(s, parts))


def slot_bytes(model: nn.Module) -> int:
    """Bytes of the model's LoRA slot buffers (this rank's, under tensor or expert parallelism)."""
    return sum(t.numel() * t.element_size() for m in _lora_layers(model) if m.lora is not None
               for t in vars(m.lora).values() if isinstance(t, torch.Tensor))


@dataclass
class RankShare:
    """An adapter cut to this rank's slot buffers (share_of): per layer, the pieces of A and B that
    write_share_to_slot copies, this rank's experts and rows, in the canonical layout."""
    path: Path
    layers: dict[int, LayerLoRA]
    max_rank: int  # the whole adapter's
    modules: dict[str, tuple[int, ...]]  # the whole adapter's target modules, with the layers it adapts them in
    version: tuple[tuple[str, int, int], ...] = ()  # Adapter.version: its files' when they were read

    def num_bytes(self) -> int:
        """Bytes of the A and B pieces held here."""
        return sum(t.numel() * t.element_size() for layer in self.layers.values()
                   for m in (*layer.experts.values(), *layer.modules.values()) for t in (m.a, m.b))


def share_of(model: nn.Module, adapter: Adapter) -> RankShare:
    """The part of `adapter` this rank's layers take, in tensors of its own (the whole adapter's memory is freed
    with it); the adapter already checked against the model's shapes (fit_problems). Cut whether or not the layers
    have slot buffers yet: the LoRA manager cuts the adapters given at start before it sizes the slots."""
    layers: dict[int, LayerLoRA] = defaultdict(LayerLoRA)
    for m in _lora_layers(model):
        layer = adapter.layers.get(m.layer_id)
        if layer is None:
            continue
        if isinstance(m, Runner):
            e, rows = m.experts, m.inter
            for name, lora in layer.experts.items():
                # down: this rank's columns of A (its intermediate rows); gate and up: its rows of B
                a, b = (lora.a[e, :, rows], lora.b[e]) if name == "down" else (lora.a[e], lora.b[e, rows])
                layers[m.layer_id].experts[name] = ExpertsLoRA(_owned(a, lora.a), _owned(b, lora.b),
                                                               lora.ranks[e].clone(), lora.scaling[e].clone(),
                                                               lora.keys)
            continue
        for name, rows in zip(m.part_names, m.out_shards):
            lora = layer.modules.get(name)
            if lora is not None:
                layers[m.layer_id].modules[name] = LinearLoRA(_owned(lora.a[:, m.in_shard], lora.a),
                                                              _owned(lora.b[rows], lora.b), lora.scaling, lora.keys)
    return RankShare(adapter.path, dict(layers), adapter.max_rank, adapted_layers(adapter), adapter.version)


def staged_share(model: nn.Module, share: RankShare) -> RankShare:
    """`share` as write_share_to_slot copies it to the GPU without the host waiting: each tensor in the dtype of its
    slot buffer and laid out as the copy reads it (B transposed, the view keeping the canonical shape), in
    page-locked memory. A copy from pageable memory waits for the stream's queued work first, so an adapter written
    into a slot would stall the host until the step in flight had finished (overlap scheduling). Where page-locked
    memory runs out the share stays pageable (its slot writes then wait), with a warning."""
    try:
        return _staged(model, share, pin=True)
    except RuntimeError as e:
        logger.warning("adapter %s stays in pageable host memory (%s): putting it into a GPU slot waits for the "
                       "step in flight", share.path, e)
        return _staged(model, share, pin=False)


def _staged(model: nn.Module, share: RankShare, pin: bool) -> RankShare:
    def staged(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        t = t.to(dtype).contiguous()
        return t.pin_memory() if pin else t

    layers: dict[int, LayerLoRA] = {}
    for m in _lora_layers(model):
        layer = share.layers.get(m.layer_id)
        if layer is None:
            continue
        dtype = _weight(m).dtype
        layers[m.layer_id] = LayerLoRA(
            {name: ExpertsLoRA(staged(e.a, dtype), staged(e.b.transpose(1, 2), dtype).transpose(1, 2),
                               staged(e.ranks, e.ranks.dtype), e.scaling, e.keys) for name, e in layer.experts.items()},
            {name: LinearLoRA(staged(lin.a, dtype), staged(lin.b.T, dtype).T, lin.scaling, lin.keys)
             for name, lin in layer.modules.items()})
    return dataclasses.replace(share, layers=layers)


def _owned(piece: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """piece, a view of whole, in memory of its own unless it is all of it (one rank: nothing is copied)."""
    return whole if piece.shape == whole.shape else piece.clone(memory_format=torch.contiguous_format)


def write_adapter_to_slot(model: nn.Module, adapter: Adapter, slot: int) -> None:
    """Slot `slot` of every LoRA layer with buffers holds `adapter` afterwards and nothing of what was there
    before. Raises AdapterError, before writing anything, for the problems `slot_problems` finds."""
    _check_slot(model, slot)
    problems = slot_problems(model, adapter)
    if problems:
        raise AdapterError(f"{adapter.path}: cannot be put in slot {slot}: {'; '.join(problems)}", problems)
    write_share_to_slot(model, share_of(model, adapter), slot)


def write_share_to_slot(model: nn.Module, share: RankShare, slot: int) -> None:
    """Slot `slot` of every LoRA layer with buffers holds the adapter of `share` afterwards and nothing of what was
    there before: on a GPU, once the copies queued on the current stream have run (the host waits for none of them
    when `share` is staged_share's)."""
    for m in _check_slot(model, slot):
        layer = share.layers.get(m.layer_id, LayerLoRA())
        if isinstance(m, Runner):
            _write_experts(m, layer, slot)
        else:
            _write_linear(m, layer, slot)


def _check_slot(model: nn.Module, slot: int) -> list[Linear | Runner]:
    """The model's LoRA layers with buffers, once `slot` is known to be one of theirs."""
    layers = [m for m in _lora_layers(model) if m.lora is not None]
    if not layers:
        raise RuntimeError("allocate_lora_slots(model, ...) first")
    num_slots = layers[0].lora.ranks.shape[-2]
    if not 0 <= slot < num_slots:
        raise ValueError(f"slot {slot} out of range [0, {num_slots})")
    return layers


def slot_problems(model: nn.Module, adapter: Adapter) -> list[str]:
    """Why the adapter cannot be put in the model's slots (none: it can): fit_problems against the slots' rank, and
    modules without slot buffers (not among the engine's target modules)."""
    slotted = next((m.lora for m in _lora_layers(model) if m.lora is not None), None)
    rank = None if slotted is None else (slotted.a_gate if isinstance(slotted, ExpertLoRASlots) else slotted.a).shape[2]
    return fit_problems(model, adapter, rank) + unslotted_problems(model, adapted_layers(adapter))


def fit_problems(model: nn.Module, adapter: Adapter, max_rank: int | None) -> list[str]:
    """Why the adapter does not fit the model, slots aside: modules the model does not have, ranks above max_rank
    (None: any), shapes other than the model's."""
    problems, used = [], set()
    for m in _lora_layers(model):
        layer = adapter.layers.get(m.layer_id, LayerLoRA())
        for name in EXPERT_PROJECTIONS if isinstance(m, Runner) else m.part_names:
            lora = (layer.experts if isinstance(m, Runner) else layer.modules).get(name)
            if lora is not None:
                used.add((m.layer_id, name))
                problems += _fit_problems(m, name, lora, max_rank)
    for layer_id, layer in adapter.layers.items():
        for name in [*layer.experts, *layer.modules]:
            if (layer_id, name) not in used:
                problems.append(f"layer {layer_id} {name}: the model has no such LoRA-able module")
    return problems


def unslotted_problems(model: nn.Module, adapted: dict[str, tuple[int, ...]]) -> list[str]:
    """The modules an adapter adapts (`adapted`: adapted_layers) in layers without slot buffers for them."""
    unslotted: dict[str, list[int]] = defaultdict(list)  # target module -> layers
    for m in _lora_layers(model):
        for module in _modules_of(m) if m.lora is None else ():
            if m.layer_id in adapted.get(module, ()):
                unslotted[module].append(m.layer_id)
    problems = []
    for module, layer_ids in unslotted.items():
        where = f"layer{'s' if len(layer_ids) > 1 else ''} {format_ranges(layer_ids)}"
        problems.append(f"{module} ({where}): this engine has no LoRA slots for it; start the engine with "
                        f"--lora-target-modules including {_short(module)} (or all)")
    return problems


def _fit_problems(m: Linear | Runner, name: str, lora: LinearLoRA | ExpertsLoRA, max_rank: int | None) -> list[str]:
    where = f"layer {m.layer_id} {name}"
    if max_rank is not None and lora.rank > max_rank:
        return [f"{where}: rank {lora.rank} exceeds the slots' max rank {max_rank}"]
    if isinstance(m, Runner):
        h, i, e = m.hidden_size, m.full_intermediate_size, m.total_experts
        d_in, d_out = (i, h) if name == "down" else (h, i)
        expected = ((e, lora.rank, d_in), (e, d_out, lora.rank))
    else:
        expected = ((lora.rank, m.full_in_features), (m.full_out_sizes[m.part_names.index(name)], lora.rank))
    got = (tuple(lora.a.shape), tuple(lora.b.shape))
    if got != expected:
        return [f"{where}: A, B shapes {got}, expected {expected}"]
    # the slots hold A and B (scaled) in the model's dtype
    dtype = _weight(m).dtype
    peak = max((max(-lo.item(), hi.item()) for lo, hi in (torch.aminmax(t) for t in (lora.a, lora.b) if t.numel())),
               default=0.0)
    if dtype.is_floating_point and peak > torch.finfo(dtype).max:
        return [f"{where}: A or B (times the scaling) reaches {peak:.3g}, past the model's {dtype} largest value "
                f"{torch.finfo(dtype).max:.3g}"]
    return []


def _write_linear(m: Linear, layer: LayerLoRA, slot: int) -> None:
    buffers = m.lora
    buffers.a[slot].zero_()
    buffers.b[slot].zero_()
    buffers.ranks[slot].zero_()
    offset = 0
    for part, (name, size) in enumerate(zip(m.part_names, m.out_sizes)):
        lora = layer.modules.get(name)
        if lora is not None:
            buffers.a[slot, part, :lora.rank].copy_(lora.a, non_blocking=True)
            buffers.b[slot, :lora.rank, offset:offset + size].copy_(lora.b.T, non_blocking=True)
            # fill_, not `ranks[slot, part] = rank`: assigning a number to one element copies it from pageable
            # host memory, which waits for the stream's queued work
            buffers.ranks[slot, part].fill_(lora.rank)
            # as the experts' (_write_experts)
            buffers.max_rank_in_use = max(buffers.max_rank_in_use or 0, lora.rank)
        offset += size


def _write_experts(m: Runner, layer: LayerLoRA, slot: int) -> None:
    buffers = m.lora
    buffers.ranks[:, slot].zero_()
    for p, name in enumerate(EXPERT_PROJECTIONS):
        a, b = getattr(buffers, f"a_{name}"), getattr(buffers, f"b_{name}")
        a[slot].zero_()
        b[slot].zero_()
        lora = layer.experts.get(name)
        if lora is not None:
            a[slot, :, :lora.rank].copy_(lora.a, non_blocking=True)
            b[slot, :, :lora.rank].copy_(lora.b.transpose(1, 2), non_blocking=True)
            buffers.ranks[p, slot].copy_(lora.ranks, non_blocking=True)
            # A host-side upper bound on the ranks in use sizes the kernels' rank tile.
            buffers.max_rank_in_use = max(buffers.max_rank_in_use or 0, lora.rank)
