"""adapter_config.json: rank and alpha per module or parameter path (PEFT's rank_pattern /
alpha_pattern semantics), scaling, and the features moelora refuses to serve."""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import regex

from moelora.lora.errors import AdapterError, missing_file, read_json_bytes

# PEFT >= this writes target_parameters LoRA on 3D experts as A [E*r, in], B [out, E*r] with in/out
# the projection's real input/output; older versions took them from the parameter's dims 1 and 2.
PEFT_PARAM_ORIENTATION_FIXED = (0, 19, 1)

# LoraConfig's defaults: PEFT builds its config with them when adapter_config.json has no such field
PEFT_DEFAULT_R = 8
PEFT_DEFAULT_LORA_ALPHA = 8

# A pattern key matches a module path in microseconds, but one that backtracks without bound ('((a|aa)+)+b') would
# take hours: all of a config's matches together get this long, matched with the GIL released so that a server
# loading the adapter keeps serving meanwhile.
PATTERN_MATCH_BUDGET_S = 5.0


def _anchored(key: str) -> str:
    """PEFT's get_pattern_key's regular expression: `key` matches the whole path or a dotted suffix of it."""
    return rf"(.*\.)?({key})$"


class PatternMatcher:
    """PEFT's get_pattern_key for one config's pattern keys, all its matches within PATTERN_MATCH_BUDGET_S."""

    def __init__(self) -> None:
        self.spent_s = 0.0

    def key(self, field_name: str, patterns: dict, path: str) -> str | None:
        """The first key of `patterns` (the config's field `field_name`) that matches `path`, None if none does."""
        for key in patterns:
            left = PATTERN_MATCH_BUDGET_S - self.spent_s
            start = time.perf_counter()
            try:
                if left <= 0:
                    raise TimeoutError
                if regex.match(_anchored(key), path, timeout=left, concurrent=True):
                    return key
            except TimeoutError:
                raise AdapterError(f"{field_name} key {key!r}: matching the pattern keys against the module paths "
                                   f"took over {PATTERN_MATCH_BUDGET_S:g} s (a regular expression that backtracks "
                                   f"without bound, such as '((a|aa)+)+b')") from None
            finally:
                self.spent_s += time.perf_counter() - start
        return None


@dataclass(frozen=True)
class AdapterConfig:
    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    target_modules: tuple[str, ...] | str | None = None
    target_parameters: tuple[str, ...] = ()
    peft_version: str | None = None
    lora_b_layout: str | None = None  # "grouped_by_expert": older Unsloth, B columns are (E, r)
    raw: dict = field(default_factory=dict, compare=False, repr=False)
    pattern_matcher: PatternMatcher = field(default_factory=PatternMatcher, init=False, compare=False, repr=False)

    @classmethod
    def read(cls, adapter_dir: Path) -> AdapterConfig:
        path = adapter_dir / "adapter_config.json"
        if not path.is_file():
            raise missing_file(adapter_dir, "adapter_config.json", "an adapter directory")
        try:
            raw = json.loads(read_json_bytes(path))  # bytes: UTF-8, -16 or -32, with or without a BOM
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise AdapterError(f"{path}: not valid JSON in UTF-8, UTF-16 or UTF-32 ({e})") from None
        except ValueError as e:  # an integer past Python's 4300 digits
            raise AdapterError(f"{path}: cannot be read ({e})") from None
        except RecursionError:
            raise AdapterError(f"{path}: JSON nested too deep to read") from None
        return cls.from_dict(raw, where=str(path))

    @classmethod
    def from_dict(cls, raw: dict, where: str = "adapter_config.json") -> AdapterConfig:
        if not isinstance(raw, dict):
            raise AdapterError(f"{where}: must hold a JSON object, got {type(raw).__name__}")
        for name, kinds, expected in _FIELD_TYPES:
            if raw.get(name) is not None and (not isinstance(raw[name], kinds) or isinstance(raw[name], bool)):
                raise AdapterError(f"{where}: {name!r} must be {expected}, got {raw[name]!r}")
        for name in ("target_modules", "target_parameters"):
            if isinstance(raw.get(name), list) and not all(isinstance(v, str) for v in raw[name]):
                raise AdapterError(f"{where}: {name!r} must be a list of strings, got {raw[name]!r}")
        refusals = unsupported_features(raw)
        if refusals:
            raise AdapterError(f"{where}: not served: " + "; ".join(refusals))
        if not _is_rank(raw.get("r", PEFT_DEFAULT_R)):
            raise AdapterError(f"{where}: 'r' must be a positive integer, got {raw['r']!r}")
        if not _is_finite(raw.get("lora_alpha", PEFT_DEFAULT_LORA_ALPHA)):
            raise AdapterError(f"{where}: 'lora_alpha' must be a finite number, got {raw['lora_alpha']!r}")
        for pattern, rule, expected in (("rank_pattern", _is_rank, "a positive integer"),
                                        ("alpha_pattern", _is_finite, "a finite number")):
            bad = next(((k, v) for k, v in (raw.get(pattern) or {}).items() if not rule(v)), None)
            if bad is not None:
                raise AdapterError(f"{where}: {pattern}[{bad[0]!r}] must be {expected}, got {bad[1]!r}")
            for key in raw.get(pattern) or {}:
                try:  # as PEFT matches it (re), and as it is matched here
                    re.compile(_anchored(key))
                    regex.compile(_anchored(key))
                except (re.error, regex.error) as e:
                    raise AdapterError(f"{where}: {pattern} key {key!r} is not a regular expression ({e})") from None
        layout = raw.get("lora_B_layout") or raw.get("lora_b_layout")
        if layout not in (None, "grouped_by_expert"):
            raise AdapterError(f"{where}: unknown lora_B_layout {layout!r} (expected 'grouped_by_expert')")
        target_modules = raw.get("target_modules")
        return cls(
            r=raw.get("r", PEFT_DEFAULT_R),
            lora_alpha=raw.get("lora_alpha", PEFT_DEFAULT_LORA_ALPHA),
            use_rslora=bool(raw.get("use_rslora", False)),
            rank_pattern=dict(raw.get("rank_pattern") or {}),
            alpha_pattern=dict(raw.get("alpha_pattern") or {}),
            target_modules=tuple(target_modules) if isinstance(target_modules, list) else target_modules,
            target_parameters=tuple(raw.get("target_parameters") or ()),
            peft_version=raw.get("peft_version"),
            lora_b_layout=layout,
            raw=raw,
        )

    def rank_and_alpha(self, peft_path: str) -> tuple[int, float]:
        """(r, alpha) PEFT used for the module or parameter at `peft_path` (e.g.
        'model.layers.0.mlp.experts.gate_up_proj')."""
        r = self.rank_pattern.get(self.pattern_matcher.key("rank_pattern", self.rank_pattern, peft_path), self.r)
        alpha = self.alpha_pattern.get(self.pattern_matcher.key("alpha_pattern", self.alpha_pattern, peft_path),
                                       self.lora_alpha)
        return r, alpha

    def pattern_path(self, module_path: str) -> str:
        """The path PEFT matched the patterns against for a 2D LoRA: the parameter path
        ('model.layers.0.mlp.gate.weight') if target_parameters put it there, else the module path."""
        weight = f"{module_path}.weight"
        return weight if self.targets_parameter(weight) else module_path

    def scaling(self, r: int, alpha: float) -> float:
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets_parameter(self, peft_path: str) -> bool:
        """Whether target_parameters names the parameter at `peft_path` (PEFT's suffix match)."""
        return any(peft_path == t or peft_path.endswith("." + t) for t in self.target_parameters)

    def param_orientation_fixed(self) -> bool | None:
        """True if PEFT wrote 3D-parameter LoRA in the >= 0.19.1 orientation, None if unknown."""
        if not self.peft_version:
            return None
        numbers = re.findall(r"\d+", self.peft_version)[:3]
        if not numbers or max(map(len, numbers)) > 9:  # 'main', 'dev': a build whose release the file does not say
            return None
        return tuple(int(n) for n in numbers) >= PEFT_PARAM_ORIENTATION_FIXED


# fields read below whose type the file may get wrong (JSON allows anything)
_FIELD_TYPES = [("lora_alpha", (int, float), "a number"), ("rank_pattern", dict, "an object"),
                ("alpha_pattern", dict, "an object"), ("target_modules", (str, list), "a string or a list"),
                ("target_parameters", list, "a list"), ("peft_version", str, "a string")]


def _is_rank(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _is_finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)



def unsupported_features(raw: dict) -> list[str]:
    """Reasons this config cannot be served faithfully (empty if it can). The fields of PEFT's LoraConfig not refused
    here are served (r, lora_alpha, use_rslora, rank_pattern, alpha_pattern, target_parameters: see AdapterConfig),
    or leave what the adapter computes alone: the choice of modules it adapts (target_modules, exclude_modules,
    layers_to_transform, layers_pattern: the file's tensors are that choice), training only (lora_dropout,
    initializations that leave the base weights alone and their *_config, velora_config, monteclora_config; bias:
    the base biases it trains are refused as tensors), megatron_config (LoRA's layer class on Megatron's parallel
    layers) and fan_in_fan_out (the base weight's layout, GPT-2's Conv1D, not LoRA's: PEFT resets it on nn.Linear
    layers, which the served models have)."""
    reasons = []
    if raw.get("peft_type", "LORA") != "LORA":
        reasons.append(f"peft_type {raw['peft_type']!r} (only LORA is served)")
    if raw.get("use_dora"):
        reasons.append("use_dora=true (DoRA rescales each output column by a magnitude vector; only plain LoRA is served)")
    if raw.get("lora_bias"):
        reasons.append("lora_bias=true (a trained bias on lora_B; only bias-free LoRA is served)")
    if raw.get("modules_to_save"):
        reasons.append(f"modules_to_save={raw['modules_to_save']} (fully trained copies of base modules such as "
                       "embed_tokens/lm_head cannot be swapped per request)")
    if raw.get("trainable_token_indices"):
        reasons.append("trainable_token_indices (added or retrained tokens change the embeddings of the base model)")
    if raw.get("alora_invocation_tokens"):
        reasons.append("alora_invocation_tokens (activated LoRA applies only after an invocation sequence)")
    if raw.get("layer_replication"):
        reasons.append("layer_replication (the adapter expects a model with duplicated layers)")
    if raw.get("use_qalora"):
        reasons.append("use_qalora=true (QA-LoRA, for GPTQ-quantized base layers, feeds lora_A the input averaged over "
                       "groups of qalora_group_size features; only plain LoRA is served)")
    reasons += [f"{name} ({why})" for name, why in _VARIANT_CONFIGS.items() if raw.get(name) is not None]
    base_changing_init = _base_changing_init(raw.get("init_lora_weights"))
    if base_changing_init:
        reasons.append(f"init_lora_weights={raw['init_lora_weights']!r} ({base_changing_init} changes the base model's "
                       "weights, and PEFT does so whenever it loads the adapter; only LoRA on the unchanged base "
                       "model is served: save the adapter with save_pretrained(path_initial_model_for_weight_conversion=...), "
                       "which converts PiSSA, CorDA, OLoRA and LoRA-GA adapters to plain LoRA)")
    targets = raw.get("target_modules") or []
    if isinstance(targets, list) and {"embed_tokens", "lm_head"} & set(targets):
        reasons.append("LoRA on embed_tokens/lm_head (only decoder-layer projections are served)")
    return reasons


# LoRA variants PEFT turns on with a sub-config, whatever it holds (a JSON object, {} included, becomes the variant's
# config with its defaults), and what each computes that plain LoRA does not
_VARIANT_CONFIGS = {
    "use_bdlora": "BD-LoRA: lora_A or lora_B is block-diagonal and stored as its blocks; only plain LoRA is served",
    "kasa_config": "KaSA: a trained diagonal (lora_diag) between lora_A and lora_B, on base weights PEFT truncates by "
                   "SVD whenever it loads the adapter; only plain LoRA on the unchanged base model is served",
    "arrow_config": "Arrow: each token is routed over several LoRA adapters loaded together; only plain LoRA is served",
}

# init_lora_weights values (prefixes: 'pissa_niter_16') with which PEFT takes the initial adapter out of the base
# weights (LoftQ: quantizes them), when the adapter is created and again on every load of one saved that way
_BASE_CHANGING_INITS = {"pissa": "PiSSA", "corda": "CorDA", "olora": "OLoRA", "lora_ga": "LoRA-GA", "loftq": "LoftQ"}


def _base_changing_init(init: object) -> str | None:
    """The name of the method, if `init` (init_lora_weights) is one that changes the base model's weights."""
    if not isinstance(init, str):
        return None
    return next((name for prefix, name in _BASE_CHANGING_INITS.items() if init.lower().startswith(prefix)), None)
