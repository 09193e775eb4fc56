"""`moelora serve`, the command run as a process of its own, stopped by SIGTERM (or Ctrl-C) where idle serving's
tests (tests/distributed/test_serve_tp.py) do not: with requests in flight, at one rank and at two, which end (or,
with --shutdown-timeout, finish) instead of holding the server up until their last token; and while it starts,
before /health answers, at two ranks, whose second rank must not outlive it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from moelora.distributed.launch import START_TIMEOUT, free_port
from tests.server.conftest import (assert_clean_shutdown, children, env, running, serve_argv, start_serve, stop_all,
                                   wait_ended)

# most of the demo's 512-token context: seconds of steps on this CPU (a real model's long answer: minutes)
LONG = {"model": "tiny-moe", "prompt": "the quick brown fox", "max_tokens": 480, "temperature": 0,
        "ignore_eos": True}


def _command(root: Path, port: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "moelora.cli",
            *serve_argv(root, "--served-model-name", "tiny-moe", "--port", str(port), *flags)]


def _stream(url: str, first: threading.Event) -> list[str]:
    """A streamed LONG completion: the data of each of its events until the server ends the stream; `first` is
    set once the first one came."""
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                first.set()
    return events


def _running_requests(url: str) -> float:
    """The requests the engine runs, as /metrics says."""
    line = next(line for line in httpx.get(f"{url}/metrics").text.splitlines()
                if line.startswith("moelora:num_running_reqs "))
    return float(line.split()[1])


def _wait_until(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@contextmanager
def _two_requests(url: str) -> Iterator[tuple[Future, Future]]:
    """A streamed LONG completion and one not streamed, each in a thread of its own, given once both run in the
    engine and the stream has begun: their futures, of its events (_stream) and of the other's httpx.Response."""
    with ThreadPoolExecutor(2) as pool:
        first = threading.Event()
        stream = pool.submit(_stream, url, first)
        plain = pool.submit(httpx.post, f"{url}/v1/completions", json=LONG, timeout=60)
        _wait_until(lambda: first.is_set() and _running_requests(url) == 2, 60)
        yield stream, plain


def _finish_reasons(events: list[str]) -> list[str | None]:
    """Each completion chunk's finish_reason, in order (the usage chunk, an error event and [DONE] have none)."""
    return [c["choices"][0]["finish_reason"] for c in map(json.loads, events[:-1]) if c.get("choices")]


def _assert_ended_by_the_shutdown(events: list[str], reply: httpx.Response) -> None:
    """The stream (its events) and the other request (its reply) were cut short, each saying why."""
    assert set(_finish_reasons(events)) == {None}, "the server waited for the stream's last token"
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "the server is shutting down", events[-2]
    assert reply.status_code == 500 and reply.json()["error"]["message"] == "the server is shutting down"


@pytest.mark.parametrize("tp", [1, 2], ids=["1-rank", "tp2"])
def test_sigterm_ends_the_requests_in_flight(demo_dir, tmp_path, tp):
    """A stream of most of the context and a request that is not streamed run when SIGTERM comes: the server does
    not wait for them (uvicorn alone waits for every open response, until its last token); the stream ends with an
    error event and [DONE], the other gets a 500, both saying the server is shutting down. The server exits at
    once, as idle, with its rank, its log clean."""
    port, log = free_port(), tmp_path / "serve.log"
    proc = start_serve(_command(demo_dir, port, "--tp-size", str(tp), "--ep-size", str(tp)), port, log,
                       timeout=START_TIMEOUT + 60)  # the rank's imports may take that long
    started: dict[int, str] = {}
    try:
        with _two_requests(f"http://127.0.0.1:{port}") as (stream, plain):
            started.update(children(proc.pid))
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn raises SIGTERM again once it shut down
            _assert_ended_by_the_shutdown(stream.result(timeout=30), plain.result(timeout=30))
        ranks = [pid for pid, cmdline in started.items() if "spawn_main" in cmdline]
        assert len(ranks) == tp - 1, started
        assert not [pid for pid in ranks if running(pid)], started
        wait_ended(started, 10)  # multiprocessing's resource tracker too
        assert "moelora.server.engine_loop: shutting down: 2 requests in flight; ending them (--shutdown-timeout 0)" \
            in log.read_text()
        assert_clean_shutdown(log)
    finally:
        stop_all(proc, started)


def test_a_shutdown_timeout_lets_the_requests_in_flight_finish(demo_dir, tmp_path):
    """With --shutdown-timeout 60, SIGTERM closes the listening socket at once (no new connection) and lets both
    requests finish, every token sent, before the server exits."""
    port, log = free_port(), tmp_path / "serve.log"
    proc = start_serve(_command(demo_dir, port, "--shutdown-timeout", "60"), port, log)
    try:
        url = f"http://127.0.0.1:{port}"
        with _two_requests(url) as (stream, plain):
            proc.send_signal(signal.SIGTERM)

            def refused() -> bool:
                try:
                    httpx.get(f"{url}/health")
                except httpx.ConnectError:
                    return True
                return False
            _wait_until(refused, 5)
            assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
            events, reply = stream.result(timeout=30), plain.result(timeout=30)
        assert events[-1] == "[DONE]" and _finish_reasons(events)[-1] == "length"
        text = "".join(c["choices"][0]["text"] for c in map(json.loads, events[:-1]))
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == text  # greedy: the same tokens
        assert reply.json()["usage"]["completion_tokens"] == LONG["max_tokens"]
        assert "shutting down: 2 requests in flight; waiting up to 60 s for them (--shutdown-timeout)" \
            in log.read_text()
        assert_clean_shutdown(log)
    finally:
        stop_all(proc, {})


def test_a_second_ctrl_c_ends_the_drain(demo_dir, tmp_path):
    """With --shutdown-timeout 60, Ctrl-C starts the drain and a second one ends the requests there; the shutdown
    then goes on as after SIGTERM, the app's included (uvicorn's own forced exit would skip it, and log the
    lifespan's cancellation)."""
    port, log = free_port(), tmp_path / "serve.log"
    proc = start_serve(_command(demo_dir, port, "--shutdown-timeout", "60"), port, log)
    try:
        with _two_requests(f"http://127.0.0.1:{port}") as (stream, plain):
            proc.send_signal(signal.SIGINT)
            _wait_until(lambda: "waiting up to 60 s for them" in log.read_text(), 10)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) in (0, -signal.SIGINT)
            _assert_ended_by_the_shutdown(stream.result(timeout=30), plain.result(timeout=30))
        assert "shutting down: ending the 2 requests still in flight" in log.read_text()
        assert_clean_shutdown(log)
    finally:
        stop_all(proc, {})


def _has_socket(pid: int) -> bool:
    """Whether the process has a socket open: a rank has once it joins its world (before, only pipes)."""
    try:
        return any(os.readlink(fd).startswith("socket:") for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:  # it ended, or one of its descriptors closed as we looked
        return False


@pytest.mark.parametrize("moment", ["importing", "joined"])
def test_sigterm_while_starting_leaves_no_rank(demo_dir, tmp_path, moment):
    """SIGTERM before /health answers, at two ranks: as the spawned rank imports, or once it joined its world (it
    loads its share, as rank 0 does, or waits for rank 0). The server ends at once, as SIGTERM ends a process: none
    of its cleanup runs (the resource tracker then says it unlinked the semaphores shared with the rank), so its rank
    ends by itself, once it sees its parent gone (after its imports, in the first case)."""
    port, log = free_port(), tmp_path / "serve.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(_command(demo_dir, port, "--tp-size", "2", "--ep-size", "2"), env=env(), stderr=stderr)
    started: dict[int, str] = {}
    try:
        def reached() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            started.update(children(proc.pid))
            ranks = [pid for pid, cmdline in started.items() if "spawn_main" in cmdline]
            return bool(ranks) and (moment == "importing" or _has_socket(ranks[0]))
        _wait_until(reached, START_TIMEOUT)
        with pytest.raises(httpx.ConnectError):  # still starting: nothing listens yet
            httpx.get(f"http://127.0.0.1:{port}/health")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == -signal.SIGTERM
        wait_ended(started, START_TIMEOUT)  # the rank's imports may take that long
        assert "Traceback" not in log.read_text()
    finally:
        stop_all(proc, started)
