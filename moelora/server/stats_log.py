"""The server's periodic log line, as vLLM's: running and waiting requests, prompt and generation
throughput over the last interval, KV cache use and LoRA slots. Written by the engine thread; an
idle server writes nothing after the interval that saw its last token."""
from __future__ import annotations

import logging
import time

from moelora.engine import Engine

logger = logging.getLogger(__name__)


class StatsLog:
    def __init__(self, interval: float):
        """interval: seconds between lines; 0 turns the line off."""
        self.interval = interval
        self._start = time.monotonic()
        self._prompt_tokens = self._generated = 0

    def count(self, prompt_tokens: int, generated: int) -> None:
        """Tokens of one step output: prompt tokens when it is a request's first token, new tokens."""
        self._prompt_tokens += prompt_tokens
        self._generated += generated

    def tick(self, engine: Engine, running: int, waiting: int) -> None:
        """Log the line once the interval has passed, if anything ran or waits."""
        now = time.monotonic()
        elapsed = now - self._start
        if not self.interval or elapsed < self.interval:
            return
        if self._prompt_tokens or self._generated or running or waiting:
            kv_used, kv_total = engine.kv_cache_usage
            slots_used, slots = engine.lora_slots_usage
            cache = engine.prefix_cache_counts()
            hits = (f"; prefix cache hits {100 * cache['hit_tokens'] / max(cache['query_tokens'], 1):.1f}% of prompt "
                    f"tokens, {cache['cached_tokens']} tokens cached" if cache else "")
            logger.info("running %d, waiting %d requests; prompt %.1f tokens/s, generation %.1f tokens/s; KV cache "
                        "%.1f%% (%d of %d tokens); LoRA slots %d of %d%s", running, waiting, self._prompt_tokens / elapsed,
                        self._generated / elapsed, 100 * kv_used / kv_total, kv_used, kv_total, slots_used, slots, hits)
        self._start, self._prompt_tokens, self._generated = now, 0, 0
