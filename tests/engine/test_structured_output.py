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
