"""One real server per test module: uvicorn in a background thread on 127.0.0.1, over the demo's tiny
Qwen3-MoE (fp32, CPU) with adapters alpha and beta; gamma is built too, for loading over HTTP. And `moelora serve`
as a process of its own (`start_serve`), with what tells how it stopped: the processes it started (`children`),
whether they still run, and its log's end (`assert_clean_shutdown`)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from moelora.distributed.launch import free_port
from moelora.engine.engine import Engine
from moelora.server.app import create_app
from moelora.server.engine_loop import EngineLoop
from tests.support import build_random_demo

ADAPTERS = {"alpha": 1, "beta": 2, "gamma": 3}  # name -> seed
SERVED = ["alpha", "beta"]  # loaded at start
ENGINE_OPTIONS = dict(device="cpu", dtype="float32", max_loras_per_batch=2, max_lora_rank=8)
MODEL_NAME = "tiny-moe"


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    """model/, alpha/, beta/, gamma/, and broken/: gamma with a rank its tensors do not have."""
    root = tmp_path_factory.mktemp("server-demo")
    build_random_demo(root, ADAPTERS)
    shutil.copytree(root / "gamma", root / "broken")
    config = json.loads((root / "broken" / "adapter_config.json").read_text())
    (root / "broken" / "adapter_config.json").write_text(json.dumps({**config, "r": 4}))
    return root


def make_engine(root: Path, adapters: list[str]) -> Engine:
    return Engine(str(root / "model"), lora_paths={n: str(root / n) for n in adapters}, **ENGINE_OPTIONS)


@dataclass
class Server:
    url: str        # http://127.0.0.1:PORT
    loop: EngineLoop

    def on_engine(self, fn):
        """fn() run in the engine thread (the engine is not thread-safe)."""
        return self.loop.call(fn).result(timeout=30)

    def idle(self, timeout: float = 10.0) -> bool:
        """True once nothing is in flight and every KV slot and request row is free (KV slots: or cached, held by
        no request)."""
        engine = self.loop.engine

        def check() -> bool:
            scheduler = engine.scheduler
            return (not engine.has_unfinished() and scheduler.available_slots == engine.runner.kv.num_slots - 1
                    and scheduler.pool.free_rows == engine.config.max_running_requests)
        deadline = time.monotonic() + timeout
        while not self.on_engine(check):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True


def env() -> dict[str, str]:
    """This process's import path for a child python (this worktree's moelora first)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def serve_argv(root: Path, *flags: str) -> list[str]:
    """`moelora serve`'s arguments (after the program): the demo's model, fp32 on the CPU, alpha served, and `flags`."""
    return ["serve", "--model-path", str(root / "model"), "--lora-paths", f"alpha={root / 'alpha'}",
            "--device", "cpu", "--dtype", "float32", "--max-lora-rank", "8", "--max-loras-per-batch", "2", *flags]


def start_serve(command: list[str], port: int, log: Path, timeout: float = 60.0) -> subprocess.Popen:
    """`command`, a `moelora serve` on 127.0.0.1:port, started with its stderr (its log) to the file `log`; returned
    once /health answers 200. Fails the test, the process killed, if it exits or is not up within `timeout` s."""
    with log.open("w") as stderr:
        proc = subprocess.Popen(command, env=env(), stderr=stderr)
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, f"the server exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the server did not come up:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    return proc
            except httpx.TransportError:
                time.sleep(0.2)
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def children(pid: int) -> dict[int, str]:
    """The processes whose parent is `pid` -> their command lines (read from /proc: psutil is no dependency). A
    `moelora serve` of several ranks has its ranks ("spawn_main" in the command line) and multiprocessing's resource
    tracker."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            # after the command's name, in parentheses that may hold anything: the state, then the parent's pid
            if entry.name.isdigit() and int((entry / "stat").read_text().rpartition(")")[2].split()[1]) == pid:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # it ended as we looked
            pass
    return found


def running(pid: int) -> bool:
    """Whether the process exists and has not ended (a zombie has: it waits to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def wait_ended(started: dict[int, str], timeout: float) -> None:
    """Fails unless every process of `started` (pid -> command line) has ended within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while alive := [pid for pid in started if running(pid)]:
        assert time.monotonic() < deadline, f"still running after {timeout:g} s: {[started[pid] for pid in alive]}"
        time.sleep(0.1)


def assert_clean_shutdown(log: Path) -> None:
    """A `moelora serve` log that ends with uvicorn's shutdown, completed, and no traceback or warning after it."""
    logged = log.read_text()
    assert "Traceback" not in logged, logged
    after = logged.partition("INFO:     Shutting down\n")[2].splitlines()
    assert "INFO:     Application shutdown complete." in after, logged
    assert not [line for line in after if not line.startswith("INFO:")], "\n".join(after)


def stop_all(proc: subprocess.Popen, started: dict[int, str]) -> None:
    """After a test of a `moelora serve` process, whatever its checks found: nothing of it left running."""
    if proc.poll() is None:  # stopped as a user would, its ranks with it
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pid in started:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


@contextmanager
def serving(app: FastAPI) -> Iterator[Server]:
    """The app served by uvicorn in a background thread until the block ends."""
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield Server(f"http://127.0.0.1:{port}", app.state.engine_loop)
    finally:
        uv.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(demo_dir):
    with serving(create_app(make_engine(demo_dir, SERVED), MODEL_NAME)) as s:
        yield s


@pytest.fixture(scope="module")
def reference(demo_dir) -> Engine:
    """An engine of its own with every adapter: what each request gives alone."""
    return make_engine(demo_dir, list(ADAPTERS))
