"""Adapter files -> A/B pairs with where they apply. Knows key names, nothing about shapes.

Key layouts (prefix `base_model.model.` optional, `block_sparse_moe` read as `mlp`, suffix
`.lora_A.weight` or bare `.lora_A`):

    layers.L.mlp.experts.E.{gate_proj,up_proj,down_proj,w1,w3,w2}  per-expert modules (PEFT, transformers v4)
    layers.L.mlp.experts.base_layer / layers.L.mlp.experts          PEFT target_parameters on fused 3D experts
                                                                     (inner / outer ParamWrapper)
    layers.L.mlp.experts.{gate_up_proj,gate_proj,up_proj,down_proj,w1,w3,w2}   stacked 3D, A [E, r, in]
    layers.L.<anything else>                                          a linear module of the layer
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch
from safetensors.torch import load_file

from moelora.lora.errors import AdapterError


class Kind(str, Enum):
    MODULE = "module"                  # non-expert linear: A [r, in], B [out, r]
    EXPERT_MODULE = "expert-modules"   # one expert's projection: A [r, in], B [out, r]
    PARAM_WRAPPER = "target-parameters"  # PEFT ParamWrapper: A [E*r, in], B [out, E*r]
    STACKED = "stacked-3d"             # A [E or 1, r, in], B [E or 1, out, r]


EXPERT_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down",
                "gate_up_proj": "gate_up"}


@dataclass
class LoRAPair:
    """One lora_A / lora_B pair of the file and where it applies."""
    kind: Kind
    layer: int
    name: str          # MODULE: module name in the layer ('self_attn.q_proj'); experts: 'gate'/'up'/'down'/'gate_up';
                       # PARAM_WRAPPER: 'inner' (base_layer) or 'outer'
    expert: int | None  # EXPERT_MODULE only
    peft_path: str     # module (or, for PARAM_WRAPPER, module without base_layer) path PEFT matched patterns against
    a_key: str
    b_key: str
    a: torch.Tensor
    b: torch.Tensor

    def misfit(self, a_fits: bool, b_fits: bool, target: str, expected: str) -> AdapterError:
        """The error of a pair that does not fit `target`, naming the tensor at fault: A or B when the
        other fits (`a_fits`: A's shape is right but for its rank), B when each fits but their ranks
        differ, both when neither fits."""
        a, b = f"A {tuple(self.a.shape)}", f"B {tuple(self.b.shape)}"
        if a_fits and b_fits:
            return AdapterError(f"{self.b_key}: {b} has rank {self.b.shape[-1]} but its lora_A {a} has rank "
                                f"{self.a.shape[-2]} ({target}: expected {expected})")
        if a_fits or b_fits:
            key, wrong, right = (self.b_key, b, a) if a_fits else (self.a_key, a, b)
            return AdapterError(f"{key}: {wrong} does not fit {target} (expected {expected}; {right} fits)")
        return AdapterError(f"{self.a_key}, {self.b_key}: {a} / {b} do not fit {target} (expected {expected})")


_SUFFIX = re.compile(r"^(?P<module>.+)\.lora_(?P<side>[AB])(?:\.weight)?$")
# the decoder's layers as transformers names them (text models; a multimodal one's language model), nothing else's:
# a vision tower's or encoder's layers.N is no decoder layer, whatever its shapes
_LAYER = re.compile(r"^(?:model\.|model\.language_model\.|language_model\.model\.)?layers\.(?P<layer>\d+)\."
                    r"(?P<rel>.+)$")
_EXPERT_MODULE = re.compile(r"^mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)$")
_STACKED = re.compile(r"^mlp\.experts\.(?P<proj>gate_up_proj|gate_proj|up_proj|down_proj|w1|w3|w2)$")

# Keys of features that are refused rather than unknown, with the reason.
_REFUSED = (
    (re.compile(r"\.lora_magnitude_vector\b"), "DoRA magnitude vector (only plain LoRA is served)"),
    (re.compile(r"\.lora_diag\b"), "KaSA singular-value diagonal (kasa_config; only plain LoRA is served)"),
    (re.compile(r"\.lora_B(\.[^.]+)?\.bias$"), "lora_bias (a trained bias on lora_B is not served)"),
    (re.compile(r"bias$"),  # any other bias (after lora_B's above): PEFT saves the base model's with bias != 'none'
     "a bias of the base model, trained with adapter_config.json's bias='lora_only' or 'all' (only the LoRA weights "
     "are served)"),
    (re.compile(r"\.lora_embedding_[AB]\b"), "LoRA on an embedding (only decoder-layer projections are served)"),
    (re.compile(r"trainable_tokens"), "trainable/added tokens (they change the base model's embeddings)"),
    (re.compile(r"modules_to_save|(^|\.)(embed_tokens|lm_head)\.weight$"),
     "a full copy of a base module (modules_to_save, e.g. embed_tokens/lm_head) cannot be swapped per request"),
)

# Keys of state only PEFT's training reads: VeLoRA's projection for its compressed backward pass (velora_config),
# MonteCLoRA's sampler that perturbs lora_A in training mode only (monteclora_config). PEFT's inference and merge
# compute plain LoRA without them, so they are left out rather than refused (and listed: AdapterFile.left_out).
_TRAINING_ONLY = re.compile(r"\.(lora_velora_embed|lora_monteclora_sampler\.[^.]+)$")


# what LoRA weights are trained and saved in; float8 and the like would need their scales, which PEFT does not save
LORA_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def read_tensors(adapter_dir: Path) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors of adapter_model.safetensors (or .bin) on CPU, and the file name."""
    st, pt = adapter_dir / "adapter_model.safetensors", adapter_dir / "adapter_model.bin"
    if st.is_file():
        try:
            return load_file(st, device="cpu"), st.name
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
            raise AdapterError(f"{st}: cannot be read as safetensors: {e}") from None
    if pt.is_file():
        try:
            tensors = torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as e:  # pickles with code in them are refused by weights_only
            raise AdapterError(f"{pt}: cannot be read with torch.load(weights_only=True): {e}") from None
        if not isinstance(tensors, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                    for k, v in tensors.items()):
            raise AdapterError(f"{pt}: expected a dict of tensors by name")
        return tensors, pt.name
    raise AdapterError(f"{adapter_dir}: no adapter_model.safetensors or adapter_model.bin")


def pair_tensors(tensors: dict[str, torch.Tensor], problems: list[str], left_out: list[str]) -> list[LoRAPair]:
    """Group the file's tensors into A/B pairs. Every key ends up in a pair, in `problems`, or, training-only state,
    in `left_out`."""
    halves: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    refused_modules = set()  # modules with a half refused for its values: no "has no matching" for the other
    for key in sorted(tensors):
        if _TRAINING_ONLY.search(key):
            left_out.append(key)
            continue
        reason = next((why for pattern, why in _REFUSED if pattern.search(key)), None)
        match = _SUFFIX.match(key)
        if reason is None and match is None:
            reason = "unknown key (expected <module>.lora_A.weight or <module>.lora_B.weight)"
        if reason is not None:
            problems.append(f"{key}: {reason}")
            continue
        t = tensors[key]
        if t.layout != torch.strided:
            problems.append(f"{key}: layout {t.layout}, expected a dense tensor")
            refused_modules.add(match["module"])
        elif t.is_meta:
            problems.append(f"{key}: a meta tensor (a shape without values), expected one that holds its values")
            refused_modules.add(match["module"])
        elif t.dtype not in LORA_DTYPES:
            problems.append(f"{key}: dtype {t.dtype}, expected a floating point tensor of "
                            f"{', '.join(str(d).removeprefix('torch.') for d in LORA_DTYPES)}")
            refused_modules.add(match["module"])
        elif not torch.isfinite(t).all():
            problems.append(f"{key}: contains {int((~torch.isfinite(t)).sum())} NaN/Inf values")
            refused_modules.add(match["module"])
        elif (side := match["side"]) in (sides := halves.setdefault(match["module"], {})):  # 'x.lora_A', 'x.lora_A.weight'
            problems.append(f"{key}: lora_{side} of {match['module']} is given twice, also by {sides[side][0]}")
        else:
            sides[side] = (key, t)

    pairs = []
    for module, sides in halves.items():
        if module in refused_modules:
            continue
        if len(sides) == 1:
            (side, (key, _)), = sides.items()
            other = "lora_B" if side == "A" else "lora_A"
            problems.append(f"{key}: has no matching {other} (expected {module}.{other}.weight)")
            continue
        try:
            pairs.append(_locate(module, sides["A"], sides["B"]))
        except AdapterError as e:
            problems.append(str(e))
    return pairs


def _locate(module: str, a: tuple[str, torch.Tensor], b: tuple[str, torch.Tensor]) -> LoRAPair:
    peft_path = module.removeprefix("base_model.model.")
    layer_match = _LAYER.match(peft_path)
    if layer_match is None:
        raise AdapterError(f"{a[0]}: not inside a decoder layer (only decoder-layer projections are served)")
    layer, rel = int(layer_match["layer"]), layer_match["rel"].replace("block_sparse_moe.", "mlp.", 1)
    expert = None
    if m := _EXPERT_MODULE.match(rel):
        kind, name, expert = Kind.EXPERT_MODULE, EXPERT_NAMES[m["proj"]], int(m["expert"])
    elif rel in ("mlp.experts.base_layer", "mlp.experts"):
        kind, name = Kind.PARAM_WRAPPER, "inner" if rel.endswith("base_layer") else "outer"
        peft_path = peft_path.removesuffix(".base_layer")
    elif m := _STACKED.match(rel):
        kind, name = Kind.STACKED, EXPERT_NAMES[m["proj"]]
    else:
        kind, name = Kind.MODULE, rel
    return LoRAPair(kind, layer, name, expert, peft_path, a[0], b[0], a[1], b[1])
