"""The grammar backend's compile cache is bounded: every distinct grammar a client sends would otherwise stay
compiled for the life of the server."""
import pytest
import torch

from moelora.engine import structured_output
from moelora.engine.sampling_params import StructuredOutput
from tests.support import tiny_tokenizer


def test_compiled_grammars_stay_within_the_cache_limit(monkeypatch):
    limit = 64 << 10  # (200 of these grammars take about 300 KiB with no limit)
    monkeypatch.setattr(structured_output, "GRAMMAR_CACHE_BYTES", limit)
    tokenizer = tiny_tokenizer()
    backend = structured_output.GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    for i in range(200):
        backend.compile(StructuredOutput("regex", f"x{i}[ab]+"))
    compiler = backend._get_compiler()
    assert compiler.cache_limit_bytes == limit and 0 < compiler.get_cache_size_bytes() <= limit


def test_the_grammars_compiled_last_are_not_compiled_again(monkeypatch):
    """A server compiles a grammar before the engine thread starts its matcher: the engine thread takes it from the
    grammars compiled last, even when other grammars have pushed it out of xgrammar's own (size-bounded) cache."""
    monkeypatch.setattr(structured_output, "GRAMMAR_CACHE_BYTES", 1)  # xgrammar keeps (almost) nothing
    tokenizer = tiny_tokenizer()
    backend = structured_output.GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    specs = [StructuredOutput("regex", f"y{i}[ab]+") for i in range(structured_output.RECENT_GRAMMARS + 1)]
    compiled = [backend.compile(spec) for spec in specs]
    calls, real = [], structured_output.compile_spec
    monkeypatch.setattr(structured_output, "compile_spec",
                        lambda compiler, spec: calls.append(spec) or real(compiler, spec))
    assert all(backend.compile(spec) is c for spec, c in zip(specs[1:], compiled[1:])) and not calls
    assert backend.compile(specs[0]) is compiled[0] and not calls  # the oldest, pushed out, but still held here
    compiled[0] = None  # and now by nobody
    backend.compile(specs[0])
    assert calls == [specs[0]]


def test_a_grammar_after_reasoning_is_the_grammar_compiled_once():
    """The reasoning before a grammar is the matcher's business: the grammar compiles (and is cached) as itself."""
    tokenizer = tiny_tokenizer()
    backend = structured_output.GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    spec = StructuredOutput("regex", "z[ab]+")
    assert backend.compile(StructuredOutput("regex", "z[ab]+", reasoning_end=7, reasoning_start=8)) is backend.compile(spec)


class _Script:
    """A matcher that allows token 2 only, and ends after one."""

    def __init__(self):
        self.accepted = []

    def fill_next_token_bitmask(self, bitmask, row):
        bitmask[row] = 0
        bitmask[row, 0] = 1 << 2

    def accept_token(self, token):
        self.accepted.append(token)
        return token == 2

    def is_terminated(self):
        return self.accepted == [2]


@pytest.mark.parametrize("start", [31, 63, 40])
def test_the_first_token_after_an_optional_reasoning_is_the_grammars_or_the_start(start):
    from moelora.engine.sampler import unpack_bitmask

    def allowed(m):
        bitmask = torch.full((2, 3), -1, dtype=torch.int32)
        bitmask[1] = 0  # (a buffer used before: the row is the matcher's to fill)
        m.fill_next_token_bitmask(bitmask, 1)
        assert (bitmask[0] == -1).all()  # the other rows are left alone
        return unpack_bitmask(bitmask, 96)[1].nonzero().flatten().tolist()

    m = structured_output.AfterReasoning(_Script(), end=5, start=start)
    assert allowed(m) == sorted([2, start]) and not m.is_terminated()
    assert m.accept_token(start) and allowed(m) == list(range(96))  # thinking: everything
    assert m.accept_token(2) and m.accept_token(start) and m.matcher.accepted == []
    assert m.accept_token(5) and allowed(m) == [2] and not m.is_terminated()  # the end: the grammar's turn
    assert m.accept_token(2) and m.is_terminated() and m.matcher.accepted == [2]
    answered = structured_output.AfterReasoning(_Script(), end=5, start=start)
    assert not answered.accept_token(7) and answered.matcher.accepted == [7]  # no start first: the grammar's token
