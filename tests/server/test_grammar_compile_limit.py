"""A request's grammar may take `grammar_compile_timeout` seconds to compile: past it the request gets a 400 naming
its field, and a client that leaves while its grammar compiles stops that compile. Before, a slow grammar (a schema
of thousands of optional properties) held one of the server's compile threads, and a core, for minutes, whoever was
still waiting for it: four such clients made every other grammar wait."""
import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from moelora.server.app import create_app
from tests.server.conftest import MODEL_NAME, SERVED, make_engine, serving
from tests.server.test_sampling_api import MESSAGES, PROMPT

LIMIT = 0.5
# 4000 optional properties: minutes of xgrammar's compile on the tiny vocabulary
SLOW_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(4000)}}


@pytest.fixture(scope="module")
def server(demo_dir):
    with serving(create_app(make_engine(demo_dir, SERVED), MODEL_NAME, grammar_compile_timeout=LIMIT)) as s:
        yield s


@pytest.mark.parametrize("path, field, grammar", [
    ("/v1/completions", "guided_json", {"guided_json": SLOW_SCHEMA}),
    ("/v1/chat/completions", "response_format",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "slow", "schema": SLOW_SCHEMA}}}),
])
def test_a_grammar_past_the_limit_is_a_400_naming_its_field(server, path, field, grammar):
    body = {"model": "alpha", "max_tokens": 2, **grammar,
            **({"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES})}
    r = httpx.post(f"{server.url}{path}", json=body, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and f"takes longer than the {LIMIT:g} s a grammar may take to compile" in \
        error["message"], error
    ok = {**body, "guided_json": None, "response_format": None, "guided_regex": "[ab]+"}
    assert httpx.post(f"{server.url}{path}", json=ok, timeout=60).status_code == 200
    assert server.idle()


def test_a_client_that_leaves_stops_its_grammars_compile(server):
    trials = server.loop.grammar_trials
    trials.time_limit = 600.0  # only the client's leaving stops this one
    try:
        body = json.dumps({"model": "alpha", "max_tokens": 2, "prompt": PROMPT, "guided_json": SLOW_SCHEMA}).encode()
        host, port = server.url.removeprefix("http://").split(":")
        client = socket.create_connection((host, int(port)))
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 60
        while not (busy := [w for w in list(trials._busy) if w.ready]):  # its trial is compiling
            assert time.monotonic() < deadline, "the trial did not start"
            time.sleep(0.02)
        (worker,) = busy
        client.close()
        deadline = time.monotonic() + 30
        while worker.process.poll() is None:
            assert time.monotonic() < deadline, "the trial's worker still compiles after its client left"
            time.sleep(0.02)
    finally:
        trials.time_limit = LIMIT
    assert server.idle()
    body = {"model": "alpha", "max_tokens": 2, "prompt": PROMPT, "guided_choice": ["yes", "no"]}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200


def test_a_shutdown_ends_the_grammars_compiling(demo_dir):
    """The server's drain stops its grammars' trials: a request whose grammar still compiles gets a 503 at once, not
    after its compile (past --shutdown-timeout)."""
    with serving(create_app(make_engine(demo_dir, SERVED), MODEL_NAME, grammar_compile_timeout=600)) as server:
        trials = server.loop.grammar_trials
        body = {"model": "alpha", "max_tokens": 2, "prompt": PROMPT, "guided_json": SLOW_SCHEMA}
        answers = []
        client = threading.Thread(target=lambda: answers.append(httpx.post(f"{server.url}/v1/completions", json=body,
                                                                           timeout=120)))
        client.start()
        deadline = time.monotonic() + 60
        while not [w for w in list(trials._busy) if w.ready]:
            assert time.monotonic() < deadline, "the trial did not start"
            time.sleep(0.02)
        asyncio.run(server.loop.drain(0, lambda: False))
        client.join(timeout=30)
        assert not client.is_alive() and answers[0].status_code == 503, answers
        assert answers[0].json()["error"]["message"] == "the server is shutting down"
        assert not trials._busy and not trials._idle


def test_requests_waiting_for_their_grammars_count_as_queued(demo_dir):
    """--max-queued-requests bounds the requests waiting for their grammars too: slow grammars queued up behind the
    grammar threads without bound, every later grammar request waiting behind them."""
    engine = make_engine(demo_dir, SERVED)
    with serving(create_app(engine, MODEL_NAME, max_queued_requests=2, grammar_compile_timeout=600)) as server:
        trials = server.loop.grammar_trials
        slow = json.dumps({"model": "alpha", "max_tokens": 2, "prompt": PROMPT, "guided_json": SLOW_SCHEMA}).encode()
        host, port = server.url.removeprefix("http://").split(":")
        clients = []
        try:
            for _ in range(2):
                client = socket.create_connection((host, int(port)))
                client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n%s" % (len(slow), slow))
                clients.append(client)
            deadline = time.monotonic() + 60
            while server.loop._compiling < 2:
                assert time.monotonic() < deadline, "the slow grammars did not start compiling"
                time.sleep(0.02)
            body = {"model": "alpha", "max_tokens": 2, "prompt": PROMPT, "guided_choice": ["yes", "no"]}
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
            plain = {"model": "alpha", "max_tokens": 2, "prompt": PROMPT}  # no grammar: queued behind them as well
            assert httpx.post(f"{server.url}/v1/completions", json=plain, timeout=60).status_code == 503
        finally:
            for client in clients:
                client.close()
        deadline = time.monotonic() + 30
        while server.loop._compiling or trials._busy:
            assert time.monotonic() < deadline, "the slow grammars' compiles did not end with their clients"
            time.sleep(0.02)
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        assert server.idle()
