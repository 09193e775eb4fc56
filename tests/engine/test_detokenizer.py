import random

import pytest

from moelora.engine.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer, StopStringEnd
from moelora.engine.sampling_params import SamplingParams
from tests.support import tiny_tokenizer

TEXT = "héllo wörld 你好 🙂🎉 naïve café"


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def lone_bytes(tok) -> list[int]:
    """Tokens of one byte that never makes a character (a continuation byte), alone or repeated."""
    return [t for t in range(len(tok)) if tok.decode([t]) == "\ufffd" and tok.decode([t, t]) == "\ufffd" * 2]


def _stream(tok, ids, prompt="Say: ", **params):
    """Feed ids until the detokenizer finishes; returns (detokenizer, pieces, tokens taken)."""
    det = IncrementalDetokenizer(tok, tok.encode(prompt), SamplingParams(**{"max_tokens": len(ids), **params}))
    pieces = []
    for t in ids:
        pieces.append(det.add(t))
        if det.finished:
            break
    return det, pieces, det.num_tokens


def test_multibyte_characters_wait_until_complete(tok):
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT.split()) * 3, "the tokenizer should split characters over several tokens"
    det, pieces, _ = _stream(tok, ids)
    assert "".join(pieces) == det.text == TEXT and det.finish_reason == "length"
    assert not any("\ufffd" in p for p in pieces)
    assert pieces.count("") >= 5  # tokens that ended inside a character released nothing


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_tokens_stream_to_the_one_shot_decode(tok, skip_special_tokens):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        det, pieces, taken = _stream(tok, ids, ignore_eos=True, skip_special_tokens=skip_special_tokens)
        assert taken == len(ids) and det.finish_reason == "length"
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip_special_tokens), ids


@pytest.mark.parametrize("stop", ["lo wö", "你好", "ö", "🎉 na", "é"])
def test_stop_string_across_tokens_is_found_and_excluded(tok, stop):
    ids = tok.encode(TEXT)
    det, pieces, taken = _stream(tok, ids, stop=["zzz", stop])
    assert det.finish_reason == "stop" and "".join(pieces) == det.text == TEXT[:TEXT.index(stop)]
    # it stops at the first token that completes the stop string, not later
    assert taken == next(n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n]))
    if len(stop) > 1:
        assert all(stop not in tok.decode([t]) for t in ids), "stop string should span tokens"


@pytest.mark.parametrize("stop,text", [(["wörld", "llo"], "hé"), (["ld", "wörld"], "héllo ")])
def test_earliest_stop_string_wins(tok, stop, text):
    # the second case completes both stop strings with the same token
    det, pieces, _ = _stream(tok, tok.encode(TEXT), stop=stop)
    assert "".join(pieces) == text and det.finish_reason == "stop"


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_string_that_completes_first_wins_wherever_the_tokens_split(tok, include):
    """"llo" as one token or as three: "l" completes before "éll" in both (it was "éll" for the one token, which
    begins first)."""
    one = tok.encode("héllo")
    three = one[:1] + [tok.convert_tokens_to_ids(c) for c in "llo"]
    assert tok.decode(one) == tok.decode(three) == "héllo" and len(three) == len(one) + 2
    outs = [_stream(tok, ids, stop=["éll", "l"], include_stop_str_in_output=include)[0] for ids in (one, three)]
    assert [(d.text, d.stop_reason) for d in outs] == [("hél" if include else "hé", "l")] * 2


@pytest.mark.parametrize("stop,text", [(["wörld", "llo"], "héllo"), (["ld", "wörld"], "héllo wörld"),
                                       (["ö", "wö"], "héllo wö")])
def test_include_stop_str_in_output_ends_the_text_after_it(tok, stop, text):
    det, pieces, _ = _stream(tok, tok.encode(TEXT), stop=stop, include_stop_str_in_output=True)
    assert "".join(pieces) == det.text == text and det.finish_reason == "stop"


# TEXT's tokens: "hé", "llo", " w", <half of ö>, <its other half>, "rld", ...
@pytest.mark.parametrize("stop,min_tokens,text,reason", [
    ("é", 2, TEXT[:-1], "stop"),  # the é of "héllo" is in the first two tokens; café's ends the output
    ("lo wö", 5, TEXT, "length"),  # completed by the fifth token: not a stop
    ("lo wö", 4, "hél", "stop"),  # begins in the first four tokens, completed by the fifth: a stop
])
def test_stop_strings_count_only_after_min_tokens(tok, stop, min_tokens, text, reason):
    # vLLM: the text of the first min_tokens tokens is not searched, a stop string that ends after it is
    det, pieces, _ = _stream(tok, tok.encode(TEXT), stop=stop, min_tokens=min_tokens)
    assert "".join(pieces) == det.text == text and det.finish_reason == reason


def test_possible_stop_start_is_held_back_then_released(tok):
    ids = tok.encode(TEXT)
    det = IncrementalDetokenizer(tok, [], SamplingParams(max_tokens=len(ids), stop=["wörx"]))
    out, held = "", 0
    for n, t in enumerate(ids, 1):
        out += det.add(t)
        decoded = tok.decode(ids[:n]).rstrip("\ufffd")
        if decoded.endswith(("w", "wö", "wör")):
            assert out == decoded[:decoded.rindex("w")], "start of a stop string released too early"
            held += 1
        elif decoded:
            assert out == decoded
    assert held >= 2 and out == TEXT and det.finish_reason == "length"


def test_held_back_text_is_released_at_the_length_limit(tok):
    ids = tok.encode("abc wö")
    det, pieces, _ = _stream(tok, ids, stop=["wörld"])
    assert pieces[-1].endswith("wö") and "".join(pieces) == "abc wö" and det.finish_reason == "length"


def test_eos_stops_and_is_not_in_the_text(tok):
    ids = tok.encode("hello wörld")
    det, pieces, taken = _stream(tok, ids + [tok.eos_token_id] + tok.encode(" more"), skip_special_tokens=False)
    assert taken == len(ids) + 1 and det.finish_reason == "stop" and "".join(pieces) == "hello wörld"
    with pytest.raises(RuntimeError, match="already finished"):
        det.add(5)


def test_ignore_eos_keeps_going(tok):
    ids = tok.encode("hi") + [tok.eos_token_id] + tok.encode(" there")
    det, pieces, taken = _stream(tok, ids, ignore_eos=True, skip_special_tokens=False)
    assert taken == len(ids) and det.finish_reason == "length"
    assert "".join(pieces) == "hi<|endoftext|> there"


def test_stop_token_ids_stop_and_flush_an_incomplete_character(tok):
    cut = tok.encode("ab 你好")[:-1]  # the last character lacks its last byte
    stop_id = tok.encode("x")[0]
    det, pieces, taken = _stream(tok, cut + [stop_id] + tok.encode("cd"), stop_token_ids=[stop_id])
    assert taken == len(cut) + 1 and det.finish_reason == "stop"
    assert "".join(pieces) == tok.decode(cut) and det.text.endswith("\ufffd")


def test_stop_reason_is_the_stop_string_or_stop_token_not_eos(tok):
    """As vLLM's stop_reason: the stop string that matched, the stop_token_ids token that came; None for EOS (also
    when stop_token_ids holds it, unless ignore_eos) and for the length limit."""
    ids, x, eos = tok.encode("hello wörld"), tok.encode("x")[0], tok.eos_token_id
    for feed, params, reason, stop_reason in [(ids, dict(stop=["zzz", "wö"]), "stop", "wö"),
                                              (ids[:2] + [x], dict(stop_token_ids=[x]), "stop", x),
                                              (ids[:2] + [eos], dict(stop_token_ids=[x]), "stop", None),
                                              (ids[:2] + [eos], dict(stop_token_ids=[eos]), "stop", None),
                                              (ids[:2] + [eos], dict(stop_token_ids=[eos], ignore_eos=True), "stop", eos),
                                              (ids, dict(stop_token_ids=[x]), "length", None)]:
        det, _, _ = _stream(tok, feed, **params)
        assert (det.finish_reason, det.stop_reason) == (reason, stop_reason), params


def test_model_eos_ids_replace_the_tokenizers(tok):
    im_end, ids = tok.convert_tokens_to_ids("<|im_end|>"), tok.encode("ok")
    det = IncrementalDetokenizer(tok, [], SamplingParams(max_tokens=10), eos_token_ids=[im_end])
    assert "".join(det.add(t) for t in ids + [tok.eos_token_id]) == "ok" and not det.finished
    det.add(im_end)
    assert det.finish_reason == "stop" and det.text == "ok"


def test_max_tokens_gives_length(tok):
    ids = tok.encode(TEXT)
    det, pieces, taken = _stream(tok, ids[:3], max_tokens=3)
    assert taken == 3 and det.finish_reason == "length" and "".join(pieces) == tok.decode(ids[:3])


def test_stop_string_end_is_the_longest_end_that_starts_a_stop_string():
    """StopStringEnd (updated a piece at a time) against the definition, over texts and stop strings of a small
    alphabet, where ends overlap most."""
    rng = random.Random(0)
    for _ in range(2000):
        stop = "".join(rng.choice("ab") for _ in range(rng.randint(1, 8)))
        end, text = StopStringEnd(stop), ""
        for _ in range(rng.randint(1, 6)):
            piece = "".join(rng.choice("abc") for _ in range(rng.randint(0, 5)))
            text += piece
            end.feed(piece)
            assert end.matched == max((k for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)


def test_bytes_that_never_complete_a_character_are_released_after_max_pending_tokens(tok, lone_bytes):
    """Output that keeps ending inside a character (a lone continuation byte, again and again: what logit_bias can
    force) is released as U+FFFD once MAX_PENDING_TOKENS tokens wait, instead of being decoded again with every
    token; the whole text is still the one-shot decode."""
    byte = lone_bytes[0]
    det, pieces, _ = _stream(tok, [byte] * (3 * MAX_PENDING_TOKENS), ignore_eos=True)
    assert "".join(pieces) == det.text == tok.decode([byte] * (3 * MAX_PENDING_TOKENS))
    released = [n for n, p in enumerate(pieces, 1) if p]
    assert released and released[0] == MAX_PENDING_TOKENS + 1


def test_a_character_that_begins_past_max_pending_tokens_is_not_split(tok, lone_bytes):
    """Lone continuation bytes (never a character) then well-formed text: however many bytes come first, the
    characters after them stream whole, the first among them beginning just as MAX_PENDING_TOKENS tokens wait (the
    text up to it final then, the character's first tokens kept back)."""
    byte = lone_bytes[0]
    assert tok.decode(tok.encode("naïve")[:1]) == "na\ufffd"
    for text in ("你好", "🙂🎉", "naïve"):  # characters of 3 and 4 bytes; a token of "na" and the first byte of "ï"
        for lone in range(MAX_PENDING_TOKENS - 4, 4 * MAX_PENDING_TOKENS):
            ids = [byte] * lone + tok.encode(text)
            det, pieces, _ = _stream(tok, ids, ignore_eos=True)
            assert "".join(pieces) == det.text == tok.decode(ids) == "\ufffd" * lone + text, (text, lone)


def test_random_bytes_and_characters_stream_to_the_one_shot_decode(tok, lone_bytes):
    """Runs of lone bytes past MAX_PENDING_TOKENS between pieces of text (characters of 1-4 bytes, each a token or
    split over several, tokens that end in the next character's first bytes): the streamed text is the one-shot
    decode."""
    rng = random.Random(1)
    for _ in range(40):
        ids = []
        while len(ids) < 120:
            ids += rng.choices(lone_bytes, k=rng.randrange(0, 2 * MAX_PENDING_TOKENS)) if rng.random() < 0.5 else []
            start = rng.randrange(len(TEXT))
            ids += tok.encode(TEXT[start:start + rng.randrange(1, 8)])  # (tokens of characters and a next one's bytes)
        det, pieces, _ = _stream(tok, ids, ignore_eos=True)
        assert "".join(pieces) == det.text == tok.decode(ids), ids


def test_a_stop_string_after_max_pending_tokens_of_lone_bytes_is_found(tok, lone_bytes):
    """The stop string's first token ends in the first byte of its next character, just past MAX_PENDING_TOKENS
    tokens of lone bytes: the character is kept whole, and the stop string found."""
    byte = lone_bytes[0]
    ids = [byte] * MAX_PENDING_TOKENS + tok.encode("naïve and more")
    det, pieces, _ = _stream(tok, ids, ignore_eos=True, stop=["naïve"])
    assert det.finish_reason == "stop" and det.stop_reason == "naïve"
    assert "".join(pieces) == det.text == "\ufffd" * MAX_PENDING_TOKENS
