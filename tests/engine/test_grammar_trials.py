"""Trial compiles: a grammar is compiled first in a worker process, killed once it has taken too long or once its
request has gone, and only a grammar whose trial ended in time is compiled in the caller's process."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("xgrammar")

from moelora.engine import grammar_trials, structured_output
from moelora.engine.grammar_trials import GrammarTrials, TrialCancelled
from moelora.engine.sampling_params import StructuredOutput
from tests.support import tiny_tokenizer

# xgrammar's compile time grows steeply with a schema's optional properties: 2000 take 9 s on the tiny vocabulary
# of these tests (on a 2-core CPU), 4000 far longer than any test waits
SLOW = StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {
    f"p{i}": {"type": "integer"} for i in range(4000)}}))


@pytest.fixture
def backend():
    tokenizer = tiny_tokenizer()
    return structured_output.GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


@pytest.fixture
def trials(backend):
    trials = GrammarTrials(backend, 0.5, workers=2)
    yield trials
    trials.close()


def pids(trials: GrammarTrials) -> set[int]:
    return {w.process.pid for w in trials._idle + list(trials._busy)}


def alive(pid: int) -> bool:
    """Whether the process exists and has not ended (a zombie has: it waits to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def workers_of(server_pid: int) -> list[int]:
    """The live grammar workers that `server_pid` started (their command line ends with its pid)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if entry.name.isdigit() and b"grammar_trials" in b" ".join(args) and args[-2:-1] == [str(server_pid).encode()] \
                and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def test_a_grammar_tried_in_time_is_compiled_and_its_worker_kept(backend, trials, monkeypatch):
    tried, calls = [], []
    real = structured_output.compile_spec
    monkeypatch.setattr(structured_output, "compile_spec", lambda compiler, spec: calls.append(spec) or
                        real(compiler, spec))
    spec = StructuredOutput("regex", "[ab]+c")
    compiled = backend.compile(spec, trial=lambda s: tried.append(s) or trials.check(s))
    assert tried == [spec] and calls == [spec]  # (this process's compile: the trial's is in its worker)
    worker = pids(trials)
    assert len(worker) == 1
    trials.check(StructuredOutput("choice", choices=("yes", "no")))
    assert pids(trials) == worker  # the same process, ready for the next grammar
    # a grammar compiled already is not tried again
    assert backend.compile(spec, trial=lambda s: tried.append(s)) is compiled and tried == [spec]


def test_an_invalid_grammar_fails_its_trial_as_its_compile_would(backend, trials):
    spec = StructuredOutput("regex", "[ab")
    with pytest.raises(ValueError) as direct:
        structured_output.compile_spec(backend._get_compiler(), spec)
    with pytest.raises(ValueError) as tried:
        trials.check(spec)
    assert str(tried.value) == str(direct.value) and "the regex is not valid" in str(tried.value)
    assert len(pids(trials)) == 1  # a refused grammar costs its worker nothing


def test_a_grammar_past_the_time_limit_is_refused_and_its_worker_killed(backend, trials, monkeypatch):
    trials.check(StructuredOutput("regex", "x"))  # a started worker: the limit is the compile's alone
    (worker,) = pids(trials)
    calls = []
    monkeypatch.setattr(structured_output, "compile_spec", lambda compiler, spec: calls.append(spec))
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"the grammar takes longer than the 0.5 s a grammar may take to compile"):
        backend.compile(SLOW, trial=trials.check)
    assert time.monotonic() - start < 30 and not calls  # never compiled here
    assert not alive(worker)
    (replacement,) = pids(trials)  # started at once, in its place
    assert replacement != worker
    trials.check(StructuredOutput("regex", "y"))
    assert pids(trials) == {replacement}


def test_a_cancelled_trial_kills_its_worker(trials):
    cancelled = threading.Event()
    failed = []

    def check() -> None:
        try:
            trials.check(SLOW, cancelled)
        except BaseException as e:
            failed.append(e)
    trials.time_limit = 600.0
    thread = threading.Thread(target=check)
    thread.start()
    deadline = time.monotonic() + 60
    while not trials._busy or not next(iter(trials._busy)).ready:  # the worker is in the slow compile
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.02)
    (worker,) = pids(trials)
    cancelled.set()
    thread.join(timeout=30)
    assert not thread.is_alive() and len(failed) == 1 and isinstance(failed[0], TrialCancelled)
    assert not alive(worker)


def test_a_worker_that_dies_in_a_compile_fails_that_grammar_only(trials):
    """A compile that ends its process (xgrammar crashing on a grammar) is that grammar's failure; the next trial
    gets a new worker."""
    trials.time_limit = 600.0
    trials.check(StructuredOutput("regex", "x"))
    (worker,) = pids(trials)
    threading.Timer(1.0, lambda: os.kill(worker, 9)).start()
    with pytest.raises(ValueError, match="compiling the json schema ended the compiling process"):
        trials.check(SLOW)
    trials.check(StructuredOutput("regex", "y"))


def test_trials_run_in_at_most_their_workers(backend):
    trials = GrammarTrials(backend, 1.0, workers=2)
    try:
        errors = []
        threads = [threading.Thread(target=lambda: errors.append(pytest.raises(ValueError, trials.check, SLOW)))
                   for _ in range(4)]
        for t in threads:
            t.start()
        most = 0
        while any(t.is_alive() for t in threads):
            most = max(most, len(trials._busy))
            time.sleep(0.01)
        assert len(errors) == 4 and most == 2 and len(pids(trials)) == 2
    finally:
        trials.close()


def test_closing_kills_every_worker(backend):
    trials = GrammarTrials(backend, 600.0, workers=2)
    trials.check(StructuredOutput("regex", "x"))
    started = pids(trials)
    failed = []
    thread = threading.Thread(target=lambda: failed.append(pytest.raises(TrialCancelled, trials.check, SLOW)))
    thread.start()
    while len(trials._busy) < 1:
        time.sleep(0.01)
    trials.close()
    thread.join(timeout=30)
    assert not thread.is_alive() and failed and not any(alive(p) for p in started) and not pids(trials)
    with pytest.raises(RuntimeError, match="shut down"):
        trials.check(StructuredOutput("regex", "z"))


def test_a_worker_started_while_closing_is_killed(backend, monkeypatch):
    """close() between a trial's check of the trials and its new worker's start: that worker is killed too."""
    trials = GrammarTrials(backend, 600.0, workers=1)
    info = backend.tokenizer_info()
    started = threading.Event()

    def slow_info():
        started.set()
        time.sleep(0.5)
        return info
    monkeypatch.setattr(backend, "tokenizer_info", slow_info)
    failed = []
    thread = threading.Thread(target=lambda: failed.append(pytest.raises(TrialCancelled, trials.check, SLOW)))
    thread.start()
    started.wait(timeout=30)
    trials.close()
    thread.join(timeout=30)
    assert not thread.is_alive() and failed and not pids(trials) and not workers_of(os.getpid())


def test_a_trial_cancelled_before_it_starts_costs_no_worker(trials):
    trials.check(StructuredOutput("regex", "x"))
    worker = pids(trials)
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(TrialCancelled):
        trials.check(SLOW, cancelled)
    assert pids(trials) == worker and all(alive(p) for p in worker)


def test_the_limit_counts_cpu_time_and_wall_time_bounds_a_worker_that_gets_none(trials):
    """A worker that gets no CPU (stopped here; starved on a loaded machine) takes no CPU time: the wall-clock bound
    of WALL_LIMITS time limits ends its trial."""
    trials.check(StructuredOutput("regex", "x"))
    (worker,) = trials._idle
    os.kill(worker.process.pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(ValueError, match="takes longer than"):
        trials.check(StructuredOutput("regex", "y"))
    assert grammar_trials.WALL_LIMITS * trials.time_limit <= time.monotonic() - start < 30
    assert not alive(worker.process.pid)


def test_a_cancel_while_a_worker_starts_is_seen(trials):
    """A worker that has not read its vocabulary yet (still importing, or stopped here) holds no trial past its
    request's end."""
    worker = trials._take()
    os.kill(worker.process.pid, signal.SIGSTOP)
    trials._put(worker, keep=True)
    cancelled = threading.Event()
    threading.Timer(0.5, cancelled.set).start()
    start = time.monotonic()
    with pytest.raises(TrialCancelled):
        trials.check(StructuredOutput("regex", "x"), cancelled)
    assert time.monotonic() - start < 5 and not alive(worker.process.pid)


def test_the_worker_imports_this_moelora_whatever_the_current_directory_holds(trials, tmp_path, monkeypatch):
    (tmp_path / "moelora").mkdir()
    (tmp_path / "moelora" / "__init__.py").write_text("raise ImportError('the wrong moelora')\n")
    monkeypatch.chdir(tmp_path)
    trials.check(StructuredOutput("regex", "x"))


def test_a_worker_ends_with_a_server_killed_outright(tmp_path):
    """A server killed by SIGKILL (or the OOM killer) runs no clean-up: its workers, in sessions of their own, end
    themselves, in a compile too."""
    script = tmp_path / "server.py"
    script.write_text(f"""
import os, sys, threading, time
sys.path[:0] = {[str(Path(__file__).parents[2])]!r}
from moelora.engine import grammar_trials, structured_output
from moelora.engine.grammar_trials import GrammarTrials
from tests.engine.test_grammar_trials import SLOW
from tests.support import tiny_tokenizer
tokenizer = tiny_tokenizer()
trials = GrammarTrials(structured_output.GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id]), 600.0, 1)
threading.Thread(target=trials.check, args=(SLOW,), daemon=True).start()
while not trials._busy or not next(iter(trials._busy)).ready:
    time.sleep(0.02)
print(next(iter(trials._busy)).process.pid, flush=True)
time.sleep(600)
""")
    server = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(server.stdout.readline())
        assert alive(worker)
    finally:
        server.kill()
        server.wait()
    deadline = time.monotonic() + 10
    while alive(worker):
        assert time.monotonic() < deadline, "the worker outlived its server"
        time.sleep(0.05)


@pytest.mark.parametrize("limit", [0, -1, float("nan")])
def test_the_time_limit_is_a_positive_number_of_seconds(backend, limit):
    with pytest.raises(ValueError, match="a number of seconds > 0"):
        GrammarTrials(backend, limit, workers=1)
