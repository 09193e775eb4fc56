"""What the server logs: what it serves at start (model, family, dtype, device, KV cache, adapters
with their ranks and memory), then a stats line per interval while it works."""
from __future__ import annotations

import logging
import re
import time

import openai

from moelora.server.app import create_app
from tests.server.conftest import MODEL_NAME, make_engine, serving


def test_startup_summary_and_stats_line(demo_dir, caplog):
    caplog.set_level(logging.INFO, logger="moelora")
    with serving(create_app(make_engine(demo_dir, ["alpha", "beta"]), MODEL_NAME, stats_interval=0.3)) as server:
        start = [r.getMessage() for r in caplog.records]
        assert start[0] == f"serving {demo_dir / 'model'} as {MODEL_NAME!r}"
        assert start[1] == f"model {demo_dir / 'model'}: Qwen3MoeForCausalLM, float32 on cpu"
        assert re.fullmatch(r"KV cache: 16384 tokens \(\d+\.\d MiB\); context 512 tokens; up to 256 running requests",
                            start[2]), start[2]
        assert start[3] == f"tokenizer: {demo_dir / 'model'}"
        assert re.fullmatch(r"LoRA: 2 GPU slots of rank 8 \(\d+\.\d MiB\), host cache of unlimited adapters", start[4])
        assert start[5] == ("LoRA slots on self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, self_attn.o_proj, "
                            "mlp.experts.gate_proj, mlp.experts.up_proj, mlp.experts.down_proj; none on mlp.gate "
                            "(--lora-target-modules)")  # what alpha and beta adapt
        for line, name in zip(start[6:8], ["alpha", "beta"]):
            assert re.fullmatch(rf"adapter {name}: {demo_dir / name} \(rank 8, \d+\.\d MiB in host memory\)", line)
        caplog.clear()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        client.completions.create(model="alpha", prompt="Hello world", max_tokens=4, extra_body={"ignore_eos": True})
        time.sleep(0.8)  # the intervals of the request's steps end
        lines = [r.getMessage() for r in caplog.records if r.name == "moelora.server.stats_log"]
        time.sleep(0.7)  # idle: nothing more
        assert len([r for r in caplog.records if r.name == "moelora.server.stats_log"]) == len(lines)
    pattern = (r"running (\d), waiting 0 requests; prompt (\S+) tokens/s, generation (\S+) tokens/s; "
               r"KV cache \d+\.\d% \((\d+) of 16384 tokens\); LoRA slots 1 of 2; "
               r"prefix cache hits \d+\.\d% of prompt tokens, (\d+) tokens cached")
    matches = [re.fullmatch(pattern, line) for line in lines]
    assert lines and all(matches), lines
    assert matches[-1].group(1) == "0" and matches[-1].group(4) == "0"  # the request is done, its cache free...
    assert int(matches[-1].group(5)) > 0  # ...or cached
    assert sum(float(m.group(2)) for m in matches) > 0 and sum(float(m.group(3)) for m in matches) > 0
