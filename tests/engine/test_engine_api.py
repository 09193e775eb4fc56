"""The library API under misuse, as a vLLM `LLM` user might: prompts of the wrong types, errors naming the prompt
(not the request) with n > 1, SamplingParams changed after they were made, ids and names that are no ids or names,
calls from two threads at once, and use after shutdown. Each once raised an internal TypeError, ran on silently
reinterpreted input, or left cache held for good."""
import re
import threading

import numpy as np
import pytest
import torch

from moelora.engine.engine import EngineDead, RequestFailed
from moelora.engine.sampling_params import SamplingParams
from moelora.lora import AdapterError
from tests.support import assert_released

FAMILY = "qwen3_moe"
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(FAMILY)


@pytest.mark.parametrize("prompts, what", [
    (None, "prompts must be a string, a list of token ids, or a list of those; got NoneType"),
    (b"\x05\x06", "prompts must be a string, a list of token ids, or a list of those; got bytes"),
    ({"prompt_token_ids": [5, 6]}, "prompts must be a string, a list of token ids, or a list of those; got dict"),
    ([[5, 6], None], "prompt 1: a prompt is a string or a list of token ids (ints), got NoneType"),
    ([True, False], "prompt 0: a prompt is a string or a list of token ids (ints), got bool"),
    ([[5, 6], [5, True]], "prompt 1: a prompt is a string or a list of token ids (ints), got list"),
])
def test_prompts_of_the_wrong_type_are_refused_naming_the_prompt(engine, prompts, what):
    with pytest.raises(ValueError) as e:
        engine.generate(prompts, GREEDY)
    assert str(e.value).startswith(what), e.value
    assert_released(engine)


def test_token_ids_of_numpy_and_torch_are_token_ids(engine):
    want = engine.generate([5, 6, 7], GREEDY)[0].token_ids
    for prompt in (np.array([5, 6, 7]), torch.tensor([5, 6, 7]), [np.int64(5), np.int64(6), np.int64(7)]):
        assert engine.generate(prompt, GREEDY)[0].token_ids == want
    assert engine.prompt_logprobs([5, 6, 7])[0].equal(engine.prompt_logprobs([[5, 6, 7]])[0])  # one prompt too
    assert engine.generate(range(5, 8), GREEDY)[0].token_ids == want  # a sequence of ints


def test_collections_of_prompts_are_prompts(engine):
    want = [o.token_ids for o in engine.generate([[5, 6], [7, 8]], GREEDY)]
    for prompts in (([5, 6], [7, 8]), (p for p in ([5, 6], [7, 8])), np.array([[5, 6], [7, 8]])):
        assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == want


def test_errors_name_the_prompt_not_the_request_with_n_sequences(engine, monkeypatch):
    with pytest.raises(ValueError, match=r"^prompt 1: prompt token ids must be ints in \[0, 96\), got 1000000"):
        engine.generate([[5, 6], [7, 10**6]], SamplingParams(max_tokens=2, n=3))
    bad = SamplingParams(max_tokens=2)
    bad.temperature = -1.0
    with pytest.raises(ValueError, match=r"^prompt 1: SamplingParams.temperature must be"):
        engine.generate([[5], [6]], [GREEDY, bad])
    import moelora.engine.detokenizer as detokenizer
    add = detokenizer.IncrementalDetokenizer.add

    def failing(self, *args):  # prompt 1's two sequences
        if self.params.max_tokens == 2:
            raise RuntimeError("injected")
        return add(self, *args)
    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "add", failing)
    with pytest.raises(RequestFailed) as e:
        engine.generate([[5, 6], [7, 8]], [SamplingParams(max_tokens=3, n=2), SamplingParams(max_tokens=2, n=2)])
    assert [part.split(":")[0] for part in str(e.value).split("; ")] == ["prompt 1", "prompt 1"], e.value
    monkeypatch.undo()
    assert_released(engine)


@pytest.mark.parametrize("field", ["stop", "stop_token_ids", "logit_bias"])
def test_a_field_set_to_none_after_the_params_were_made_means_its_default(engine, field):
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    setattr(params, field, None)
    rid = engine.add_request([5, 6, 7], params)
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() if o.rid == rid for t in o.token_ids]
    assert tokens == engine.generate([5, 6, 7], GREEDY)[0].token_ids


def test_ids_names_and_tokens_that_are_none(engine):
    with pytest.raises(ValueError, match="a request id must be a non-empty string, got ''"):
        engine.add_request([5, 6], GREEDY, rid="")
    odd = [(None, "None"), (7, "7"), ("", "''"), ("a\nb", "'a\\nb'"), (" a", "' a'"), ("x\0y", "'x\\x00y'"),
           ("n" * 257, repr("n" * 60) + "...")]
    for name, shown in odd:
        message = ("an adapter's name must be a non-empty string of at most 256 printable characters without "
                   f"surrounding spaces, got {shown}")
        with pytest.raises(AdapterError, match=re.escape(message)):
            engine.load_lora(name, engine.config.lora_paths["full"])
    assert engine.runner.lora.names == ["full", "partial"]
    for token in (-1, 96, "a", True):
        with pytest.raises(ValueError, match=rf"token must be a token id in \[0, 96\), got {token!r}"):
            engine.token_text(token)
    with pytest.raises(ValueError, match="continue_final_message needs the last message to be the assistant's"):
        engine.chat_prompt(["hi"], add_generation_prompt=False, continue_final_message=True)
    assert_released(engine)


def test_a_second_thread_inside_the_engine_is_refused(make_engine):
    """An Engine serves one thread at a time: a call that changes its requests while another thread's generate runs
    is a RuntimeError naming it; the running generate is served as alone."""
    engine = make_engine(FAMILY)
    want = engine.generate([[5, 6, 7]] * 2, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    inside, errors, got = threading.Event(), [], []
    step = engine.step

    def slow_step():
        inside.set()
        threading.Event().wait(0.05)
        return step()
    engine.step = slow_step

    def run():
        got.extend(engine.generate([[5, 6, 7]] * 2, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
    thread = threading.Thread(target=run)
    thread.start()
    inside.wait(60)
    for call in (lambda: engine.add_request([5], GREEDY), lambda: engine.generate([5], GREEDY), engine.step,
                 lambda: engine.abort("x"), lambda: engine.unload_lora("full")):
        try:
            call()
        except RuntimeError as e:
            errors.append(str(e))
    thread.join(60)
    del engine.step
    assert len(errors) == 5 and all("was called while another thread is inside the engine" in e for e in errors)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert_released(engine)


def test_shutdown_ends_the_engine_at_one_rank_too(make_engine):
    engine = make_engine(FAMILY)
    engine.shutdown()
    engine.shutdown()  # twice: nothing more
    assert engine.fatal == "the engine was shut down"
    with pytest.raises(EngineDead):
        engine.generate([5, 6], GREEDY)


def test_priorities_order_the_queue_under_the_priority_policy_and_are_refused_under_fcfs(engine, make_engine):
    for priority, what in ((2, "priority 2 needs scheduling_policy 'priority'"), (True, "priority must be an int"),
                           (1.0, "priority must be an int")):
        with pytest.raises(ValueError, match=rf"^prompt 1: {what}"):
            engine.generate([[5, 6], [7, 8]], GREEDY, priority=[0, priority])
        with pytest.raises(ValueError, match=rf"^{what}"):
            engine.add_request([5, 6], GREEDY, priority=priority)
    with pytest.raises(ValueError, match="priority has 1 entries for 2 prompts"):
        engine.generate([[5, 6], [7, 8]], GREEDY, priority=[0])
    assert_released(engine)
    one_at_a_time = make_engine(FAMILY, scheduling_policy="priority", max_running_requests=1)
    want = [o.token_ids for o in one_at_a_time.generate([[5, 6], [7, 8], [9, 10]], GREEDY)]
    assert [o.token_ids for o in one_at_a_time.generate([[5, 6], [7, 8], [9, 10]], GREEDY, priority=[2, -1, 2])] == want
    rids = [one_at_a_time.add_request(p, GREEDY, priority=pr) for p, pr in (([5, 6], 1), ([7, 8], 0), ([9, 10], 1))]
    finished = []
    while one_at_a_time.has_unfinished():
        finished += [o.rid for o in one_at_a_time.step() if o.finished]
    assert finished == [rids[1], rids[0], rids[2]]
    assert_released(one_at_a_time)
