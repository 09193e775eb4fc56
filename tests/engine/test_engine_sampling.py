"""Penalties, logit_bias, min_tokens, allowed_token_ids, prompt logprobs and structured output
through the engine, on the demo's tiny Qwen3-MoE (it has a tokenizer, which grammars need): each
against a reference computed another way, alone and mixed in batches with adapters, with chunked
prefill and retraction."""
from __future__ import annotations

import json
import re

import pytest
import torch

from moelora.engine.engine import Engine
from moelora.engine.sampling_params import SamplingParams, StructuredOutput
from tests.support import build_random_demo

PROMPTS = ["Hello world", "the quick brown fox", "naïve café", "déjà vu"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
GRAMMARS = [StructuredOutput("json_schema", json.dumps(SCHEMA)), StructuredOutput("json_object"),
            StructuredOutput("regex", "(yes|no), [a-z]{2,5}!"), StructuredOutput("choice", choices=("red", "green", "blu\"e")),
            StructuredOutput("grammar", 'root ::= "(" [0-9]+ ")"')]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    build_random_demo(root, {"alpha": 1, "beta": 2})
    return root


def make(demo, **kwargs) -> Engine:
    options = dict(device="cpu", dtype="float32", max_loras_per_batch=2, max_lora_rank=8)
    return Engine(str(demo / "model"), lora_paths={n: str(demo / n) for n in ("alpha", "beta")}, **{**options, **kwargs})


@pytest.fixture(scope="module")
def engine(demo):
    return make(demo)


def assert_idle(engine):
    assert not engine.has_unfinished() and engine.accounting_error() is None
    assert engine.scheduler.pool.free_rows == engine.config.max_running_requests


def valid(spec: StructuredOutput, text: str) -> bool:
    """The text follows the spec (checked without xgrammar)."""
    if spec.kind == "json_schema":
        value = json.loads(text)
        return (set(value) == {"name", "age", "ok"} and isinstance(value["name"], str) and len(value["name"]) <= 4
                and type(value["age"]) is int and 0 <= value["age"] <= 99 and type(value["ok"]) is bool)
    if spec.kind == "json_object":
        return isinstance(json.loads(text), dict)
    if spec.kind == "choice":
        return text in spec.choices
    pattern = r"(yes|no), [a-z]{2,5}!" if spec.kind == "regex" else r"\([0-9]+\)"
    return re.fullmatch(pattern, text) is not None


def greedy_with_penalties(engine, prompt_ids, lora, max_tokens, presence, frequency) -> list[int]:
    """Greedy decoding spelled out: each step the full forward of prompt + output (Engine.prompt_logprobs),
    the penalties subtracted from the log-probabilities (a shift of the row: the argmax is the logits')."""
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        row = engine.prompt_logprobs([ids], lora=lora)[0][-1]
        counts = torch.bincount(torch.tensor(ids[len(prompt_ids):], dtype=torch.int64), minlength=row.shape[0])
        ids.append(int((row - frequency * counts - presence * (counts > 0)).argmax()))
    return ids[len(prompt_ids):]


def test_presence_and_frequency_penalties_by_hand(engine):
    prompt = engine.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(max_tokens=8, temperature=0, presence_penalty=1.5, frequency_penalty=0.7, ignore_eos=True)
    for lora in (None, "alpha"):
        got = engine.generate(prompt, params, lora=lora)[0].token_ids
        assert got == greedy_with_penalties(engine, prompt, lora, 8, 1.5, 0.7)
        assert got != engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                                      lora=lora)[0].token_ids


def mixed_params() -> list[SamplingParams]:
    """Seeded and greedy requests with every sampling option, and grammars."""
    return [
        SamplingParams(max_tokens=12, temperature=0.9, seed=1, presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.8, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, seed=3, logit_bias={5: 4.0, 17: -100}, min_tokens=6),
        SamplingParams(max_tokens=50, temperature=0.7, seed=4, structured_output=GRAMMARS[0]),
        SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=50, temperature=0, structured_output=GRAMMARS[2], repetition_penalty=1.3),
        SamplingParams(max_tokens=12, temperature=1.2, seed=7, allowed_token_ids=list(range(100, 160)), min_tokens=12),
        SamplingParams(max_tokens=50, temperature=0.5, seed=8, structured_output=GRAMMARS[4], frequency_penalty=1.0),
    ]


def test_mixed_batch_with_adapters_equals_each_alone_also_when_retracted(demo, engine):
    params, loras = mixed_params(), [None, "alpha", "beta", None, "alpha", "beta", None, "alpha"]
    prompts = [PROMPTS[i % 4] for i in range(len(params))]
    alone = [engine.generate(p, sp, lora=a)[0] for p, sp, a in zip(prompts, params, loras)]
    assert [o.token_ids for o in engine.generate(prompts, params, lora=loras)] == [o.token_ids for o in alone]
    for overlap in (False, True):  # decode rows leave prompts a few tokens a step
        tight = make(demo, chunked_prefill_size=8, max_total_tokens=64, disable_overlap_schedule=not overlap)
        assert [o.token_ids for o in tight.generate(prompts, params, lora=loras)] == [o.token_ids for o in alone]
        assert tight.scheduler.num_retractions > 0
        assert_idle(tight)
    assert_idle(engine)
    for sp, out in zip(params, alone):
        if sp.structured_output is not None:
            assert out.finish_reason == "stop" and valid(sp.structured_output, out.text), out.text
        if sp.allowed_token_ids is not None:
            assert set(out.token_ids) <= set(sp.allowed_token_ids)
        if sp.logit_bias:
            assert 17 not in out.token_ids
        assert len(out.token_ids) > sp.min_tokens or out.finish_reason == "length"


def test_min_tokens_holds_eos_back(engine):
    eos = engine.eos_token_ids[0]
    push = SamplingParams(max_tokens=10, temperature=0, logit_bias={eos: 100})
    assert engine.generate(PROMPTS[0], push)[0].token_ids == [eos]
    out = engine.generate(PROMPTS[0], SamplingParams(max_tokens=10, temperature=0, logit_bias={eos: 100}, min_tokens=4))[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and eos not in out.token_ids[:4]
    assert out.finish_reason == "stop"


class _NotWalked(dict):
    """A logit_bias that fails the step that walks it."""
    def __iter__(self):
        raise AssertionError("a step walked the request's logit_bias")

    items = values = keys = __iter__


def test_a_step_does_not_walk_a_requests_logit_bias(engine):
    """A logit_bias of the whole vocabulary is turned into tensors once, when the request arrives: the steps join
    them, never loop over its entries in Python (at 150k entries that was 48 ms of every step of every request)."""
    bias = {t: (-100.0 if t % 3 else 5.0) for t in range(engine.vocab_size)}
    params = SamplingParams(max_tokens=6, temperature=0, logit_bias=bias, ignore_eos=True)
    want = engine.generate(PROMPTS[0], params)[0].token_ids
    assert all(t % 3 == 0 for t in want)
    rid = engine.add_request(PROMPTS[0], params)
    engine.scheduler.find(rid).params.logit_bias = _NotWalked(bias)
    got = []
    while engine.has_unfinished():
        got += [t for o in engine.step() if o.rid == rid for t in o.token_ids]
    assert got == want
    assert_idle(engine)


@pytest.mark.parametrize("spec", GRAMMARS, ids=[g.kind for g in GRAMMARS])
def test_structured_output_is_valid_for_greedy_and_seeded_draws(engine, spec):
    params = [SamplingParams(max_tokens=80, temperature=t, seed=s, structured_output=spec)
              for t, s in [(0, None), (0.8, 1), (1.5, 2), (1.0, 3)]]
    outs = engine.generate([PROMPTS[i] for i in range(4)], params, lora=[None, "alpha", "beta", None])
    for out in outs:
        if spec.kind == "json_object" and out.finish_reason == "length":  # a random model may keep writing a key
            matcher = engine.grammars.matcher(spec)
            assert out.text.startswith("{") and matcher.accept_string(out.text) and not matcher.is_completed()
            continue
        assert out.finish_reason == "stop" and valid(spec, out.text), out.text
        assert out.token_ids[-1] in engine.eos_token_ids
    assert_idle(engine)


def test_grammar_under_ignore_eos_stops_when_complete(engine):
    out = engine.generate(PROMPTS[0], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True,
                                                     structured_output=GRAMMARS[3]))[0]
    assert out.finish_reason == "stop" and out.text in GRAMMARS[3].choices


def test_grammar_matchers_are_released_on_finish_and_abort(engine):
    spec = GRAMMARS[1]
    rids = [engine.add_request(PROMPTS[i], SamplingParams(max_tokens=40, temperature=0.5, seed=i, structured_output=spec))
            for i in range(3)]
    reqs = [engine.scheduler.find(r) for r in rids]
    assert all(r.grammar is not None for r in reqs)
    engine.step()
    assert engine.abort(rids[1])
    while engine.has_unfinished():
        engine.step()
    assert all(r.grammar is None for r in reqs) and reqs[1].finish_reason == "abort"
    assert_idle(engine)


def test_prompt_logprobs_match_the_full_distribution(demo):
    engine = make(demo, chunked_prefill_size=3)  # entries come chunk by chunk
    prompt = engine.tokenizer.encode(PROMPTS[2])
    out = engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3), lora="beta")[0]
    full = engine.prompt_logprobs([prompt], lora="beta")[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i, entry in enumerate(out.prompt_logprobs[1:]):
        token = prompt[i + 1]
        assert next(iter(entry)) == token and entry[token] == pytest.approx(full[i, token].item(), abs=1e-5)
        top = full[i].topk(3)
        assert {t: pytest.approx(v, abs=1e-5) for t, v in zip(top.indices.tolist(), top.values.tolist())} == \
            {t: v for t, v in entry.items() if t in top.indices.tolist()}
        assert len(entry) in (3, 4)
    assert out.cumulative_logprob == pytest.approx(
        sum(engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0, logprobs=0), lora="beta")[0].logprobs[k][t]
            for k, t in enumerate(out.token_ids)), abs=1e-5)


def word_ids(engine, *words: str) -> list[int]:
    """The token ids of whole words (each one token in the tiny tokenizer)."""
    ids = [engine.tokenizer.encode(w) for w in words]
    assert all(len(i) == 1 for i in ids), ids
    return [i[0] for i in ids]


def test_a_grammar_after_reasoning_lets_the_thinking_run_free(engine):
    """With reasoning_end, every token up to the first end token is free (tokens the grammar refuses: the bias
    draws two words at random, one of them the end), and the grammar applies from the next token on."""
    think, end = word_ids(engine, " the", " fox")
    spec = GRAMMARS[3]
    params = [SamplingParams(max_tokens=30, temperature=1.0, seed=s, logit_bias={think: 100, end: 100},
                             structured_output=StructuredOutput(spec.kind, spec.spec, spec.choices, reasoning_end=end))
              for s in range(6)]
    outs = engine.generate([PROMPTS[0]] * len(params), params, lora=[None, "alpha", "beta"] * 2)
    thought = 0
    for out in outs:
        k = out.token_ids.index(end)
        assert set(out.token_ids[:k]) <= {think}, out.token_ids
        thought += k
        answer = engine.tokenizer.decode(out.token_ids[k + 1:], skip_special_tokens=True)
        assert out.finish_reason == "stop" and answer in spec.choices, out.text
    assert thought > 0  # some thought before their end
    assert_idle(engine)


def test_a_grammar_after_an_optional_reasoning(engine):
    """With reasoning_start too, the first token is the grammar's or the start of a reasoning: biased to a word
    the grammar refuses and away from the start, the output follows the grammar from its first token; biased to the
    start, it thinks."""
    start, think, end = word_ids(engine, " the", " quick", " fox")
    spec = StructuredOutput("regex", "(yes|no), [a-z]{2,5}!", reasoning_end=end, reasoning_start=start)
    answered = engine.generate(PROMPTS[1], SamplingParams(max_tokens=30, temperature=0,
                                                          logit_bias={start: -100, think: 100, end: 100},
                                                          structured_output=spec))[0]
    assert valid(GRAMMARS[2], answered.text) and answered.finish_reason == "stop"
    thought = engine.generate(PROMPTS[1], SamplingParams(max_tokens=30, temperature=0, logit_bias={start: 100},
                                                         structured_output=spec))[0]
    assert thought.token_ids == [start] * 30 and thought.finish_reason == "length"  # thinking: no grammar applied
    assert_idle(engine)


@pytest.mark.parametrize("params, match", [
    (dict(structured_output=StructuredOutput("json_object", reasoning_end=10**6)),
     r"SamplingParams\.structured_output\.reasoning_end must be token ids below the vocabulary size"),
    (dict(logit_bias={10**6: 1.0}), r"SamplingParams\.logit_bias must be token ids below the vocabulary size"),
    (dict(allowed_token_ids=[3, 10**6]), r"SamplingParams\.allowed_token_ids must be token ids below"),
    (dict(structured_output=StructuredOutput("regex", "(")), r"SamplingParams\.structured_output: the regex is not"),
    (dict(structured_output=StructuredOutput("json_schema", "{")), r"SamplingParams\.structured_output: the json schema"),
    (dict(structured_output=StructuredOutput("grammar", "root ::= ")), r"SamplingParams\.structured_output: the grammar"),
])
def test_bad_requests_name_the_field(engine, params, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request(PROMPTS[0], SamplingParams(**params))
    assert_idle(engine)


def test_a_grammar_that_rejects_its_token_fails_only_its_request(engine):
    """A matcher refusing the sampled token (it cannot, unless xgrammar fails) ends that request with an
    error and frees what it held; the batch around it gets its solo tokens."""
    class Refusing:
        def __init__(self, matcher):
            self.matcher = matcher

        def fill_next_token_bitmask(self, bitmask, index):
            return self.matcher.fill_next_token_bitmask(bitmask, index)

        def accept_token(self, token):
            return False

    plain = SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)
    want = engine.generate(PROMPTS[1], plain, lora="alpha")[0].token_ids
    victim = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=20, structured_output=GRAMMARS[2]))
    other = engine.add_request(PROMPTS[1], plain, lora="alpha")
    req = engine.scheduler.find(victim)
    req.grammar = Refusing(req.grammar)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.rid, []).append(out)
    end = outputs[victim][-1]
    assert end.finish_reason == "error" and "its structured output allows no token after 0 tokens" in end.error
    assert end.error_is_input  # the request's own input (a server's 400), not an engine fault
    assert req.grammar is None
    assert [t for o in outputs[other] for t in o.token_ids] == want
    assert_idle(engine)


def test_min_tokens_under_a_grammar(engine):
    """min_tokens holds EOS back while the grammar allows more; a grammar that allows only its end wins."""
    longer = engine.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, min_tokens=8,
                                                        structured_output=StructuredOutput("regex", "[a-c]+")))[0]
    assert re.fullmatch("[a-c]+", longer.text) and len(longer.token_ids) == 9 and longer.finish_reason == "stop"
    shorter = engine.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0,
                                                         structured_output=StructuredOutput("regex", "[a-c]+")))[0]
    assert len(shorter.token_ids) < 9
    spec = GRAMMARS[3]
    done = engine.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, min_tokens=20, structured_output=spec))[0]
    assert done.finish_reason == "stop" and done.text in spec.choices and len(done.token_ids) < 20


def test_a_requests_params_are_checked_once_on_their_way_in(engine, monkeypatch):
    """add_request checks the caller's params once; the copies made on the way in (its max_tokens and min_tokens
    settled, the model's EOS tokens added to its stops) share the checked fields: checking them again took a whole
    vocabulary's logit_bias through the engine thread's checks several times a request. The request still gets the
    params asked for."""
    params = SamplingParams(max_tokens=None, min_tokens=4, seed=5, logit_bias={t: 0.5 for t in range(50)})
    checks = []
    validate = SamplingParams.validate
    monkeypatch.setattr(SamplingParams, "validate", lambda self: checks.append(self) or validate(self))
    rid = engine.add_request([5, 6, 7], params)
    assert len(checks) == 1
    got = engine.scheduler.find(rid).params
    assert (got.seed, got.max_tokens, got.min_tokens, got.logit_bias) == (5, engine.context_len - 3, 4,
                                                                           params.logit_bias)
    engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    assert_idle(engine)
