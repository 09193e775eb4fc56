"""The engine's step counters (StepStats) and its step trace (MOELORA_STEP_TRACE) on the tiny Qwen3-MoE."""
import json
import time

import pytest

from moelora.engine.sampling_params import SamplingParams
from moelora.engine.step_stats import PHASES, StepStats, StepTrace

FAMILY = "qwen3_moe"
PROMPTS = [[(5 * i + j) % 90 + 3 for j in range(4 + i)] for i in range(3)]  # 4, 5 and 6 tokens
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_count_step_tells_the_kinds_apart():
    stats = StepStats()
    stats.count_step(0, [5, 6], num_stalled=3)   # two prompts, three running requests left out
    stats.count_step(4, [1, 1, 1, 1], num_stalled=0)
    stats.count_step(2, [1, 1, 7], num_stalled=0)  # enable_mixed_chunk
    assert (stats.prefill_steps, stats.decode_steps, stats.mixed_steps, stats.steps) == (1, 1, 1, 3)
    assert (stats.decode_rows, stats.prompt_pieces, stats.prompt_tokens, stats.stalled_rows) == (6, 3, 18, 3)
    assert set(stats.as_dict()) >= {f"{phase}_seconds" for phase in PHASES} | {"admitted", "admission_wait_seconds"}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_one_wave_is_one_prompt_step_then_full_decode_steps(make_engine, overlap):
    engine = make_engine(FAMILY, disable_overlap_schedule=not overlap)
    start = time.perf_counter()
    engine.generate(PROMPTS, PARAMS)
    stats = engine.step_stats
    # the prompt step samples every request's first token, each decode step one more for all three
    assert (stats.prefill_steps, stats.decode_steps, stats.mixed_steps) == (1, PARAMS.max_tokens - 1, 0)
    assert stats.decode_rows == len(PROMPTS) * (PARAMS.max_tokens - 1) and stats.stalled_rows == 0
    assert (stats.prompt_pieces, stats.prompt_tokens) == (len(PROMPTS), sum(map(len, PROMPTS)))
    assert stats.admitted == len(PROMPTS)
    assert 0 < stats.admission_wait_seconds < len(PROMPTS) * (time.perf_counter() - start)
    assert stats.seconds["launch"] > 0 and stats.seconds["schedule"] > 0 and stats.seconds["postprocess"] > 0


def test_a_prompt_step_counts_the_decode_rows_it_stalls_and_the_wait_from_the_given_arrival(make_engine):
    engine = make_engine(FAMILY)
    engine.add_request(PROMPTS[0], PARAMS)
    engine.step()
    engine.step()  # the first request decodes
    engine.add_request(PROMPTS[1], PARAMS, arrival_time=time.perf_counter() - 10.0)
    engine.step()  # the second one's prompt step, without the first's decode row
    stats = engine.step_stats
    assert (stats.prefill_steps, stats.decode_steps, stats.stalled_rows) == (2, 1, 1)
    assert stats.admitted == 2 and stats.admission_wait_seconds >= 10.0
    while engine.has_unfinished():
        engine.step()


def test_the_trace_has_a_line_per_step(make_engine, monkeypatch, tmp_path):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("MOELORA_STEP_TRACE", str(path))
    engine = make_engine(FAMILY, disable_overlap_schedule=True)
    engine.generate(PROMPTS, PARAMS)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == engine.step_stats.steps  # without overlap every call runs one step
    assert lines[0]["prefill_steps"] == 1 and lines[0]["prompt_pieces"] == len(PROMPTS)
    assert all(line["decode_steps"] == 1 and line["decode_rows"] == len(PROMPTS) for line in lines[1:])
    assert [line["outputs"] for line in lines] == [len(PROMPTS)] * PARAMS.max_tokens
    assert all(line["ms"] >= 0 and line["t_ms"] >= 0 for line in lines) and lines[-1]["running"] == 0


@pytest.mark.parametrize("where", ["missing/trace.jsonl", "."])
def test_a_step_trace_that_cannot_be_written_is_an_error_naming_the_variable(tmp_path, where):
    """A directory that does not exist, or a directory: one error naming $MOELORA_STEP_TRACE, not an OSError."""
    with pytest.raises(ValueError, match=r"\$MOELORA_STEP_TRACE: cannot write the step trace to .*: (No such file or "
                                         r"directory|Is a directory)"):
        StepTrace(str(tmp_path / where))
