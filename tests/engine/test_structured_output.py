"""The grammar backend's compile cache is bounded: every distinct grammar a client sends would otherwise stay
compiled for the life of the server."""
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
    calls, real = [], backend._compile
    monkeypatch.setattr(backend, "_compile", lambda spec: calls.append(spec) or real(spec))
    assert all(backend.compile(spec) is c for spec, c in zip(specs[1:], compiled[1:])) and not calls
    assert backend.compile(specs[0]) is compiled[0] and not calls  # the oldest, pushed out, but still held here
    compiled[0] = None  # and now by nobody
    backend.compile(specs[0])
    assert calls == [specs[0]]
