"""A server with prefix caching (--enable-prefix-caching): concurrent chats sharing a system prompt get what an
engine without the cache gives each alone, the cached prompt tokens count in /metrics and the stats line, and every
slot is free or cached once they are done."""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import httpx

from moelora.engine.engine import Engine
from moelora.engine.sampling_params import SamplingParams
from moelora.server.app import create_app
from tests.server.conftest import ENGINE_OPTIONS, MODEL_NAME, serving

SYSTEM = {"role": "system", "content": "the quick brown fox jumps over the lazy dog. " * 4}
QUESTIONS = ["Hello world", "naïve café", "déjà vu", "Hello world!"]


def test_concurrent_chats_share_the_cached_system_prompt(demo_dir, reference, caplog):
    engine = Engine(str(demo_dir / "model"), lora_paths={"alpha": str(demo_dir / "alpha")}, enable_prefix_caching=True,
                    **ENGINE_OPTIONS)
    bodies = [{"model": model, "messages": [SYSTEM, {"role": "user", "content": q}], "max_tokens": 6,
               "temperature": 0} for q in QUESTIONS for model in (MODEL_NAME, "alpha")]
    want = [reference.generate(reference.chat_prompt(b["messages"]), SamplingParams(max_tokens=6, temperature=0),
                               lora=None if b["model"] == MODEL_NAME else "alpha")[0].text for b in bodies]
    with caplog.at_level(logging.INFO), serving(create_app(engine, MODEL_NAME, stats_interval=0.01)) as server:
        cached = []

        def ask(body: dict) -> str:
            r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            return r.json()["choices"][0]["message"]["content"]
        assert ask(bodies[0]) == want[0] and cached == [0]  # the system prompt cached for the base model
        for _ in range(2):
            with ThreadPoolExecutor(len(bodies)) as pool:
                assert list(pool.map(ask, bodies)) == want
        metrics = httpx.get(f"{server.url}/metrics").text
        hits = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("moelora:prefix_cache_hit_tokens_total"))
        assert hits >= 2 * len(bodies) * len(engine.tokenizer.encode(SYSTEM["content"]))
        assert sum(cached) == hits and min(cached[-len(bodies):]) >= len(engine.tokenizer.encode(SYSTEM["content"]))
        assert server.on_engine(lambda: engine.scheduler.accounting_error()) is None
        assert server.on_engine(lambda: engine.scheduler.available_slots) == engine.runner.kv.num_slots - 1
    assert any("prefix cache hits" in r.getMessage() for r in caplog.records)


def test_a_request_that_ends_on_a_stop_string_is_cached(demo_dir, reference):
    """The server finds stop strings itself and stops the request in the engine: its prompt is cached all the same,
    and the next request of the same start finds it."""
    engine = Engine(str(demo_dir / "model"), enable_prefix_caching=True, **ENGINE_OPTIONS)
    messages = [SYSTEM, {"role": "user", "content": "Hello world"}]
    text = reference.generate(reference.chat_prompt(messages), SamplingParams(max_tokens=8, temperature=0))[0].text
    stop = text.split()[1]
    with serving(create_app(engine, MODEL_NAME)) as server:
        body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 8, "temperature": 0, "stop": [stop]}
        for _ in range(2):
            r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
            assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["stop_reason"] == stop
        counts = server.on_engine(engine.prefix_cache_counts)
        assert counts["cached_tokens"] > r["usage"]["prompt_tokens"] and counts["hit_tokens"] == r["usage"]["prompt_tokens"] - 1
