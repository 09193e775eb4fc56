"""Request priorities (vLLM's `priority` field and --scheduling-policy priority): a server that schedules by priority
admits lower values first; one that schedules first come, first served refuses any other priority than 0, naming
the field and the flag."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from moelora.engine.engine import Engine
from moelora.server.app import create_app
from tests.server.conftest import ENGINE_OPTIONS, MODEL_NAME, serving


def test_a_fcfs_server_refuses_priorities_but_0(server):
    body = {"model": MODEL_NAME, "max_tokens": 2}
    assert httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": [5, 6], "priority": 0},
                      timeout=60).status_code == 200
    for route, extra in (("completions", {"prompt": [5, 6]}), ("chat/completions", {"messages": [{"role": "user",
                                                                                                   "content": "hi"}]})):
        r = httpx.post(f"{server.url}/v1/{route}", json={**body, **extra, "priority": -3}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "priority", r.text
        assert "priority -3 needs the server started with --scheduling-policy priority" in err["message"], err


def test_requests_waiting_together_are_admitted_lower_priority_values_first(demo_dir):
    """The engine thread is held while three requests arrive, so that they wait together; one runs at a time."""
    engine = Engine(str(demo_dir / "model"), scheduling_policy="priority", max_running_requests=1, **ENGINE_OPTIONS)
    priorities = [5, -1, 5, 0]
    with serving(create_app(engine, MODEL_NAME)) as server:
        gate = threading.Event()
        held = server.loop.call(gate.wait)
        done: dict[int, float] = {}

        def ask(i: int) -> None:
            body = {"model": MODEL_NAME, "prompt": [5 + i, 6], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                    "priority": priorities[i]}
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            done[i] = time.perf_counter()
        with ThreadPoolExecutor(len(priorities)) as pool:
            asks = []
            for i in range(len(priorities)):  # one after the other: they arrive in this order
                asks.append(pool.submit(ask, i))
                deadline = time.monotonic() + 30
                while len(server.loop._commands) <= i:  # its add queued behind the gate
                    assert time.monotonic() < deadline and not any(a.done() for a in asks)
                    time.sleep(0.01)
            gate.set()
            held.result(timeout=30)
            for a in asks:
                a.result(timeout=60)
        assert sorted(done, key=done.get) == [1, 3, 0, 2]
        assert server.idle()
