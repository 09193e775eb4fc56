"""A run of requests during which adapters are loaded, unloaded and evicted, shared by the CPU (gloo) and GPU
(NCCL) tests of the engine over several ranks."""
from __future__ import annotations

import pytest

from moelora.engine.engine import Engine
from moelora.engine.sampling_params import SamplingParams
from moelora.lora import AdapterError

PROMPTS = [[(7 * i + 3 * j) % 90 + 3 for j in range(5 + i)] for i in range(4)]
# (prompt, tokens, adapter) of each request drive_load_and_unload adds, in its order
REQUESTS = [(PROMPTS[0], 12, "full"), (PROMPTS[1], 8, None), (PROMPTS[2], 2, "late"), (PROMPTS[3], 4, "partial")]


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


def drive_load_and_unload(engine: Engine, late_path: str) -> list[list[int]]:
    """REQUESTS' tokens, on an engine of 2 LoRA slots holding "full" and "partial": requests of "full" (long)
    and the base model; at step 2 "late" is loaded from late_path and a short request names it, and "full" is
    unloaded with its request in flight; at step 6 "partial" needs a slot of the two: it evicts "late", whose
    request is done, not "full"."""
    (p0, n0, a0), (p1, n1, _), (p2, n2, a2), (p3, n3, a3) = REQUESTS
    rids = [engine.add_request(p0, greedy(n0), a0), engine.add_request(p1, greedy(n1))]
    tokens: dict[str, list[int]] = {}
    for step in range(40):
        if step == 2:
            engine.load_lora(a2, late_path)
            rids.append(engine.add_request(p2, greedy(n2), a2))
            engine.unload_lora(a0)
            with pytest.raises(AdapterError, match="being unloaded"):
                engine.add_request(p3, greedy(2), a0)
        if step == 6:
            rids.append(engine.add_request(p3, greedy(n3), a3))
        for out in engine.step():
            tokens.setdefault(out.rid, []).extend(out.token_ids)
        if step > 6 and not engine.has_unfinished():
            break
    assert a0 not in engine.runner.lora.names
    return [tokens[r] for r in rids]
