"""start_profile / stop_profile on the tiny Qwen3-MoE (CPU: the host's ops): the traces and summaries written, misuse
refused with the reason, the engine serving on after each, and a rank's failing profile kept to that rank."""
import gzip
import json
import logging
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moelora.engine.model_runner import _profile_command
from moelora.engine.profiler import StepProfiler, profile_files, read_summary
from moelora.engine.sampling_params import SamplingParams

FAMILY = "qwen3_moe"
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _assert_profile(trace: Path, expect_ops: bool) -> dict:
    """The trace is Chrome's JSON (gzip'd) and its summary lists the host's ops by self time; returns the summary."""
    assert trace.name.endswith(".trace.json.gz") and "-rank" in trace.name
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    summary = read_summary(trace)
    assert summary["device"] == "cpu"
    if expect_ops:
        names = {e.get("name") for e in events}
        assert "aten::mm" in names or "aten::addmm" in names or "aten::linear" in names, sorted(n for n in names if n)[:40]
        assert summary["kernels"] and all(count >= 1 and us >= 0 for count, us in summary["kernels"].values())
        busiest = [us for _, us in summary["kernels"].values()]
        assert busiest == sorted(busiest, reverse=True)
    return summary


def test_a_profile_holds_the_steps_between_start_and_stop(make_engine, tmp_path):
    engine = make_engine(FAMILY, profile_dir=str(tmp_path / "profiles"))
    want = [o.token_ids for o in engine.generate(PROMPTS, GREEDY, lora=["full", None])]
    engine.start_profile()
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY, lora=["full", None])] == want
    traces = engine.stop_profile()
    assert len(traces) == 1 and traces[0].parent == tmp_path / "profiles"
    _assert_profile(traces[0], expect_ops=True)
    # another profile, to a directory of the call's own: new files, the first left as it was
    engine.start_profile(str(tmp_path / "second"))
    engine.generate(PROMPTS[:1], GREEDY)
    second = engine.stop_profile()
    assert len(second) == 1 and second[0].parent == tmp_path / "second" and traces[0].is_file()
    assert not engine.runner.profiler.active and not engine.has_unfinished()


def test_profile_misuse_is_refused_with_the_reason(make_engine, tmp_path):
    engine = make_engine(FAMILY)
    with pytest.raises(ValueError, match="no directory for the profile.*profile_dir"):
        engine.start_profile()
    with pytest.raises(ValueError, match="no profile is running"):
        engine.stop_profile()
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot make the profile directory"):
        engine.start_profile(str(blocker / "profiles"))
    assert not engine.runner.profiler.active
    engine.start_profile(str(tmp_path))
    with pytest.raises(ValueError, match="a profile is running already"):
        engine.start_profile(str(tmp_path / "other"))
    assert engine.generate(PROMPTS[:1], GREEDY)[0].token_ids  # serving on, recorded in the running profile
    assert len(engine.stop_profile()) == 1 and not (tmp_path / "other").exists()


def test_a_shutdown_drops_the_running_profile(make_engine, tmp_path):
    engine = make_engine(FAMILY)
    engine.start_profile(str(tmp_path))
    engine.generate(PROMPTS[:1], GREEDY)
    engine.shutdown()
    assert not engine.runner.profiler.active and list(tmp_path.iterdir()) == []


def test_a_rank_whose_profile_fails_logs_it_and_serves_on(tmp_path, caplog):
    """A rank other than 0 that cannot write its profile (another node's directory, say): its command logs the
    error and leaves the profiler stopped instead of raising, which would end the rank and the engine with it."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    runner = SimpleNamespace(profiler=StepProfiler(1, torch.device("cpu")), dist_state=SimpleNamespace(rank=1),
                             wait_for_device=lambda: None)
    _profile_command(runner, "start", str(blocker / "profiles"), "stem")
    assert runner.profiler.active  # nothing is written before stop
    with caplog.at_level(logging.ERROR, logger="moelora.engine.model_runner"):
        _profile_command(runner, "stop")
    assert "rank 1 could not stop its profile" in caplog.text and not runner.profiler.active
    _profile_command(runner, "start", str(tmp_path), "stem")  # the next profile works
    _profile_command(runner, "stop")
    assert all(p.is_file() for p in profile_files(tmp_path, "stem", 1))
    with caplog.at_level(logging.ERROR, logger="moelora.engine.model_runner"):
        _profile_command(runner, "stop")  # none running: logged, not raised
    assert "rank 1 could not stop its profile" in caplog.text


def test_a_profile_that_cannot_be_written_still_stops(make_engine, tmp_path):
    """Its directory replaced by a file while recording: stop_profile raises, nothing records on, the engine serves
    on and profiles again."""
    engine = make_engine(FAMILY)
    directory = tmp_path / "profiles"
    engine.start_profile(str(directory))
    engine.generate(PROMPTS[:1], GREEDY)
    directory.rmdir()
    directory.write_text("")
    with pytest.raises(OSError):
        engine.stop_profile()
    assert not engine.runner.profiler.active and engine.fatal is None
    engine.start_profile(str(tmp_path / "again"))
    assert engine.generate(PROMPTS[:1], GREEDY)[0].token_ids
    assert len(engine.stop_profile()) == 1


def test_a_profile_stops_on_the_thread_that_started_it(make_engine, tmp_path):
    """torch's profiler is the thread's (stopped from another thread it crashes the process): a stop from another
    thread is refused and the profile runs on; a drop from another thread lets it go without touching torch's (the
    server's shutdown, after its engine thread ended), and a new profile runs."""
    engine = make_engine(FAMILY)
    engine.start_profile(str(tmp_path / "first"))
    errors = []

    def stop_elsewhere():
        try:
            engine.stop_profile()
        except ValueError as e:
            errors.append(str(e))
    _in_a_thread(stop_elsewhere)
    assert errors == ["the profile was started on another thread: stop it on that thread (the engine's)"]
    assert engine.runner.profiler.active
    assert len(engine.stop_profile()) == 1
    _in_a_thread(lambda: engine.start_profile(str(tmp_path / "dropped")))
    engine.drop_profile()
    assert not engine.runner.profiler.active and list((tmp_path / "dropped").iterdir()) == []
    engine.drop_profile()  # nothing running: nothing to do
    engine.start_profile(str(tmp_path / "again"))
    assert engine.generate(PROMPTS[:1], GREEDY)[0].token_ids
    assert len(engine.stop_profile()) == 1


def _in_a_thread(fn) -> None:
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()
