"""Per-request sampling options, with vLLM/SGLang semantics."""
from __future__ import annotations

import copy
import json
import math
import struct
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path

from moelora.engine.fields import option

# Temperatures below this sample greedily, as in vLLM: dividing logits by them overflows.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
# Every stop string is searched for in each token's new text and tracked at the text's end (detokenizer.py), on the
# thread that streams every request's text: bounded so that one request cannot slow the others' streams.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1 << 16  # all of a request's stop strings together
_INT64 = (-(2**63), 2**63)
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output must follow. kind "json_schema": spec is the schema (JSON text);
    "json_object": any JSON object (spec ""); "regex": a regular expression; "choice": one of
    `choices` exactly; "grammar": an EBNF (GBNF) grammar with a `root` rule; "structural_tag":
    xgrammar's structural tag (JSON text: {"type": "structural_tag", "format": ...}), which
    composes text, tags and JSON schemas (a server forces tool calls with it).

    A reasoning model thinks before it answers: with `reasoning_end` (its end-of-thinking token,
    `</think>`), the output is free up to and including the first such token, and the grammar
    applies after it. With `reasoning_start` too (`<think>`), the output thinks only if its first
    token is that one, and else follows the grammar from its first token."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()
    reasoning_end: int | None = None
    reasoning_start: int | None = None

    def __post_init__(self) -> None:
        _check(self.kind in STRUCTURED_KINDS, "structured_output", self.kind, f"one of {STRUCTURED_KINDS}")
        _check(isinstance(self.spec, str), "structured_output", self.spec, "a string spec")
        check_text(self.spec, "SamplingParams.structured_output")
        if self.kind == "choice":
            _check(len(self.choices) > 0 and all(isinstance(c, str) and c for c in self.choices),
                   "structured_output", self.choices, "at least one choice, each a non-empty string")
            for c in self.choices:
                check_text(c, "SamplingParams.structured_output")
        for name in ("reasoning_end", "reasoning_start"):
            value = getattr(self, name)
            _check(value is None or _is_int64(value) and value >= 0, f"structured_output.{name}", value,
                   "None or a token id (an int >= 0)")
        _check(self.reasoning_start is None or self.reasoning_end not in (None, self.reasoning_start),
               "structured_output.reasoning_start", self.reasoning_start,
               "None without a reasoning_end, or another token than reasoning_end")

    @property
    def grammar(self) -> StructuredOutput:
        """The grammar alone, without the reasoning before it."""
        return replace(self, reasoning_end=None, reasoning_start=None)


@dataclass
class SamplingParams:
    """How one request samples and when it stops (vLLM's semantics). A temperature of 0 (or below
    GREEDY_TEMPERATURE) is greedy: top_p/top_k/min_p then do nothing. Without a seed the engine draws
    one at admission."""

    max_tokens: int | None = option(16, "most tokens to generate (None: up to the context length)")
    temperature: float = option(1.0, "sampling temperature; 0 is greedy")
    top_p: float = option(1.0, "keep the smallest set of tokens whose probability mass reaches top_p")
    top_k: int = option(-1, "keep the k most likely tokens; -1 or 0 turns it off")
    min_p: float = option(0.0, "drop tokens less likely than min_p times the most likely one")
    seed: int | None = option(None, "makes the draws reproducible")
    stop: str | list[str] | tuple[str, ...] | None = option(None, "strings that end generation (not part of the text "
                                                                  "unless include_stop_str_in_output)")
    stop_token_ids: list[int] | tuple[int, ...] | None = option(None, "tokens that end generation, besides EOS unless "
                                                                      "ignore_eos (not part of the text)")
    ignore_eos: bool = option(False, "go on past the end-of-sequence token")
    n: int = option(1, "completions of the prompt")
    logprobs: int | None = option(None, "top log-probabilities returned per generated token (0: only the chosen "
                                        "token's)")
    skip_special_tokens: bool = option(True, "leave special tokens out of the text")
    include_stop_str_in_output: bool = option(False, "keep the stop string that ended the output in its text")
    prompt_logprobs: int | None = option(None, "as logprobs, for every prompt token after the first (echo uses them)")
    presence_penalty: float = option(0.0, f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], subtracted from the logit of "
                                          "every token the output holds (OpenAI's)")
    frequency_penalty: float = option(0.0, f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], subtracted from the logit of "
                                           "every token the output holds, once per occurrence (OpenAI's)")
    repetition_penalty: float = option(1.0, "> 0; divides the positive logits (multiplies the negative ones) of the "
                                            "tokens in the prompt or the output; 1 is off")
    logit_bias: dict[int, float] = option(help=f"token id -> added to its logit, in [-{MAX_LOGIT_BIAS:g}, "
                                               f"{MAX_LOGIT_BIAS:g}] (OpenAI's)", factory=dict)
    min_tokens: int = option(0, "EOS and stop_token_ids cannot be sampled, nor stop strings end the output, before "
                                "it has this many tokens")
    allowed_token_ids: list[int] | tuple[int, ...] | None = option(None, "only these tokens can be sampled")
    structured_output: StructuredOutput | None = option(None, "a grammar the output follows (JSON schema, JSON "
                                                              "object, regex, choice or EBNF)")

    def __post_init__(self) -> None:
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        self.stop_token_ids = tuple(self.stop_token_ids or ())
        if not isinstance(self.logit_bias, CheckedBias):
            self.logit_bias = dict(self.logit_bias or {})
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = tuple(self.allowed_token_ids)
        self.validate()
        if not isinstance(self.logit_bias, CheckedBias):  # checked: read-only from here, shared by every copy
            self.logit_bias = CheckedBias(self.logit_bias)

    @property
    def has_penalties(self) -> bool:
        """The sampler needs the counts of the tokens seen so far."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def for_sequence(self, k: int) -> SamplingParams:
        """The params of the k-th of the n sequences: n=1, and with a seed, seed + k (wrapping in int64)."""
        if k == 0 and self.n == 1:
            return self
        seed = None if self.seed is None else (self.seed + k - _INT64[0]) % 2**64 + _INT64[0]
        return self.evolve(n=1, seed=seed)

    def evolve(self, **checked: object) -> SamplingParams:
        """A copy with the `checked` fields (values the caller knows valid) that shares the others, which are never
        changed in place: replace() would check every field again, a whole vocabulary's logit_bias for each of a
        request's n sequences and each step of its way into the engine."""
        params = copy.copy(self)
        for name, value in checked.items():
            setattr(params, name, value)
        return params

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and its value."""
        _check(self.max_tokens is None or _is_int64(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
               self.max_tokens, "None or an int >= 1 (that fits in int64)")
        _check(_is_float32(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
               "a number >= 0 that fits in float32")
        _check(_is_float32(self.top_p, positive=True) and self.top_p <= 1, "top_p", self.top_p,
               "in (0, 1], and > 0 in float32")
        _check(_is_int64(self.top_k) and self.top_k >= -1, "top_k", self.top_k,
               "an int >= -1 (-1 or 0: off) that fits in int64")
        _check(_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(self.seed is None or _is_int64(self.seed), "seed", self.seed, "None or an int that fits in int64")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"{len(self.stop)} strings",
               f"at most {MAX_STOP_STRINGS} strings")
        for s in self.stop:
            _check(isinstance(s, str) and s != "", "stop", s, "a non-empty string")
            check_text(s, "SamplingParams.stop")
        stop_chars = sum(map(len, self.stop))
        _check(stop_chars <= MAX_STOP_CHARS, "stop", f"{stop_chars} characters",
               f"at most {MAX_STOP_CHARS} characters in all")
        for t in () if _plain_token_ids(self.stop_token_ids) else self.stop_token_ids:
            _check(_is_int64(t) and t >= 0, "stop_token_ids", t, "an int >= 0")
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "an int >= 1")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or _is_int(value) and 0 <= value <= MAX_LOGPROBS, name, value,
                   f"None or an int in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_real(value) and -MAX_PENALTY <= value <= MAX_PENALTY, name, value,
                   f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        _check(_is_float32(self.repetition_penalty, positive=True), "repetition_penalty", self.repetition_penalty,
               "a number > 0 that fits in float32 (and is > 0 there)")
        fine = isinstance(self.logit_bias, CheckedBias) or (_plain_token_ids(self.logit_bias)
                                                            and _biases(self.logit_bias.values()))
        for token, bias in () if fine else self.logit_bias.items():
            _check(_is_int64(token) and token >= 0, "logit_bias", token, "keyed by token ids (ints >= 0)")
            _check(_is_real(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS, "logit_bias", bias,
                   f"values in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        most = float("inf") if self.max_tokens is None else self.max_tokens
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= most, "min_tokens", self.min_tokens,
               "an int >= 0" if self.max_tokens is None else f"an int in [0, max_tokens={self.max_tokens}]")
        if self.allowed_token_ids is not None:
            _check(len(self.allowed_token_ids) > 0, "allowed_token_ids", list(self.allowed_token_ids),
                   "None or a non-empty list of token ids")
            for t in () if _plain_token_ids(self.allowed_token_ids) else self.allowed_token_ids:
                _check(_is_int64(t) and t >= 0, "allowed_token_ids", t, "token ids (ints >= 0)")
        _check(self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
               "structured_output", self.structured_output, "None or a StructuredOutput")


def _check(ok: bool, field: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field} must be {rule}, got {value!r}")


def check_text(text: str, what: str) -> None:
    """Raise ValueError unless the string is text a tokenizer can take (no lone UTF-16 surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: {text[e.start:e.end]!a} at position {e.start} is a lone "
                         "surrogate") from None


class CheckedBias(dict):
    """A logit_bias SamplingParams has checked (token id -> bias), read-only: every copy of the params (replace,
    evolve) shares it unchecked, and what is made of it is made once (the sampler's tensors, `tensors`). A whole
    vocabulary's took the engine thread tens of ms at each copy, several copies a sequence."""

    def _read_only(self, *args: object, **kwargs: object) -> None:
        raise TypeError("SamplingParams.logit_bias is read-only once checked: make new SamplingParams")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _read_only

    def __reduce__(self) -> tuple:
        return CheckedBias, (dict(self),)


def _plain_token_ids(ids: Collection) -> bool:
    """Whether every id is a plain int in [0, 2**63), without a loop in Python (a logit_bias may hold the whole
    vocabulary, and every copy of the params checks it): where not, the caller's checks of each id name the bad one."""
    return not ids or set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < _INT64[1]


def _biases(values: Collection) -> bool:
    """Whether every value is a plain int or float in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], as _plain_token_ids checks."""
    if not values:
        return True
    if not set(map(type, values)) <= {int, float}:
        return False
    try:
        finite = all(map(math.isfinite, values))
    except OverflowError:  # an int past a float's range
        return False
    return finite and -MAX_LOGIT_BIAS <= min(values) and max(values) <= MAX_LOGIT_BIAS


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_int64(v: object) -> bool:
    return _is_int(v) and _INT64[0] <= v < _INT64[1]


def _is_real(v: object) -> bool:
    return _is_int(v) or isinstance(v, float) and math.isfinite(v)


def _is_float32(v: object, positive: bool = False) -> bool:
    """A real number that the sampler's float32 holds: not past its range, and (positive) > 0 there, not
    rounded to 0."""
    if not _is_real(v):
        return False
    try:
        as_float32 = struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:  # (some Python versions round past the range to inf instead)
        return False
    return math.isfinite(as_float32) and (not positive or as_float32 > 0)


# the generation_config.json fields that vLLM's --generation-config takes as sampling defaults (not max_new_tokens
# here: as a default it would have to be cut to the context each prompt leaves, where a request's max_tokens is
# refused past it)
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(directory: str | Path) -> dict[str, float | int]:
    """The sampling defaults a model's generation_config.json sets (SamplingParams field -> value; {} without the
    file). ValueError names the file and the field whose value SamplingParams refuses."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_bytes())
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: must be a JSON object")
    defaults = {field: config[field] for field in GENERATION_DEFAULTS if config.get(field) is not None}
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None
    return defaults
