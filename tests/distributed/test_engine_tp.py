"""The engine over several ranks (CPU processes with gloo, started by the engine): the same tokens and
log-probs as one rank, adapters loaded and unloaded at runtime with requests in flight on every rank, and a
rank that dies or hangs stops the engine with an error naming it instead of hanging."""
import os
import signal
import time

import pytest

from moelora.engine.engine import Engine, EngineDead, RequestFailed
from moelora.engine.sampling_params import SamplingParams
from moelora.lora import AdapterError
from tests.models.families import assert_logprobs_close

PROMPTS = [[(7 * i + 3 * j) % 90 + 3 for j in range(5 + i)] for i in range(4)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("family, options", [
    ("qwen3_moe", dict(tp_size=2, ep_size=2)),
    ("deepseek_v3", dict(tp_size=2, enable_expert_parallel=True, moe_dispatch="all_to_all")),
])
def test_same_tokens_and_logprobs_as_one_rank(family, options, start_engine):
    one, many = start_engine(family), start_engine(family, **options)
    loras = ["full", None, "partial", "full"]
    assert [o.token_ids for o in many.generate(PROMPTS, GREEDY, lora=loras)] == \
        [o.token_ids for o in one.generate(PROMPTS, GREEDY, lora=loras)]
    for got, want in zip(many.prompt_logprobs(PROMPTS, lora=loras), one.prompt_logprobs(PROMPTS, lora=loras)):
        assert_logprobs_close(got, want, f"{family} {options}", 2e-5)
    assert any(line.startswith("parallel: 2 ranks") for line in many.summary())


def _drive(engine, partial_path: str) -> list[list[int]]:
    """Requests of "full" (long) and the base model; at step 2 "late" is loaded and a short request names it,
    and "full" is unloaded with its request in flight; at step 6 "partial" needs a slot of the two: it evicts
    "late", whose request is done, not "full"."""
    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(PROMPTS[0], params(12), "full"), engine.add_request(PROMPTS[1], params(8))]
    tokens = {}
    for step in range(40):
        if step == 2:
            engine.load_lora("late", partial_path)
            rids.append(engine.add_request(PROMPTS[2], params(2), "late"))
            engine.unload_lora("full")
            with pytest.raises(AdapterError, match="being unloaded"):
                engine.add_request(PROMPTS[3], params(2), "full")
        if step == 6:
            rids.append(engine.add_request(PROMPTS[3], params(4), "partial"))
        for out in engine.step():
            tokens.setdefault(out.rid, []).extend(out.token_ids)
        if step > 6 and not engine.has_unfinished():
            break
    assert "full" not in engine.runner.lora.names
    return [tokens[r] for r in rids]


def test_load_and_unload_with_requests_in_flight(start_engine, adapters):
    one, many = start_engine("qwen3_moe"), start_engine("qwen3_moe", tp_size=2, ep_size=2, moe_dispatch="all_to_all")
    partial = str(adapters("qwen3_moe")["partial"].path)
    assert _drive(many, partial) == _drive(one, partial)
    assert many.lora_stats.slot_evictions == one.lora_stats.slot_evictions > 0


def _wait_failed(engine: Engine, seconds: float) -> str:
    start = time.time()
    with pytest.raises(RequestFailed) as failed:
        engine.generate(PROMPTS[:2], GREEDY)
    assert time.time() - start < seconds
    assert engine.fatal is not None
    with pytest.raises(EngineDead):
        engine.add_request(PROMPTS[0], GREEDY)
    return str(failed.value)


def test_a_rank_that_dies_stops_the_engine(start_engine):
    many = start_engine("qwen3_moe", tp_size=2)
    many.generate(PROMPTS[:1], GREEDY)
    os.kill(many.workers.ranks.procs[1].pid, signal.SIGKILL)
    error = _wait_failed(many, 20)
    assert "rank 1 exited with code -9" in error and "a step failed on the tensor-parallel ranks" in error


def test_a_rank_that_hangs_stops_the_engine_within_the_timeout(start_engine):
    many = start_engine("qwen3_moe", tp_size=2, dist_timeout=3)
    many.generate(PROMPTS[:1], GREEDY)
    os.kill(many.workers.ranks.procs[1].pid, signal.SIGSTOP)
    error = _wait_failed(many, 3 + 20)
    assert "every rank is still running: one did not answer in time" in error
    assert not many.workers.ranks.procs[1].is_alive()  # stopped, then killed
