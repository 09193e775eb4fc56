import pytest

from moelora.engine.sampling_params import SamplingParams


def test_defaults_are_valid_and_stop_is_normalised():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.n) == (16, 1.0, 1.0, -1, 0.0, 1)
    assert p.stop == () and p.stop_token_ids == () and not p.greedy
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"], stop_token_ids=[3, 0]).stop == ("a", "bc")
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-6).greedy
    SamplingParams(top_k=0, top_p=0.01, min_p=1, logprobs=20, seed=-(2**63), temperature=0)  # edges are fine


@pytest.mark.parametrize("field,value", [
    ("max_tokens", -1),
    ("max_tokens", 0),
    ("max_tokens", 2.0),
    ("temperature", -0.5),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("top_k", 1.5),
    ("min_p", -0.1),
    ("min_p", 1.01),
    ("seed", 2**63),
    ("seed", "7"),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [3]),
    ("stop_token_ids", [5, -1]),
    ("n", 0),
    ("logprobs", -1),
    ("logprobs", 21),
    ("prompt_logprobs", -1),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -2.01),
    ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", float("inf")),
    ("logit_bias", {5: 101.0}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"5": 1.0}),
    ("logit_bias", {**{t: 1.0 for t in range(1000)}, 7: float("nan")}),  # past the checks without a Python loop
    ("logit_bias", {**{t: 1.0 for t in range(2, 1000)}, True: 1.0}),
    ("logit_bias", {**{t: 1.0 for t in range(1000)}, 9: 10**400}),
    ("logit_bias", {**{t: 1.0 for t in range(1000)}, 2**63: 1.0}),
    ("stop_token_ids", [*range(1000), 2**64]),
    ("allowed_token_ids", [*range(1000), True]),
    ("min_tokens", -1),
    ("min_tokens", 17),  # above max_tokens=16
    ("allowed_token_ids", []),
    ("allowed_token_ids", [3, -2]),
    ("structured_output", {"type": "json_object"}),
    ("temperature", 1e39),  # past float32's range: inf in the sampler
    ("top_p", 1e-46),  # 0 in float32: every token filtered out
    ("repetition_penalty", 1e-46),
    ("repetition_penalty", 1e39),
    ("stop", [f"stop {i}" for i in range(65)]),
    ("stop", ["x" * 40000, "y" * 30000]),
])
def test_invalid_field_is_named(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be .*got "):
        SamplingParams(**{field: value})


def test_message_shows_the_bad_value():
    with pytest.raises(ValueError, match=r"got 1\.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"got -1\b"):
        SamplingParams(stop_token_ids=[2, -1])


def test_structured_output_is_checked():
    from moelora.engine.sampling_params import StructuredOutput
    with pytest.raises(ValueError, match=r"SamplingParams\.structured_output must be one of"):
        StructuredOutput("xml")
    with pytest.raises(ValueError, match=r"SamplingParams\.structured_output must be at least one choice"):
        StructuredOutput("choice", choices=("a", ""))
    assert SamplingParams(structured_output=StructuredOutput("regex", "[ab]+")).structured_output.spec == "[ab]+"
    with pytest.raises(ValueError, match=r"structured_output\.reasoning_end must be None or a token id .*got -1"):
        StructuredOutput("json_object", reasoning_end=-1)
    with pytest.raises(ValueError, match=r"structured_output\.reasoning_start must be None without a reasoning_end"):
        StructuredOutput("json_object", reasoning_start=5)
    with pytest.raises(ValueError, match=r"reasoning_start must be .* another token than reasoning_end"):
        StructuredOutput("json_object", reasoning_end=5, reasoning_start=5)


def test_min_tokens_without_max_tokens():
    """max_tokens None (up to the context): min_tokens has no upper bound here; the engine caps it at
    what the context leaves."""
    assert SamplingParams(max_tokens=None, min_tokens=10**6).min_tokens == 10**6
    with pytest.raises(ValueError, match=r"SamplingParams\.min_tokens must be an int >= 0, got -1"):
        SamplingParams(max_tokens=None, min_tokens=-1)


def test_the_sequences_of_n_share_the_checked_fields_unchecked(monkeypatch):
    """Each of the n sequences of a request is a copy of its params with n=1 and its own seed: checking every field
    again for each (a whole vocabulary's logit_bias) held the server's event loop for seconds."""
    params = SamplingParams(n=4, seed=2**63 - 2, logit_bias={t: 0.5 for t in range(1000)})
    monkeypatch.setattr(SamplingParams, "validate", lambda self: pytest.fail("checked again"))
    sequences = [params.for_sequence(k) for k in range(4)]
    assert [s.seed for s in sequences] == [2**63 - 2, 2**63 - 1, -(2**63), -(2**63) + 1]
    assert all(s.n == 1 and s.logit_bias is params.logit_bias for s in sequences) and params.n == 4


def test_a_checked_logit_bias_is_shared_read_only_by_every_copy():
    """Checked once, the logit_bias is read-only: replace() and evolve() copies share it unchecked, and its tensors
    are made once for all of them (a whole vocabulary's took tens of ms at each copy, several a sequence)."""
    from dataclasses import replace

    from moelora.engine.sampler import logit_bias_tensors
    params = SamplingParams(logit_bias={3: 1.5, 7: -2.0})
    copies = [replace(params, max_tokens=3), params.evolve(seed=4), SamplingParams(logit_bias=params.logit_bias)]
    assert all(c.logit_bias is params.logit_bias for c in copies) and params.logit_bias == {3: 1.5, 7: -2.0}
    made = logit_bias_tensors(params)
    assert made.tokens.tolist() == [3, 7] and made.values.tolist() == [1.5, -2.0]
    assert all(logit_bias_tensors(c) is made for c in copies)
    with pytest.raises(TypeError, match="read-only"):
        params.logit_bias[5] = 1.0
    with pytest.raises(TypeError, match="read-only"):
        params.logit_bias.update({5: 1.0})
