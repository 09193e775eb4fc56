"""Load an adapter directory against a base model into the canonical adapter, validating everything.

Every tensor of the file either lands in the canonical adapter or is reported as a problem; all
problems are collected and raised together as one AdapterError.
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PretrainedConfig

from moelora.lora.canonical import Adapter, ExpertsLoRA, LayerLoRA, LinearLoRA
from moelora.lora.config import AdapterConfig
from moelora.lora.errors import AdapterError, read_json_bytes
from moelora.lora.experts import ExpertPiece, expert_pieces
from moelora.lora.formats import Kind, LoRAPair, pair_tensors, read_tensors
from moelora.lora.model_shapes import FUSED_MODULES, ModelShapes, load_model_shapes


@dataclass
class AdapterFile:
    """What the adapter directory says on its own, before it is checked against a model."""
    path: Path
    file_name: str
    config: AdapterConfig
    pairs: list[LoRAPair]
    problems: list[str]
    added_tokens: dict[str, int]  # added_tokens.json: token -> id, checked against the model's vocabulary
    version: tuple[tuple[str, int, int], ...] = ()  # files_version(path) before the read
    left_out: list[str] = field(default_factory=list)  # keys of training-only state, not served (formats.py)

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(sorted({p.kind.value for p in self.pairs if p.kind is not Kind.MODULE}))


def read_adapter(path: str | Path) -> AdapterFile:
    """The directory's config and tensors; AdapterError if they cannot be read (the path's own
    problems, a name too long, a missing or unreadable file, included)."""
    path = _checked_path(path)
    try:
        version = files_version(path)
        config = AdapterConfig.read(path)
        tensors, file_name = read_tensors(path)
        problems = []
        added_tokens = _read_added_tokens(path, problems)
        # files replaced while they were read (an adapter updated in place) would make an adapter of neither version:
        # the old config's scaling with the new tensors
        if files_version(path) != version:
            raise AdapterError(f"{path}: its files changed while they were read; load it again once they are written")
    except OSError as e:
        raise AdapterError(f"{path}: cannot be read: {e.strerror or e}") from None
    left_out: list[str] = []
    pairs = pair_tensors(tensors, problems, left_out)
    return AdapterFile(path, file_name, config, pairs, problems, added_tokens, version, left_out)


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "added_tokens.json")


def files_version(path: Path) -> tuple[tuple[str, int, int], ...]:
    """(name, size, modification time in ns) of each file of the directory that read_adapter reads: what tells an
    adapter rewritten in place from the one read before."""
    stats = ((name, (path / name).stat()) for name in ADAPTER_FILES if (path / name).is_file())
    return tuple((name, st.st_size, st.st_mtime_ns) for name, st in stats)


def _checked_path(path: str | Path) -> Path:
    """The path, if the operating system can take it."""
    text = str(path)
    if not text or "\0" in text:
        raise AdapterError(f"adapter path {text[:200]!r}: must be a non-empty path without NUL characters")
    try:
        size = len(os.fsencode(text))
    except UnicodeEncodeError:
        raise AdapterError(f"adapter path {text[:200]!a}: not valid Unicode") from None
    limit = os.pathconf("/", "PC_PATH_MAX") if hasattr(os, "pathconf") else 4096
    if size >= limit:
        raise AdapterError(f"adapter path {text[:60]!r}...: {size} bytes long, the limit is {limit - 1}")
    return Path(text)


def load_adapter(path: str | Path, model: str | Path | PretrainedConfig | ModelShapes,
                 max_lora_rank: int | None = None) -> Adapter:
    """The canonical adapter of the directory `path` (adapter_config.json + adapter_model.safetensors
    or .bin) for the base model `model` (local dir, transformers config, or ModelShapes).
    `max_lora_rank` is the engine's limit; a higher rank is an error."""
    shapes = model if isinstance(model, ModelShapes) else load_model_shapes(model)
    return canonicalize(read_adapter(path), shapes, max_lora_rank)


def canonicalize(file: AdapterFile, shapes: ModelShapes, max_lora_rank: int | None = None) -> Adapter:
    """The canonical adapter of an adapter file read by `read_adapter`; raises AdapterError listing every problem."""
    problems = list(file.problems) + _added_token_problems(file, shapes)
    if not file.pairs and not problems:
        problems.append(f"{file.path}: holds no LoRA weights (no lora_A / lora_B pair): nothing to serve")
    layers: dict[int, LayerLoRA] = defaultdict(LayerLoRA)
    pieces: dict[tuple[int, str], list[ExpertPiece]] = defaultdict(list)
    wrapper_names = defaultdict(set)  # layer -> 'inner'/'outer' ParamWrapper pairs present
    for pair in file.pairs:
        if pair.kind is Kind.PARAM_WRAPPER:
            wrapper_names[pair.layer].add(pair.name)

    for pair in file.pairs:
        try:
            if pair.layer >= shapes.num_layers:
                raise AdapterError(f"{pair.a_key}: layer {pair.layer} out of range (the model has {shapes.num_layers} layers)")
            if pair.kind is Kind.MODULE:
                parts = _module_parts(pair, shapes)
                path = file.config.pattern_path(pair.peft_path)
                scaling = _scaling(pair.a_key, pair.a.shape[0], path, file.config, max_lora_rank)
                for name, a, b in parts:
                    _add_module(layers[pair.layer], name, LinearLoRA(a, _scaled(b, scaling, pair.b_key), scaling, (pair.a_key, pair.b_key)))
                continue
            for piece in expert_pieces(pair, wrapper_names[pair.layer], shapes, file.config):
                piece.scaling = _scaling(pair.a_key, piece.rank, piece.peft_path, file.config, max_lora_rank)
                pieces[(pair.layer, piece.projection)].append(piece)
        except AdapterError as e:
            problems.append(str(e))

    for (layer, projection), found in sorted(pieces.items()):
        try:
            layers[layer].experts[projection] = _assemble(found, projection, shapes)
        except AdapterError as e:
            problems.append(str(e))
    if problems:
        raise AdapterError(f"adapter {file.path}: {len(problems)} problem(s):\n  - " + "\n  - ".join(problems), problems)
    return Adapter(file.path, file.config, file.formats, dict(sorted(layers.items())), file.version)


def _read_added_tokens(path: Path, problems: list[str]) -> dict[str, int]:
    """added_tokens.json's token -> id, if the directory has one (tokenizers save it with the adapter)."""
    added = path / "added_tokens.json"
    if not added.is_file():
        return {}
    try:
        tokens = json.loads(read_json_bytes(added) or b"{}")
    except AdapterError as e:
        problems.append(str(e))
        return {}
    except ValueError as e:
        problems.append(f"{added}: not valid JSON ({e})")
        return {}
    except RecursionError:
        problems.append(f"{added}: JSON nested too deep to read")
        return {}
    if not isinstance(tokens, dict) or not all(type(i) is int for i in tokens.values()):
        problems.append(f"{added}: must map each token to its id (an integer), got {str(tokens)[:200]}")
        return {}
    return tokens


def _added_token_problems(file: AdapterFile, shapes: ModelShapes) -> list[str]:
    """Tokens the base model does not have: the adapter was trained with a vocabulary of its own, which is not
    served. transformers 4 tokenizers list the base model's own special tokens there too (Qwen's <|im_start|>, ...):
    those add nothing. With the base tokenizer's added tokens known, a token must be one of them at the same id (else
    the served tokenizer would split its text); without, its id must be an embedding row."""
    known = shapes.added_tokens
    if known is None:
        foreign = sorted((i, t) for t, i in file.added_tokens.items() if not 0 <= i < shapes.vocab_size)
        where = f"lie outside the base model's vocabulary of {shapes.vocab_size} tokens"
    else:
        foreign = sorted((i, t) for t, i in file.added_tokens.items() if known.get(t) != i)
        where = "are not tokens of the base model's tokenizer at those ids"
    if not foreign:
        return []
    return [f"{file.path / 'added_tokens.json'}: {', '.join(f'{t!r} (id {i})' for i, t in foreign)} {where} (added "
            "tokens change the model's vocabulary and embeddings, which are not served)"]


def _scaling(key: str, rank: int, peft_path: str, config: AdapterConfig, max_lora_rank: int | None) -> float:
    """The scaling PEFT applies at `peft_path`, after checking the tensor's rank against the config."""
    r, alpha = config.rank_and_alpha(peft_path)
    if rank != r:
        raise AdapterError(f"{key}: rank {rank}, but adapter_config.json gives r={r} for {peft_path} "
                           "(r/rank_pattern decide the scaling, so they must match the tensors)")
    if max_lora_rank is not None and rank > max_lora_rank:
        raise AdapterError(f"{key}: rank {rank} is above the engine's max_lora_rank={max_lora_rank}")
    return config.scaling(r, alpha)


def _scaled(b: torch.Tensor, scaling: float, key: str) -> torch.Tensor:
    """B * scaling in float32 (float64 for a float64 B), rounded once to B's dtype (B of the file's tensor `key`),
    which must hold it."""
    wide = b.to(torch.promote_types(b.dtype, torch.float32))
    scaled = (wide * scaling).to(b.dtype).contiguous()
    if not torch.isfinite(scaled).all():
        raise AdapterError(f"{key}: times its scaling {scaling:g} (lora_alpha / r) it reaches "
                           f"{wide.abs().max().item() * scaling:.3g}, past {b.dtype}'s largest value "
                           f"{torch.finfo(b.dtype).max:.3g}; save the adapter in float32")
    return scaled


def _module_parts(pair: LoRAPair, shapes: ModelShapes) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(module name, A [r, in], B [out, r]) of a non-expert pair; a fused qkv/gate_up splits B over
    its parts, which share A."""
    modules = shapes.modules[pair.layer]
    prefix, _, last = pair.name.rpartition(".")
    parts = [pair.name] if pair.name in modules else [f"{prefix}.{p}" for p in FUSED_MODULES.get(last, ())]
    if not parts or not all(p in modules for p in parts):
        raise AdapterError(f"{pair.a_key}: layer {pair.layer} of this {shapes.model_type} model has no module "
                           f"{pair.name!r} (it has {', '.join(sorted(modules))})")
    in_f, outs = modules[parts[0]][0], [modules[p][1] for p in parts]
    a, b = pair.a, pair.b
    a_fits, b_fits = a.ndim == 2 and a.shape[1] == in_f, b.ndim == 2 and b.shape[0] == sum(outs)
    if not (a_fits and b_fits and a.shape[0] == b.shape[1]):
        raise pair.misfit(a_fits, b_fits, pair.name, f"A [r, {in_f}], B [{sum(outs)}, r]")
    return [(name, a.contiguous(), part) for name, part in zip(parts, b.split(outs))]


def _add_module(layer: LayerLoRA, name: str, lora: LinearLoRA) -> None:
    if name in layer.modules:
        raise AdapterError(f"{lora.keys[0]}: {name} is already given by {layer.modules[name].keys[0]}")
    layer.modules[name] = lora


def _assemble(found: list[ExpertPiece], projection: str, shapes: ModelShapes) -> ExpertsLoRA:
    """One ExpertsLoRA from the pieces of a (layer, projection): zero-padded to the largest rank."""
    num_experts, (in_f, out_f) = shapes.num_experts, shapes.expert_shape(projection)
    rank = max(p.rank for p in found)
    dtype = found[0].a.dtype
    for p in found:
        dtype = torch.promote_types(dtype, torch.promote_types(p.a.dtype, p.b.dtype))
    a = torch.zeros(num_experts, rank, in_f, dtype=dtype)
    b = torch.zeros(num_experts, out_f, rank, dtype=dtype)
    ranks = torch.zeros(num_experts, dtype=torch.int32)
    scaling = torch.zeros(num_experts, dtype=torch.float32)
    owner: dict[int, str] = {}
    for p in found:
        twice = [e for e in p.experts if e in owner]
        if twice:
            raise AdapterError(f"{p.keys[0]}: expert {twice[0]} {projection} is already given by {owner[twice[0]]}")
        owner.update((e, p.keys[0]) for e in p.experts)
        a[p.experts, : p.rank] = p.a.to(dtype)
        b[p.experts, :, : p.rank] = _scaled(p.b.to(dtype), p.scaling, p.keys[-1])
        ranks[p.experts], scaling[p.experts] = p.rank, p.scaling
    keys = tuple(dict.fromkeys(k for p in found for k in p.keys))
    return ExpertsLoRA(a, b, ranks, scaling, keys)
