"""Structured output through xgrammar: a request's grammar (JSON schema, any JSON object, regex,
choice, EBNF, structural tag) compiled once, cached by spec, and a matcher per sequence that fills the sequence's
row of the step's token bitmask and accepts each token it samples.

xgrammar because it runs on CPU and GPU alike (the masks are filled on the host, in C++, while the
device runs the forward), fills a bitmask in microseconds per token from its precomputed
context-independent token sets, and is the default backend of vLLM and SGLang. The bitmask is
applied in the batched sampler (`sampler.TokenMask`), so constrained rows batch freely with the
rest.

JSON grammars allow no free whitespace (xgrammar's `any_whitespace=False`: ", " and ": " between
items): a model cannot then fill its output with blanks until max_tokens, the failure free
whitespace is known for with small models. The compiler is thread-safe: a server compiles in a
worker thread before it queues the request, and the engine then finds the grammar in the cache.

A reasoning model's grammar waits for the end of its thinking (`AfterReasoning`), as vLLM's
structured output does with a reasoning parser: the thinking is free text, the answer follows the
grammar.
"""
from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable

import torch

from moelora.engine.sampling_params import StructuredOutput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_ANY_OBJECT = '{"type": "object"}'
# a JSON schema nested deeper is refused: compiling one of 800 levels took xgrammar 24 s, of the server's threads
# (a schema in a request's JSON is held to the same depth by the server's body check)
MAX_SCHEMA_NESTING = 128
# xgrammar's cache of compiled grammars, least recently used first out: each distinct grammar a client sends stays
# there (about its vocabulary's size in masks), which unbounded grows without end (512 MiB: vLLM's default)
GRAMMAR_CACHE_BYTES = 512 << 20
# the grammars compiled last, held here too, and any compiled grammar that something else still holds: a server
# compiles a request's grammar in a thread of its own and holds it until the engine thread has started the
# request's matcher from it, which then never compiles it again itself (as it would if other requests' grammars had
# pushed it out of xgrammar's cache, and out of the recent ones, meanwhile)
RECENT_GRAMMARS = 16


class GrammarBackend:
    """Compiles grammars for one tokenizer and vocabulary (the model's: it may exceed the tokenizer's)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, stop_token_ids: list[int],
                 missing_tokenizer: str | None = None):
        """tokenizer None (a model without tokenizer files, `missing_tokenizer` says why): every
        grammar is refused, as grammars are over text."""
        self._tokenizer, self.vocab_size, self._stop_token_ids = tokenizer, vocab_size, stop_token_ids
        self._missing_tokenizer = missing_tokenizer
        self._compiler = self._info = None
        self._recent: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._held: weakref.WeakValueDictionary[StructuredOutput, Any] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput, trial: Callable[[StructuredOutput], None] | None = None) -> Any:
        """The xgrammar CompiledGrammar of the spec's grammar; ValueError naming
        SamplingParams.structured_output when the spec is not valid (a bad schema, regex or grammar),
        xgrammar is not installed, or there is no tokenizer. `trial`, when the grammar is not compiled yet: called
        with it first, it raises what keeps it from being compiled here (GrammarTrials.check: one too slow)."""
        spec = spec.grammar
        with self._lock:
            if spec in self._recent:
                self._recent.move_to_end(spec)
                return self._recent[spec]
            if (compiled := self._held.get(spec)) is not None:
                return compiled
        compiler = self._get_compiler()
        if trial is not None:
            trial(spec)
        compiled = compile_spec(compiler, spec)
        with self._lock:
            self._recent[spec] = self._held[spec] = compiled
            while len(self._recent) > RECENT_GRAMMARS:
                self._recent.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutput) -> Any:
        """A new xgrammar GrammarMatcher of the spec's grammar, at the start of the output (after the
        reasoning: see AfterReasoning)."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.compile(spec))

    def tokenizer_info(self) -> Any:
        """The xgrammar TokenizerInfo that grammars compile against (ValueError as compile's, without a tokenizer or
        xgrammar)."""
        self._get_compiler()
        return self._info

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                if self._tokenizer is None:
                    raise ValueError(f"SamplingParams.structured_output needs a tokenizer: {self._missing_tokenizer}")
                try:
                    import xgrammar
                except ImportError as e:
                    raise ValueError("SamplingParams.structured_output needs the xgrammar package "
                                     "(pip install xgrammar)") from e
                self._info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                                     stop_token_ids=self._stop_token_ids or None)
                self._compiler = xgrammar.GrammarCompiler(self._info, cache_limit_bytes=GRAMMAR_CACHE_BYTES)
            return self._compiler


def compile_spec(compiler: Any, spec: StructuredOutput) -> Any:
    """The spec's grammar compiled by an xgrammar GrammarCompiler; ValueError naming
    SamplingParams.structured_output when it is not valid."""
    try:
        if spec.kind == "json_schema":
            schema = json.loads(spec.spec)
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
            if _nesting(schema) > MAX_SCHEMA_NESTING:  # xgrammar's compile time grows steeply with it
                raise ValueError(f"it is nested deeper than {MAX_SCHEMA_NESTING} lists and objects")
            return compiler.compile_json_schema(spec.spec, any_whitespace=False)
        if spec.kind == "json_object":  # not strict: any properties
            return compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.spec)
        if spec.kind == "structural_tag":
            return compiler.compile_structural_tag(spec.spec)
        if spec.kind == "choice":
            return compiler.compile_grammar("root ::= " + " | ".join(_ebnf_literal(c) for c in spec.choices))
        return compiler.compile_grammar(spec.spec)
    except (RuntimeError, ValueError) as e:  # xgrammar's parser errors: RuntimeError or a ValueError subclass
        lines = str(e).strip().splitlines() or [type(e).__name__]
        reason = re.sub(r"^\[[\d:]+\] \S+: ", "", lines[-1])  # xgrammar's "[time] file.cc:line: " prefix
        raise ValueError(f"SamplingParams.structured_output: the {spec.kind.replace('_', ' ')} is not valid: "
                         f"{reason}") from None


def _nesting(value: Any) -> int:
    """How deep lists and objects nest in a parsed JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, depth = stack.pop()
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if items is not None:
            deepest = max(deepest, depth)
            stack += [(item, depth + 1) for item in items if isinstance(item, (dict, list))]
    return deepest


def _ebnf_literal(text: str) -> str:
    """A string literal of xgrammar's EBNF: JSON's escapes (quotes, backslashes, control characters)."""
    return json.dumps(text, ensure_ascii=False)


class AfterReasoning:
    """A grammar matcher that applies once the output's reasoning has ended: the tokens up to and
    including the first `end` are free, and the grammar follows them. With `start`, the output may
    begin its reasoning with that token, first: any other first token is the grammar's. The engine
    uses it as a GrammarMatcher (fill_next_token_bitmask, accept_token, is_terminated)."""

    def __init__(self, matcher: Any, end: int, start: int | None = None):
        self.matcher, self.end, self.start = matcher, end, start
        self.thinking = start is None   # inside the reasoning
        self.answering = False          # past it: the grammar applies

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of the packed [rows, words] int32 bitmask: all ones while thinking."""
        if self.thinking:
            bitmask[row] = -1
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if not self.answering:  # the first token: the grammar's, or the start of the reasoning
            word, bit = divmod(self.start, 32)
            bitmask[row, word] |= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)

    def accept_token(self, token: int) -> bool:
        if self.answering:
            return self.matcher.accept_token(token)
        if self.thinking:
            self.thinking = token != self.end
            self.answering = not self.thinking
            return True
        if token == self.start:  # the first token, which may start the reasoning
            self.thinking = True
            return True
        self.answering = True
        return self.matcher.accept_token(token)

    def is_terminated(self) -> bool:
        return self.answering and self.matcher.is_terminated()
