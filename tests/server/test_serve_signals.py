"""`moelora serve`, the command run as a process of its own, stopped by SIGTERM while it starts, before /health
answers, at two ranks: its second rank must not outlive it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from moelora.distributed.launch import START_TIMEOUT, free_port
from tests.server.conftest import children, env, serve_argv, stop_all, wait_ended


def _command(root: Path, port: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "moelora.cli",
            *serve_argv(root, "--served-model-name", "tiny-moe", "--port", str(port), *flags)]


def _wait_until(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


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
