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

from moelora.layers.linear import Linear
from moelora.layers.moe.runner import Runner
from moelora.layers.norm import RMSNorm
from moelora.models.base import CausalLM
from moelora.models.config import ModelConfig
from moelora.models.registry import model_class

WHOLE = "*"  # shard key of a tensor that fills its whole parameter


class ModelLoadError(ValueError):
    pass


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: param[index], counted as `shard` when checking coverage."""
    param: str
    index: tuple
    shard: str


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
    device = next(model.parameters()).device
    gen = torch.Generator(device).manual_seed(seed)
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for p in model.parameters():
        if id(p) in norms:
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, std, generator=gen)


def checkpoint_files(model_path: Path) -> list[Path]:
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        return [model_path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (model_path / "model.safetensors").is_file():
        return [model_path / "model.safetensors"]
    raise ModelLoadError(f"{model_path}: neither model.safetensors nor model.safetensors.index.json")


def checkpoint_targets(model: CausalLM) -> dict[str, Target]:
    """Every checkpoint name the model can take (in its own naming, see CausalLM.checkpoint_name)."""
    targets: dict[str, Target] = {}
    for path, module in model.named_modules():
        if isinstance(module, Linear) and module.part_names:
            offset = 0
            for name, size in zip(module.part_names, module.out_sizes):
                rows = (slice(offset, offset + size),)
                targets[f"model.layers.{module.layer_id}.{name}.weight"] = Target(f"{path}.weight", rows, name)
                if module.bias is not None:
                    targets[f"model.layers.{module.layer_id}.{name}.bias"] = Target(f"{path}.bias", rows, name)
                offset += size
        elif isinstance(module, Runner):
            prefix, inter = f"model.layers.{module.layer_id}.mlp.experts", module.intermediate_size
            targets[f"{prefix}.gate_up_proj"] = Target(f"{path}.w13", (), WHOLE)
            targets[f"{prefix}.down_proj"] = Target(f"{path}.w2", (), WHOLE)
            for e in range(module.num_experts):
                for proj, param, index in (("gate_proj", "w13", (e, slice(0, inter))),
                                           ("up_proj", "w13", (e, slice(inter, 2 * inter))),
                                           ("down_proj", "w2", (e,))):
                    targets[f"{prefix}.{e}.{proj}.weight"] = Target(f"{path}.{param}", index, f"{proj}.{e}")
    targeted = {t.param for t in targets.values()}
    for name, _ in model.named_parameters():
        if name not in targeted:
            targets[name] = Target(name, (), WHOLE)
    return targets


def load_weights(model: CausalLM, files: list[Path]) -> None:
    """Check the whole checkpoint against the model from names and shapes alone, then copy it in."""
    params = dict(model.named_parameters())
    targets = checkpoint_targets(model)
    plan: dict[Path, list[tuple[str, Target]]] = {}
    loaded: dict[str, dict[str, int]] = {}  # param -> shard -> elements
    problems = []
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                mapped = model.checkpoint_name(name)
                if mapped is None:
                    continue
                target = targets.get(mapped)
                if target is None:
                    problems.append(f"unexpected tensor {name!r} ({file.name})")
                    continue
                expected = params[target.param][target.index].shape
                shape = tuple(f.get_slice(name).get_shape())
                shards = loaded.setdefault(target.param, {})
                if shape != tuple(expected):
                    problems.append(f"tensor {name!r} has shape {shape}, expected {tuple(expected)} for {target.param}")
                elif target.shard in shards or WHOLE in shards or (target.shard == WHOLE and shards):
                    problems.append(f"tensor {name!r} fills a part of {target.param} that another tensor already fills")
                else:
                    shards[target.shard] = expected.numel()
                    plan.setdefault(file, []).append((name, target))
    problems += _missing(params, targets, loaded)
    if problems:
        raise ModelLoadError(f"checkpoint does not fit {type(model).__name__}:\n  " + "\n  ".join(problems))

    with tqdm(total=sum(len(v) for v in plan.values()), desc="Loading weights", unit="tensor", disable=None) as bar:
        for file, entries in plan.items():
            with safe_open(file, framework="pt") as f:
                for name, target in entries:
                    params[target.param].data[target.index].copy_(f.get_tensor(name))
                    bar.update()


def _missing(params: dict[str, torch.nn.Parameter], targets: dict[str, Target],
             loaded: dict[str, dict[str, int]]) -> list[str]:
    """A problem per parameter not completely filled, naming the checkpoint tensors it lacks."""
    problems = []
    for param, p in params.items():
        shards = loaded.get(param, {})
        if sum(shards.values()) == p.numel():
            continue
        names = [n for n, t in targets.items() if t.param == param and t.shard not in shards]
        whole = [n for n in names if targets[n].shard == WHOLE]
        parts = [n for n in names if targets[n].shard != WHOLE]
        if whole and not shards:  # nothing there: name the one tensor that would fill it
            shown = whole[0] + (" (or its per-part tensors)" if parts else "")
        else:
            shown = ", ".join(parts[:4]) + (f" and {len(parts) - 4} more" if len(parts) > 4 else "")
        problems.append(f"missing tensor {shown} for {param}")
    return problems
