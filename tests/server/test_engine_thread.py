"""The engine thread only steps: chat templates and tokenization run in the tokenize thread, detokenization in the
text thread, adapter files are read in a worker, so none of them holds up the steps of running requests, nor a
long prompt's tokenization the other requests' outputs."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from moelora.engine.engine import Engine
from moelora.engine.sampling_params import SamplingParams
from moelora.engine.stepper import StepOutput
from moelora.server import engine_loop
from moelora.server.app import OpenAIServing, create_app
from moelora.server.engine_loop import Delta, EngineError, Overloaded, Submission, merge_deltas
from tests.server.conftest import ENGINE_OPTIONS, MODEL_NAME, SERVED, make_engine, serving

IDS = [5, 6, 7, 8]


def post(server, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=timeout)


def test_tokenizer_work_runs_in_the_tokenize_and_text_threads(server, monkeypatch):
    tokenizer, calls = server.loop.engine.tokenizer, []
    for name in ("encode", "decode", "apply_chat_template"):
        def recorded(*args, real=getattr(tokenizer, name), name=name, **kwargs):
            calls.append((name, threading.current_thread().name))
            return real(*args, **kwargs)
        monkeypatch.setattr(tokenizer, name, recorded)
    chat = post(server, "/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": "Hi"}],
                                                 "max_tokens": 6, "logprobs": True, "top_logprobs": 2})
    echo = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": IDS, "max_tokens": 4, "echo": True,
                                            "logprobs": 1})
    assert chat.status_code == echo.status_code == 200
    assert {name for name, _ in calls} == {"encode", "decode", "apply_chat_template"}
    # the requests' own tokens and template in the tokenize thread, their outputs' (logprobs' tokens) in the text one
    assert {thread for name, thread in calls if name != "decode"} == {"moelora-tokenize_0"}
    assert {thread for name, thread in calls if name == "decode"} == {"moelora-tokenize_0", "moelora-text_0"}


def test_n_sequences_of_a_text_prompt_tokenize_it_once(server, reference, monkeypatch):
    tokenizer, encoded = server.loop.engine.tokenizer, []
    monkeypatch.setattr(tokenizer, "encode", lambda text, real=tokenizer.encode, **kw: encoded.append(text) or
                        real(text, **kw))
    body = {"model": MODEL_NAME, "prompt": ["Hello world", "the quick brown fox"], "n": 3, "max_tokens": 3,
            "temperature": 0}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200 and encoded == body["prompt"], (r.text, encoded)
    want = [o.text for p in body["prompt"] for o in reference.generate(p, SamplingParams(max_tokens=3, temperature=0))]
    assert [c["text"] for c in r.json()["choices"]] == [t for t in want for _ in range(3)]


def test_the_shutdown_drain_ends_the_requests_in_flight_and_frees_them(demo_dir):
    """The server's shutdown (EngineLoop.drain, no time to finish): a stream in flight ends with the shutdown's
    error event and [DONE], its KV slots and request row are free again, and /health says 503."""
    with serving(create_app(make_engine(demo_dir, SERVED), MODEL_NAME)) as server:
        lines: list[str] = []

        def stream() -> None:
            body = {"model": "alpha", "prompt": IDS, "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as reply:
                lines.extend(line for line in reply.iter_lines() if line)
        client = threading.Thread(target=stream)
        client.start()
        deadline = time.monotonic() + 30
        while not server.on_engine(server.loop.engine.has_unfinished):
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
        asyncio.run(server.loop.drain(0, lambda: False))
        client.join(timeout=30)
        assert not client.is_alive() and lines[-1] == "data: [DONE]"
        assert "the server is shutting down" in lines[-2], lines[-3:]
        assert server.idle()
        assert httpx.get(f"{server.url}/health").status_code == 503


def test_the_queue_limit_counts_requests_added_during_a_step(demo_dir):
    """max_queued_requests holds between steps: a request added while the engine thread is busy counts as waiting
    from its add on, not from the count the next step publishes (a burst during a long step used to pass it)."""
    engine = make_engine(demo_dir, SERVED)
    stepping, release, step = threading.Event(), threading.Event(), engine.step

    def held_step():
        stepping.set()
        release.wait(60)
        return step()
    engine.step = held_step
    with serving(create_app(engine, MODEL_NAME, max_queued_requests=2)) as server:
        sub = Submission(IDS, SamplingParams(max_tokens=2, ignore_eos=True), None)

        async def scenario() -> int:
            queue: asyncio.Queue = asyncio.Queue()
            await server.loop.submit([sub], queue)  # added: waiting; the engine thread's next step holds
            assert await asyncio.to_thread(stepping.wait, 30)
            second = asyncio.ensure_future(server.loop.submit([sub], queue))  # pending while the step holds
            await asyncio.sleep(0.2)
            try:
                with pytest.raises(Overloaded, match="2 requests are queued"):  # 1 waiting + 1 pending
                    await server.loop.submit([sub], queue)
            finally:
                release.set()
            await second
            finished = 0
            while finished < 2:  # both ended before this event loop closes
                item = await asyncio.wait_for(queue.get(), 30)
                finished += item.out.finished
            return finished
        assert asyncio.run(scenario()) == 2
        assert server.idle()


def test_a_stop_string_ends_the_request_and_frees_it(server):
    full = post(server, "/v1/completions", {"model": "beta", "prompt": IDS, "max_tokens": 12, "temperature": 0,
                                            "ignore_eos": True}).json()["choices"][0]["text"]
    stop = full.split()[1]
    out = post(server, "/v1/completions", {"model": "beta", "prompt": IDS, "max_tokens": 12, "temperature": 0,
                                           "ignore_eos": True, "stop": [stop]}).json()
    assert out["choices"][0]["text"] == full[:full.index(stop)] and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] < 12
    assert server.idle()


@pytest.mark.parametrize("slow", ["read_lora", "tokenize"])
def test_slow_file_or_text_work_does_not_hold_up_the_steps(server, demo_dir, monkeypatch, slow):
    """An adapter file or a prompt that takes long to read or tokenize (held here until the test lets
    go): a request already running goes on stepping meanwhile, and gets its response."""
    engine, entered, release = server.loop.engine, threading.Event(), threading.Event()
    real, step, steps = getattr(engine, slow), engine.step, []

    def held(*args, **kwargs):
        if slow == "read_lora" or isinstance(args[0], str):  # the running request's prompt is token ids
            entered.set()
            release.wait(90)  # longer than the running request's wait below, so that the hold cannot end first
        return real(*args, **kwargs)
    monkeypatch.setattr(engine, slow, held)
    monkeypatch.setattr(engine, "step", lambda: steps.append(1) or step())
    results: dict[str, httpx.Response] = {}

    def request(key: str, path: str, body: dict) -> threading.Thread:
        thread = threading.Thread(target=lambda: results.__setitem__(key, post(server, path, body)))
        thread.start()
        return thread
    running = request("running", "/v1/completions", {"model": "alpha", "prompt": IDS, "max_tokens": 120,
                                                     "ignore_eos": True})
    deadline = time.monotonic() + 30
    while not steps:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    other = request("other", "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": str(demo_dir / "gamma")}) \
        if slow == "read_lora" else request("other", "/v1/completions", {"model": "beta", "prompt": "Hello world",
                                                                          "max_tokens": 2})
    assert entered.wait(30)
    before = len(steps)
    while len(steps) < before + 5:
        assert time.monotonic() < deadline, "the steps stopped while the other request's work was held"
        time.sleep(0.01)
    running.join(timeout=30)  # its outputs delivered while the other's work is still held (for 90 s at most)
    finished_while_held = not running.is_alive()
    if slow == "tokenize":  # a request of token ids, sent meanwhile, needs no tokenizer: it does not wait either
        newcomer = request("newcomer", "/v1/completions", {"model": "alpha", "prompt": IDS, "max_tokens": 2})
        newcomer.join(timeout=30)
        finished_while_held = finished_while_held and not newcomer.is_alive()
    release.set()
    running.join()
    other.join()
    assert finished_while_held, "a request's response waited for the other request's work"
    assert results["running"].status_code == results["other"].status_code == 200, results["other"].text
    assert results["running"].json()["usage"]["completion_tokens"] == 120
    assert slow != "tokenize" or results["newcomer"].status_code == 200, results["newcomer"].text
    if slow == "read_lora":
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": "gamma"}).status_code == 200
    assert server.idle()


def test_an_engine_scheduling_ahead_serves_the_same_completions(demo_dir, reference):
    """overlap scheduling behind the server: streamed and whole completions, a stop string among
    them, as the engine gives them alone."""
    engine = Engine(str(demo_dir / "model"), lora_paths={n: str(demo_dir / n) for n in SERVED},
                    disable_overlap_schedule=False, **ENGINE_OPTIONS)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with serving(create_app(engine, MODEL_NAME)) as server:
        for model, prompt in [("alpha", "Hello world"), (MODEL_NAME, "the quick brown fox"), ("beta", "Hello")]:
            lora = None if model == MODEL_NAME else model
            want = reference.generate(prompt, greedy, lora=lora)[0].text
            body = {"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            assert post(server, "/v1/completions", body).json()["choices"][0]["text"] == want
            with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as r:
                chunks = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: {")]
            assert "".join(json.loads(c)["choices"][0]["text"] for c in chunks) == want
            stop = want.split()[1]
            out = post(server, "/v1/completions", {**body, "stop": [stop]}).json()["choices"][0]
            assert out["text"] == want[:want.index(stop)] and out["finish_reason"] == "stop"
        assert server.idle()


def delta(index: int, tokens: list[int], finished: bool = False, prompt: list[int] | None = None) -> Delta:
    out = StepOutput("rid", tokens, "".join(f"<{t}>" for t in tokens), finished, "length" if finished else None,
                     [{t: -1.0} for t in tokens], 4, tokens[-1] if tokens else 0, cumulative_logprob=-float(len(tokens)),
                     prompt_token_ids=prompt, prompt_logprobs=[None, *({t: -2.0} for t in prompt[1:])] if prompt else None)
    return Delta(index, out, {t: f"<{t}>" for t in [*tokens, *(prompt or ())]})


def test_outputs_that_queued_up_are_merged_per_sequence_up_to_an_error():
    items = [delta(0, [1], prompt=[7, 8]), delta(1, [1]), delta(0, [2]), delta(1, [2], finished=True), delta(0, [3])]
    first, second = merge_deltas(items)
    assert (first.index, first.out.token_ids, first.out.text) == (0, [1, 2, 3], "<1><2><3>")
    assert first.out.logprobs == [{1: -1.0}, {2: -1.0}, {3: -1.0}] and first.out.completion_tokens == 3
    assert first.out.prompt_token_ids == [7, 8] and first.out.prompt_logprobs == [None, {8: -2.0}]
    assert set(first.pieces) == {1, 2, 3, 7, 8} and first.out.cumulative_logprob == -1.0  # the latest output's
    assert (second.index, second.out.token_ids, second.out.finished, second.out.finish_reason) == (1, [1, 2], True,
                                                                                                     "length")
    error = EngineError("the engine failed")
    merged = merge_deltas([delta(0, [1]), delta(0, [2]), error, delta(0, [3])])
    assert [d.out.token_ids for d in merged[:-1]] == [[1, 2]] and merged[-1] is error


def test_a_long_backlog_merges_in_order():
    """A client that read nothing for thousands of steps (merged pair by pair, each step copied all before it)."""
    items = [delta(i % 3, [i], prompt=[7, 8] if i == 1 else None) for i in range(3000)]
    merged = merge_deltas(items)
    assert [d.index for d in merged] == [0, 1, 2]
    for d in merged:
        assert d.out.token_ids == list(range(d.index, 3000, 3)) and d.out.text == "".join(f"<{t}>" for t in
                                                                                       d.out.token_ids)
        assert d.out.logprobs == [{t: -1.0} for t in d.out.token_ids] and set(d.pieces) >= set(d.out.token_ids)
    assert merged[1].out.prompt_token_ids == [7, 8] and merged[0].out.prompt_token_ids is None


def test_a_stream_writes_what_queued_up_at_once_in_one_write_up_to_an_error():
    """Each write of a stream whose client reset the connection logged a warning: the events of what queued up
    together (n sequences of one step) go out as one write, those before an error too."""
    async def writes(items: list) -> list[str]:
        serving = OpenAIServing.__new__(OpenAIServing)
        serving.loop = SimpleNamespace(abort=lambda rids: None)
        queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        response = serving._event_stream(["a", "b"], queue, lambda d: [f"{d.index}:{d.out.text};"], ["first;"],
                                         lambda: ["last;"], lambda message, kind: [f"{kind}: {message};"])
        return [w async for w in response.body_iterator]
    assert asyncio.run(writes([delta(0, [1]), delta(1, [1]), delta(0, [2], finished=True),
                               delta(1, [2], finished=True)])) == ["first;", "0:<1><2>;1:<1><2>;", "last;"]
    assert asyncio.run(writes([delta(0, [1]), delta(1, [1]), EngineError("the engine failed")])) == [
        "first;", "0:<1>;1:<1>;", "server_error: the engine failed;"]


def test_a_whole_response_is_made_and_encoded_off_the_event_loop():
    """n sequences with logprobs make a body of megabytes, whose making held every other client's stream."""
    from moelora.server.protocol import UsageInfo

    def build() -> UsageInfo:
        made_on.append(threading.current_thread())
        return UsageInfo(prompt_tokens=1, completion_tokens=2, total_tokens=3)

    async def respond():
        return threading.current_thread(), await OpenAIServing._json(build)
    made_on = []
    loop_thread, response = asyncio.run(respond())
    assert made_on[0] is not loop_thread and response.media_type == "application/json"
    assert json.loads(response.body) == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3,
                                         "prompt_tokens_details": None}


def test_a_stream_that_falls_behind_gets_what_it_missed_in_one_chunk(server):
    """The server's event loop is held up (a busy moment) while the engine goes on stepping: the tokens of
    the steps it missed come in one chunk, none lost."""
    body = {"model": "alpha", "prompt": IDS, "max_tokens": 12, "temperature": 0, "logprobs": 0, "stream": True,
            "ignore_eos": True}
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks.append(json.loads(line.removeprefix("data: "))["choices"][0]["logprobs"]["tokens"])
            if len(chunks) == 1:  # hold the event loop while the engine steps the rest
                event_loop = next(iter(server.loop._streams.values())).loop
                event_loop.call_soon_threadsafe(time.sleep, 1.0)
    assert sum(map(len, chunks)) == 12 and len(chunks) < 12 and max(map(len, chunks)) > 1


def test_the_watchdog_ends_a_server_whose_step_never_returns(demo_dir, monkeypatch, caplog):
    """A step that does not return (a kernel that never ends): past watchdog_timeout the stream in flight ends with
    the watchdog's error event and [DONE], /health says 503, the engine thread's stack is logged and the process
    exits (recorded here, once). Steps under the timeout, and idle time or a command past it, leave the server
    serving."""
    exits: list[float] = []
    monkeypatch.setattr(engine_loop, "_exit_process", lambda: exits.append(time.monotonic()))
    monkeypatch.setattr(engine_loop, "WATCHDOG_EXIT_DELAY", 0.1)
    engine = make_engine(demo_dir, SERVED)
    hang, stepping, release, step = threading.Event(), threading.Event(), threading.Event(), engine.step

    def hung_step():
        if hang.is_set():
            stepping.set()
            release.wait(60)
        return step()
    engine.step = hung_step
    body = {"model": "alpha", "prompt": IDS, "max_tokens": 8, "ignore_eos": True, "stream": True}
    with serving(create_app(engine, MODEL_NAME, watchdog_timeout=1.0)) as server:
        for _ in range(3):  # each request's steps take far less than the timeout
            assert post(server, "/v1/completions", {**body, "stream": False}).status_code == 200
        time.sleep(1.5)  # idle past the timeout: waiting for work is not a step
        server.loop.call(lambda: time.sleep(1.5)).result(timeout=30)  # nor is a command (a profile's export)
        assert not exits and httpx.get(f"{server.url}/health").status_code == 200
        lines: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as reply:
                lines.extend(line for line in reply.iter_lines() if line)
        hang.set()
        client = threading.Thread(target=stream)
        with caplog.at_level(logging.CRITICAL, logger=engine_loop.__name__):
            client.start()
            assert stepping.wait(30), "the request never reached a step"
            client.join(timeout=30)
        try:
            assert not client.is_alive() and lines[-1] == "data: [DONE]"
            assert "more than the watchdog's 1 s" in lines[-2], lines[-3:]
            assert httpx.get(f"{server.url}/health").status_code == 503
            deadline = time.monotonic() + 10
            while not exits:
                assert time.monotonic() < deadline, "the watchdog did not end the process"
                time.sleep(0.02)
            assert "in hung_step" in caplog.text  # the stack of the engine thread, where it waits
        finally:
            release.set()
    assert len(exits) == 1


def test_the_watchdogs_exit_kills_the_other_ranks_and_ends_with_status_1(tmp_path):
    """_exit_process, the watchdog's end, in a process with a spawned child (a rank of tp_size > 1): the child is
    killed, the process ends with status 1 at once, nothing after the call runs."""
    script = tmp_path / "exits.py"
    script.write_text(
        "import multiprocessing, time\n"
        "from moelora.server import engine_loop\n"
        "def rank(started):\n"
        "    started.set()\n"
        "    time.sleep(120)\n"
        "if __name__ == '__main__':\n"
        "    ctx = multiprocessing.get_context('spawn')\n"
        "    started = ctx.Event()\n"
        "    child = ctx.Process(target=rank, args=(started,))\n"
        "    child.start()\n"
        "    assert started.wait(60)\n"
        "    print(child.pid, flush=True)\n"
        "    engine_loop._exit_process()\n"
        "    print('after the exit', flush=True)\n")
    root = str(Path(__file__).resolve().parents[2])  # this tree's moelora, whatever else is installed
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    pid, *rest = done.stdout.split()
    assert rest == []
    deadline = time.monotonic() + 10
    while (status := Path(f"/proc/{pid}/status")).exists() and "State:\tZ" not in status.read_text():
        assert time.monotonic() < deadline, f"the child {pid} still runs"
        time.sleep(0.05)
