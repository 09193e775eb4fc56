"""Build a model from a local Hugging Face directory: config.json, then the safetensors weights
(one file, or shards listed in model.safetensors.index.json) read tensor by tensor into the
model's parameters, which are allocated on the target device from the start.

Checkpoint layouts: the hub's per-expert tensors (`mlp.experts.<e>.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.<e>.w1`) and transformers v5's fused ones (`mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I]) are both stacked into our w13 / w2; q/k/v and
gate/up parts go to their fused Linear through its part names. Every checkpoint tensor must land
somewhere and every parameter must be filled, or the load fails naming the tensors.
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import PretrainedConfig

from moelora.distributed.state import get_parallel
from moelora.layers.embedding import VocabEmbedding
from moelora.layers.linear import Linear
from moelora.layers.moe.runner import Runner
from moelora.layers.norm import RMSNorm
from moelora.models.base import CausalLM
from moelora.models.config import ModelConfig
from moelora.models.registry import model_class

WHOLE = "*"  # shard key of a tensor that fills its whole parameter
MAX_PROBLEMS_SHOWN = 20  # a checkpoint of another model lists a problem per tensor: thousands


class ModelLoadError(ValueError):
    pass


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: param[index], counted as `shard` when checking coverage. Under
    tensor or expert parallelism a rank takes part of the tensor: `source` indexes it (empty: all of it), and
    `shape` is the whole tensor's, which the checkpoint must have."""
    param: str
    index: tuple
    shard: str
    shape: tuple[int, ...]
    source: tuple = ()


@contextlib.contextmanager
def _building_on(device: torch.device | str, dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build_model(config: ModelConfig | PretrainedConfig, dtype: torch.dtype = torch.bfloat16,
                device: torch.device | str = "cuda") -> CausalLM:
    """The model of `config`'s architecture with uninitialised parameters, allocated on `device` (a
    transformers config is normalised first, with the default serving options)."""
    if isinstance(config, PretrainedConfig):
        config = ModelConfig.from_hf(config)
    with _building_on(device, dtype):
        return model_class(config)(config).eval()


def load_model(model_path: str | Path, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda",
               load_format: str = "auto", seed: int = 0, config: ModelConfig | None = None) -> CausalLM:
    """load_format "auto": weights from the directory's safetensors; "dummy": random weights of the
    real shapes (std 0.02, norms 1, from `seed`), reading nothing but config.json. config: the directory's
    config.json normalised, when the caller has read it already."""
    model_path = Path(model_path)
    model = build_model(config or ModelConfig.from_pretrained(model_path), dtype, device)
    if load_format == "dummy":
        fill_dummy_weights(model, seed)
    elif load_format == "auto":
        load_weights(model, checkpoint_files(model_path))
    else:
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    return model


def fill_dummy_weights(model: CausalLM, seed: int = 0, std: float = 0.02) -> None:
    """Norms 1, the rest normal(0, std). At one rank one generator draws every parameter in turn. Under
    tensor parallelism each parameter has a generator of its own, seeded by its index and, for a rank's shard of
    a tensor, the rank: replicated parameters (norms, routers) are equal on every rank, so every rank routes
    alike, and the shards are not those of a one-rank model."""
    device = next(model.parameters()).device
    gen = torch.Generator(device).manual_seed(seed)
    state = get_parallel()
    sharded = {t.param for targets in checkpoint_targets(model).values() for t in targets if t.source}
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for i, (name, p) in enumerate(model.named_parameters()):
        if state.tp_size > 1:
            gen.manual_seed(hash((seed, i, state.rank if name in sharded else -1)) % 2**63)
        if id(p) in norms:
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, std, generator=gen)


def checkpoint_files(model_path: Path) -> list[Path]:
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return [model_path / f for f in sorted(set(weight_map.values()))]
        except (ValueError, TypeError, KeyError, AttributeError) as e:  # not JSON, or no {"weight_map": {...}}
            raise ModelLoadError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    if (model_path / "model.safetensors").is_file():
        return [model_path / "model.safetensors"]
    raise ModelLoadError(f"{model_path}: neither model.safetensors nor model.safetensors.index.json")


def checkpoint_targets(model: CausalLM) -> dict[str, list[Target]]:
    """Every checkpoint name the model can take (in its own naming, see CausalLM.checkpoint_name) -> where it
    goes on this rank (nowhere: an expert another rank holds)."""
    targets: dict[str, list[Target]] = {}
    for path, module in model.named_modules():
        if isinstance(module, Linear):
            for name, target in _linear_targets(path, module):
                targets.setdefault(name, []).append(target)
        elif isinstance(module, VocabEmbedding):
            whole = (module.vocab_size, module.weight.shape[1])
            targets[f"{path}.weight"] = [Target(f"{path}.weight", (), WHOLE, whole, _source(whole, module.shard))]
        elif isinstance(module, Runner):
            targets.update(_expert_targets(path, module))
    targeted = {t.param for ts in targets.values() for t in ts}
    for name, p in model.named_parameters():
        if name not in targeted:
            targets[name] = [Target(name, (), WHOLE, tuple(p.shape))]
    return targets


def _source(shape: tuple[int, ...], *index: slice | torch.Tensor) -> tuple:
    """index into a tensor of `shape`, or () where it takes all of it."""
    whole = all(isinstance(i, slice) and (i.start or 0) == 0 and i.stop in (None, n) for i, n in zip(index, shape))
    return () if whole else index


def _linear_targets(path: str, m: Linear) -> list[tuple[str, Target]]:
    """A part per part name (a Linear without them, lm_head, is one part under its own name): its rows
    out_shards[p] and input columns in_shard go to the part's rows of this rank's weight."""
    found, offset = [], 0
    for p, (name, rows) in enumerate(zip(m.part_names or (None,), m.out_shards)):
        prefix, key = (f"model.layers.{m.layer_id}.{name}", name) if name else (path, WHOLE)
        local = slice(offset, offset + m.out_sizes[p])
        shape = (m.full_out_sizes[p], m.full_in_features)
        found.append((f"{prefix}.weight", Target(f"{path}.weight", (local,), key, shape, _source(shape, rows, m.in_shard))))
        if m.bias is not None:
            bias = (m.full_out_sizes[p],)
            found.append((f"{prefix}.bias", Target(f"{path}.bias", (local,), key, bias, _source(bias, rows))))
        offset += m.out_sizes[p]
    return found


def _expert_targets(path: str, m: Runner) -> dict[str, list[Target]]:
    """The fused tensors (gate_up_proj [E, 2I, H], down_proj [E, H, I]) or one tensor per expert and
    projection; this rank's experts and intermediate rows of each."""
    prefix, local, whole = f"model.layers.{m.layer_id}.mlp.experts", m.intermediate_size, m.full_intermediate_size
    h, rows = m.hidden_size, m.inter
    fused_gate_up, fused_down = (m.total_experts, 2 * whole, h), (m.total_experts, h, whole)
    # this rank's gate rows and up rows, which the fused tensor holds apart
    gate_up_rows = slice(None) if local == whole else torch.cat([torch.arange(rows.start, rows.stop),
                                                                 torch.arange(whole + rows.start, whole + rows.stop)])
    targets = {
        f"{prefix}.gate_up_proj": [Target(f"{path}.w13", (), WHOLE, fused_gate_up,
                                          _source(fused_gate_up, m.experts, gate_up_rows))],
        f"{prefix}.down_proj": [Target(f"{path}.w2", (), WHOLE, fused_down, _source(fused_down, m.experts, slice(None), rows))],
    }
    for e in range(m.total_experts):
        held = m.experts.start <= e < m.experts.stop
        for proj, param, index, shape, source in (
                ("gate_proj", "w13", (e - m.experts.start, slice(0, local)), (whole, h), (rows,)),
                ("up_proj", "w13", (e - m.experts.start, slice(local, 2 * local)), (whole, h), (rows,)),
                ("down_proj", "w2", (e - m.experts.start,), (h, whole), (slice(None), rows))):
            targets[f"{prefix}.{e}.{proj}.weight"] = (
                [Target(f"{path}.{param}", index, f"{proj}.{e}", shape, _source(shape, *source))] if held else [])
    return targets


def load_weights(model: CausalLM, files: list[Path]) -> None:
    """Check the whole checkpoint against the model from names and shapes alone, then copy in this rank's
    part of it."""
    params = dict(model.named_parameters())
    targets = checkpoint_targets(model)
    plan: dict[Path, list[tuple[str, Target]]] = {}
    loaded: dict[str, dict[str, int]] = {}  # param -> shard -> elements
    problems = []
    for file in files:
        with _open_checkpoint(file) as f:
            for name in f.keys():
                mapped = model.checkpoint_name(name)
                if mapped is None:
                    continue
                found = targets.get(mapped)
                if found is None:
                    problems.append(f"unexpected tensor {name!r} ({file.name})")
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                for target in found:
                    shards = loaded.setdefault(target.param, {})
                    if shape != target.shape:
                        problems.append(f"tensor {name!r} has shape {shape}, expected {target.shape} for {target.param}")
                    elif target.shard in shards or WHOLE in shards or (target.shard == WHOLE and shards):
                        problems.append(f"tensor {name!r} fills a part of {target.param} that another tensor already fills")
                    else:
                        shards[target.shard] = params[target.param][target.index].numel()
                        plan.setdefault(file, []).append((name, target))
    problems += _missing(params, targets, loaded)
    if problems:
        shown = problems[:MAX_PROBLEMS_SHOWN] + [f"and {len(problems) - MAX_PROBLEMS_SHOWN} more"] * (
            len(problems) > MAX_PROBLEMS_SHOWN)
        raise ModelLoadError(f"checkpoint does not fit {type(model).__name__}:\n  " + "\n  ".join(shown))

    with tqdm(total=sum(len(v) for v in plan.values()), desc="Loading weights", unit="tensor", disable=None) as bar:
        for file, entries in plan.items():
            with _open_checkpoint(file) as f:
                for name, target in entries:
                    params[target.param].data[target.index].copy_(_read(f, name, target.source))
                    bar.update()


def _open_checkpoint(file: Path):
    """safe_open, whose errors for a truncated or corrupt file (a Git LFS pointer, an interrupted download) are
    safetensors' own types and name no file."""
    try:
        return safe_open(file, framework="pt")
    except Exception as e:
        raise ModelLoadError(f"{file}: cannot be read as safetensors: {e}") from None


def _read(f, name: str, source: tuple) -> torch.Tensor:
    """The tensor, or the part `source` of it (read alone where it is slices)."""
    if not source:
        return f.get_tensor(name)
    if all(isinstance(i, slice) for i in source):
        return f.get_slice(name)[source]
    first, rest = source[0], source[1:]  # a slice of experts, then an index tensor of rows
    return f.get_slice(name)[first][(slice(None), *rest)]


def _missing(params: dict[str, torch.nn.Parameter], targets: dict[str, list[Target]],
             loaded: dict[str, dict[str, int]]) -> list[str]:
    """A problem per parameter not completely filled, naming the checkpoint tensors it lacks."""
    problems = []
    for param, p in params.items():
        shards = loaded.get(param, {})
        if sum(shards.values()) == p.numel():
            continue
        names = {n: t for n, ts in targets.items() for t in ts if t.param == param and t.shard not in shards}
        whole = [n for n, t in names.items() if t.shard == WHOLE]
        parts = [n for n, t in names.items() if t.shard != WHOLE]
        if whole and not shards:  # nothing there: name the one tensor that would fill it
            shown = whole[0] + (" (or its per-part tensors)" if parts else "")
        else:
            shown = ", ".join(parts[:4]) + (f" and {len(parts) - 4} more" if len(parts) > 4 else "")
        problems.append(f"missing tensor {shown} for {param}")
    return problems
