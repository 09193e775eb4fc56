"""Engine behaviour on the tiny Qwen3-MoE: batch invariance (with chunked prefill and retraction),
the step API, aborts, per-request errors, n > 1, logprobs and stop tokens."""
import contextlib
import gc
import json
import shutil
import weakref
from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig

from moelora.engine.engine import Engine
from moelora.engine.sampling_params import SamplingParams
from moelora.lora import AdapterError
from tests.support import assert_released, out_of_gpu_memory_in

FAMILY = "qwen3_moe"
PROMPTS = [[(7 * i + 3 * j) % 90 + 3 for j in range(5 + i)] for i in range(6)]  # 5 to 10 tokens
LORAS = [None, "full", "partial", None, "full", "partial"]
# greedy and seeded random rows; ignore_eos: every request runs its max_tokens
PARAMS = [SamplingParams(max_tokens=16, temperature=0.0 if i % 2 == 0 else 0.8, seed=i, ignore_eos=True)
          for i in range(6)]


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(FAMILY)


@pytest.fixture(scope="module")
def alone(make_engine):
    """family -> the tokens of each of PROMPTS run by itself."""
    cache = {}

    def get(family: str) -> list[list[int]]:
        if family not in cache:
            engine = make_engine(family)
            cache[family] = [engine.generate([p], sp, lora=[a])[0].token_ids for p, sp, a in zip(PROMPTS, PARAMS, LORAS)]
        return cache[family]
    return get


def test_output_does_not_depend_on_the_batch(engine, alone):
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS, lora=LORAS)] == alone(FAMILY)
    assert_released(engine)


@pytest.mark.parametrize("family", [FAMILY, "deepseek_v3"])  # and MLA, whose cached keys and values differ in size
def test_chunked_prefill_and_retraction_keep_outputs(family, make_engine, alone):
    tight = make_engine(family, chunked_prefill_size=4, max_total_tokens=40)
    assert [o.token_ids for o in tight.generate(PROMPTS, PARAMS, lora=LORAS)] == alone(family)
    assert tight.scheduler.num_retractions > 0
    assert_released(tight)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_decode_rows_beside_chunked_prefills_keep_their_tokens_and_logprobs(make_engine, monkeypatch, device, overlap):
    """With enable_mixed_chunk, requests whose prompts are prefilled in chunks join the steps of a decoding
    request: it gets the tokens and log-probabilities it gets alone, and so does each of them (prompt logprobs and penalties
    included); decode never waits for their prefills. On the GPU (bf16, CUDA graphs for its decode steps
    alone, its decode rows in eager mixed steps beside the chunks) bit for bit; on the CPU to float32
    rounding, torch's CPU matmul not being batch invariant."""
    options = dict(device="cuda", dtype="bfloat16", cuda_graph_max_bs=8, max_total_tokens=4096) if device == "cuda" \
        else {}
    engine = make_engine(FAMILY, chunked_prefill_size=6, enable_mixed_chunk=True, disable_overlap_schedule=not overlap,
                         **options)
    approx = (lambda entries: entries) if device == "cuda" else approx_float32
    first = (PROMPTS[2], SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True), "full")
    long_prompts = [[(5 * i + 3 * j) % 90 + 3 for j in range(13 + 4 * i)] for i in range(3)]
    joiners = [(long_prompts[0], SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2, ignore_eos=True), None),
               (long_prompts[1], SamplingParams(max_tokens=5, temperature=0.9, seed=3, logprobs=1,
                                                presence_penalty=0.8, ignore_eos=True), "partial"),
               (long_prompts[2], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), "full")]
    alone = [engine.generate([p], sp, lora=[a])[0] for p, sp, a in [first, *joiners]]
    batches = []
    schedule = engine.scheduler.schedule
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: batches.append(schedule()) or batches[-1])
    rids = [engine.add_request(*first)]
    outputs = []
    while not outputs:  # its prompt (two chunks) alone: decoding from now on
        outputs += engine.step()
    rids += [engine.add_request(*j) for j in joiners]
    while engine.has_unfinished():
        outputs += engine.step()
    for rid, want in zip(rids, alone):
        mine = [o for o in outputs if o.rid == rid]
        assert [t for o in mine for t in o.token_ids] == want.token_ids
        assert [lp for o in mine for lp in o.logprobs] == approx(want.logprobs or [])
        assert next(o.prompt_logprobs for o in mine if o.token_ids) == approx(want.prompt_logprobs)
    batches = [b for b in batches if b is not None]  # None: the overlapped last step only reads the one before
    decodes = [i for i, b in enumerate(batches) if b.num_decode and b.reqs[0].rid == rids[0]]
    assert decodes == list(range(decodes[0], decodes[0] + len(alone[0].token_ids) - 1)), "decode never waits"
    assert any(not all(b.completes) and b.num_decode for b in batches), "a prompt's first chunk beside decode rows"
    assert all(sum(b.extend_lens) <= 6 for b in batches)
    assert_released(engine)


def approx_float32(entries: list[dict[int, float] | None] | None) -> list | None:
    return entries and [e if e is None else pytest.approx(e, abs=1e-5) for e in entries]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_overlap_schedule_keeps_every_output(make_engine, device):
    """Each step launched before the previous step's tokens are read: the tokens and log-probabilities
    of the synchronous engine (bit for bit on the GPU, CUDA graphs included), batched, across chunked
    prefill and retraction, with a stop token that ends a request while the next step runs ahead, and
    an abort while it does."""
    options = dict(device="cuda", dtype="bfloat16", cuda_graph_max_bs=8, max_total_tokens=4096) if device == "cuda" \
        else {}
    sync, ahead = (make_engine(FAMILY, disable_overlap_schedule=not o, **options) for o in (False, True))
    params = [replace(p, logprobs=2) for p in PARAMS]
    want = sync.generate(PROMPTS, params, lora=LORAS)
    stops = [replace(p, stop_token_ids=[w.token_ids[5]]) for p, w in zip(params, want)]
    want_stopped = sync.generate(PROMPTS, stops, lora=LORAS)
    approx = (lambda entries: entries) if device == "cuda" else approx_float32
    for got, expected in [(ahead.generate(PROMPTS, params, lora=LORAS), want),
                          (ahead.generate(PROMPTS, stops, lora=LORAS), want_stopped)]:
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        assert [o.logprobs for o in got] == [approx(o.logprobs) for o in expected]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    assert any(o.finish_reason == "stop" and len(o.token_ids) < 16 for o in want_stopped)
    assert_released(ahead)
    tight = make_engine(FAMILY, **{**options, "disable_overlap_schedule": False, "chunked_prefill_size": 4,
                                   "max_total_tokens": 40})
    assert [o.token_ids for o in tight.generate(PROMPTS, params, lora=LORAS)] == [o.token_ids for o in want]
    assert tight.scheduler.num_retractions > 0
    assert_released(tight)

    keep = ahead.add_request(PROMPTS[1], params[1], lora=LORAS[1])
    drop = ahead.add_request(PROMPTS[2], params[2], lora=LORAS[2])
    assert ahead.step() == []  # launched: its tokens come with the next step
    outputs = ahead.step()
    assert ahead.stepper.in_flight and ahead.abort(drop)  # a decode step of both runs ahead
    while ahead.has_unfinished():
        outputs += ahead.step()
    assert [t for o in outputs if o.rid == keep for t in o.token_ids] == want[1].token_ids
    assert [o.finish_reason for o in outputs if o.rid == drop and o.finished] == ["abort"]
    assert len([t for o in outputs if o.rid == drop for t in o.token_ids]) == 1
    assert_released(ahead)


def test_step_api_streams_what_generate_returns(engine, alone):
    rids = [engine.add_request(p, sp, lora=a) for p, sp, a in zip(PROMPTS[:3], PARAMS, LORAS)]
    tokens, texts, ends = {r: [] for r in rids}, {r: "" for r in rids}, {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.rid not in ends, "output after the request finished"
            tokens[out.rid] += out.token_ids
            texts[out.rid] += out.text
            if out.finished:
                ends[out.rid] = out
    assert [tokens[r] for r in rids] == alone(FAMILY)[:3]
    for r in rids:
        assert ends[r].finish_reason == "length" and ends[r].completion_tokens == 16
        assert texts[r] == engine.tokenizer.decode(tokens[r])


def test_abort_frees_the_request_and_spares_the_others(engine, alone):
    keep = engine.add_request(PROMPTS[1], PARAMS[1], lora=LORAS[1])
    drop = engine.add_request(PROMPTS[2], PARAMS[2], lora=LORAS[2])
    outputs = engine.step() + engine.step()  # both prefilled and decoding
    queued = engine.add_request(PROMPTS[3], PARAMS[3])  # not scheduled yet
    assert engine.abort(drop) and engine.abort(queued) and not engine.abort("no-such-id")
    while engine.has_unfinished():
        outputs += engine.step()
    ends = {o.rid: o.finish_reason for o in outputs if o.finished}
    assert ends == {keep: "length", drop: "abort", queued: "abort"}
    kept = [t for o in outputs if o.rid == keep for t in o.token_ids]
    assert kept == alone(FAMILY)[1]
    assert_released(engine)
    # an id is in use until its end is reported: two requests of one id would share its outputs
    engine.add_request(PROMPTS[0], PARAMS[0], rid="mine")
    with pytest.raises(ValueError, match="request id 'mine' is already in use"):
        engine.add_request(PROMPTS[0], PARAMS[0], rid="mine")
    assert engine.abort("mine")
    with pytest.raises(ValueError, match="request id 'mine' is still in use: its end is reported by the next step"):
        engine.add_request(PROMPTS[0], PARAMS[0], rid="mine")
    assert [o.finish_reason for o in engine.step() if o.rid == "mine"] == ["abort"]
    engine.add_request(PROMPTS[0], PARAMS[0], rid="mine")  # free again
    assert engine.abort("mine")
    while engine.has_unfinished():
        engine.step()
    assert_released(engine)


def test_bad_requests_fail_alone(engine, alone):
    good = engine.add_request(PROMPTS[0], PARAMS[0])
    outputs = engine.step()  # (with overlap scheduling, the first call launches a step and returns nothing)
    with pytest.raises(AdapterError, match="unknown adapter 'nope'"):
        engine.add_request([1, 2], lora="nope")
    with pytest.raises(ValueError, match="prompt has 20000 tokens"):
        engine.add_request([1] * 20000)
    with pytest.raises(ValueError, match=r"token ids must be ints in \[0, 96\)"):
        engine.add_request([1, 96])
    bad = SamplingParams()
    bad.temperature = -1.0
    with pytest.raises(ValueError, match="SamplingParams.temperature"):
        engine.add_request([1, 2], bad)
    with pytest.raises(ValueError, match="prompt 1: unknown adapter"):  # generate checks all before running any
        engine.generate([[1, 2], [3, 4]], lora=[None, "nope"])
    for when in ("yesterday", float("nan")):  # it once failed the step, and the good request with it
        with pytest.raises(ValueError, match="arrival_time must be a finite time.perf_counter"):
            engine.add_request([1, 2], lora="full", arrival_time=when)
    while engine.has_unfinished():
        outputs += engine.step()
    assert [t for o in outputs if o.rid == good for t in o.token_ids] == alone(FAMILY)[0]
    assert_released(engine)


def test_n_completions_use_consecutive_seeds(engine):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=3, ignore_eos=True)
    outs = engine.generate(PROMPTS[0], params, lora="full")
    assert len(outs) == 3 and len({tuple(o.token_ids) for o in outs}) == 3
    for k, out in enumerate(outs):
        one = SamplingParams(max_tokens=8, temperature=1.0, seed=7 + k, ignore_eos=True)
        assert engine.generate(PROMPTS[0], one, lora="full")[0].token_ids == out.token_ids


def test_logprobs_agree_with_prompt_logprobs(engine):
    out = engine.generate(PROMPTS[1], SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True),
                          lora="partial")[0]
    full = engine.prompt_logprobs([PROMPTS[1] + out.token_ids], lora="partial")[0]
    for i, (token, logprobs) in enumerate(zip(out.token_ids, out.logprobs)):
        row = full[len(PROMPTS[1]) - 1 + i]
        assert token in logprobs and len(logprobs) <= 3
        for t, lp in logprobs.items():
            assert lp == pytest.approx(row[t].item(), abs=1e-4)
        assert token == row.argmax().item()
    assert engine.generate(PROMPTS[1], SamplingParams(max_tokens=2))[0].logprobs is None


def test_stop_token_and_text_prompt(engine):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = engine.generate("abc", greedy)[0].token_ids
    assert tokens == engine.generate([[67, 68, 69]], greedy)[0].token_ids  # "abc" in the tiny tokenizer
    stop = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[tokens[4]])
    out = engine.generate("abc", stop)[0]
    first = tokens.index(tokens[4])
    assert out.finish_reason == "stop" and out.token_ids == tokens[:first + 1] and out.stop_reason == tokens[4]
    assert out.text == engine.tokenizer.decode(tokens[:first])
    assert engine.generate("abc", greedy)[0].stop_reason is None  # length
    rid = engine.add_request("abc", stop)  # the step API's last output says it too
    ends = []
    while engine.has_unfinished():
        ends += [o for o in engine.step() if o.finished]
    assert [(o.rid, o.stop_reason) for o in ends] == [(rid, tokens[4])]


def test_the_models_other_eos_tokens_end_requests_as_stop_tokens(checkpoint, tokenizer_dir, tmp_path):
    """As vLLM: the tokenizer's EOS ends a request as EOS (stop_reason None); the model's other EOS tokens
    (generation_config.json lists more) end it as stop_token_ids do, stop_reason naming the token, also in the
    caller's detokenizer; under ignore_eos neither ends it."""
    model = tmp_path / "model"
    shutil.copytree(checkpoint(FAMILY), model)
    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    other = 77
    GenerationConfig(eos_token_id=[eos, other]).save_pretrained(model)
    engine = Engine(str(model), device="cpu", dtype="float32", tokenizer_path=str(tokenizer_dir))
    assert set(engine.eos_token_ids) == {eos, other}
    for token, stop_reason in ((eos, None), (other, other)):
        push = SamplingParams(max_tokens=5, temperature=0.0, logit_bias={token: 100})
        out = engine.generate(PROMPTS[0], push)[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == ([token], "stop", stop_reason)
        detokenizer = engine.output_detokenizer(PROMPTS[0], push)
        detokenizer.add(token)
        assert (detokenizer.finish_reason, detokenizer.stop_reason) == ("stop", stop_reason)
        out = engine.generate(PROMPTS[0], replace(push, ignore_eos=True))[0]
        assert out.token_ids == [token] * 5 and out.finish_reason == "length"


def test_outputs_the_caller_detokenizes(engine):
    """detokenize=False: the engine's outputs carry tokens and no text; output_detokenizer gives the
    caller's thread the same text (and the stop-string finish) from them."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = engine.generate("abc", params)[0]
    prompt = engine.tokenize("abc")
    assert prompt == [67, 68, 69] and engine.tokenize(prompt) == prompt
    stop = want.text[3:5]
    for sp, text in [(params, want.text), (replace(params, stop=(stop,)), want.text[:want.text.index(stop)])]:
        engine.add_request(prompt, sp, detokenize=False)
        detokenizer, got = engine.output_detokenizer(prompt, sp), ""
        while not detokenizer.finished:
            for out in engine.step():  # (none from the first call, with overlap scheduling)
                assert out.text == ""
                got += "".join(detokenizer.add(t) for t in out.token_ids)
                if out.finished and not detokenizer.finished:
                    got += detokenizer.finish(out.finish_reason)
        assert got == text and detokenizer.finish_reason == ("length" if sp is params else "stop")
        engine.abort(out.rid)
        while engine.has_unfinished():
            engine.step()
    assert_released(engine)


def test_top_level_names():
    import moelora
    from moelora.engine.engine import Engine

    assert moelora.Engine is Engine and moelora.SamplingParams is SamplingParams


def test_chat_prompt_is_tokenized_once_by_the_engine(engine, monkeypatch):
    text = engine.chat_prompt([{"role": "user", "content": "Hello world"}])
    assert text.endswith("<|im_start|>assistant\n")
    monkeypatch.setattr(engine, "vocab_size", len(engine.tokenizer))  # the tiny models take token-id prompts only
    rid = engine.add_request(text, SamplingParams(max_tokens=1), add_special_tokens=False)
    assert engine.scheduler.find(rid).prompt_ids == engine.tokenizer.encode(text, add_special_tokens=False)
    assert engine.abort(rid)
    engine.step()
    assert engine.token_text(engine.tokenizer.eos_token_id) == "<|endoftext|>"
    monkeypatch.setattr(engine.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="has no chat template"):
        engine.chat_prompt([{"role": "user", "content": "Hello world"}])
    assert_released(engine)


def test_the_summary_says_how_long_the_start_took(make_engine):
    """What an operator reads once a server started (its last summary line): each phase of the start timed; on a GPU
    also the warm-up steps and graph captures, most of a cold start."""
    engine = make_engine(FAMILY)
    assert len(engine.config.lora_paths) == 2
    seconds, loras, kv = engine.start_seconds, "LoRA slots allocated, 2 adapters loaded", "KV cache allocated"
    assert list(seconds) == ["model loaded", loras, kv]  # no warm-up steps or graphs on the CPU
    assert engine.start_memory == {}  # nor GPU memory
    assert engine.summary()[-1] == (f"start: model loaded in {seconds['model loaded']:.1f} s, "
                                    f"{loras} in {seconds[loras]:.1f} s, {kv} in {seconds[kv]:.1f} s")
    # on a GPU: the memory in use after each phase (this process's and any other's), what an operator whose start
    # ran out of memory compares
    engine.start_memory = {"model loaded": 57 * 2**30, kv: 67 * 2**30 + 2**29}
    assert engine.summary()[-1] == (f"start: model loaded in {seconds['model loaded']:.1f} s (57.00 GiB of GPU memory "
                                    f"in use), {loras} in {seconds[loras]:.1f} s, {kv} in {seconds[kv]:.1f} s (67.50 "
                                    "GiB of GPU memory in use)")
    engine.shutdown()


@pytest.mark.parametrize("saved, served", [("float64", torch.float32), ("bfloat16", torch.bfloat16)])
def test_auto_serves_the_checkpoints_dtype_where_it_can(checkpoint, tokenizer_dir, tmp_path, saved, served):
    """dtype 'auto' takes config.json's dtype; float64, which --dtype refuses (the kernels have no float64), is
    served in float32."""
    model = tmp_path / "model"
    shutil.copytree(checkpoint(FAMILY), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "dtype": saved}))
    engine = Engine(str(model), device="cpu", dtype="auto", tokenizer_path=str(tokenizer_dir))
    assert engine.runner.dtype == served
    engine.shutdown()


def test_warm_up_sizes_reach_every_size_class():
    from moelora.engine.model_runner import warm_up_sizes
    sizes = warm_up_sizes(4096)
    assert sizes[:5] == [1, 2, 3, 4, 5] and sizes[-2:] == [2049, 4096] and warm_up_sizes(100)[-2:] == [65, 100]
    assert warm_up_sizes(0) == [] and warm_up_sizes(1) == [1]
    # any class of token counts (lo, hi] with hi >= 2 lo holds a size: fused_moe's rows per expert, linear's rows,
    # the alignment's copies of its counters; so does one that the most tokens of a step cut short
    for most in (4096, 100, 3000):
        sizes = warm_up_sizes(most)
        for lo in range(1, most):
            assert any(lo < n <= min(2 * lo, most) for n in sizes), (most, lo)


def test_warm_up_leaves_no_trace(make_engine, alone):
    """The start's prompt steps of every size class (run on GPUs only; here by hand) write only slot 0 and row
    0: requests after them get the tokens they get without, and every slot and row is free. Nothing in a step
    follows its size but the size, so a short context's 20 sizes (up to 600 tokens) test what the default's 28 (up to
    16383, quadratic attention on a CPU) would, in a fraction of the time."""
    engine = make_engine(FAMILY, context_length=600)
    engine.runner.warm_up(engine.runner.context_len)
    assert engine.runner.context_len == 600
    assert not engine.runner.kv.req_to_token[0].any()
    assert_released(engine)
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS, lora=LORAS)] == alone(FAMILY)
    assert_released(engine)


def test_warm_up_runs_each_rank_bound(make_engine, adapters, wide_adapter, monkeypatch):
    """In slots of rank 32, each warm-up size runs without an adapter slot and with one at each rank bound a step can
    run with (16 and 32, on every LoRA layer: each is a compiled variant of its kernels); the bound is the slots'
    afterwards. Then one decode row, for the decode attention kernels (CUDA graphs off: no capture runs them)."""
    engine = make_engine(FAMILY, max_lora_rank=32, lora_paths={"wide": wide_adapter})
    runner, seen = engine.runner, []
    buffers = runner.lora.slot_buffers
    real = runner.logits
    monkeypatch.setattr(runner, "logits", lambda batch: seen.append(
        (batch.num_tokens, batch.lora is not None, {b.max_rank_in_use for b in buffers}, batch.is_decode)) or real(batch))
    runner.warm_up(5)
    assert seen == [(n, lora, {bound}, False) for n in (1, 2, 3, 4, 5)
                    for lora, bound in ((False, 32), (True, 16), (True, 32))] + [(1, False, {32}, True)]
    assert {lora.max_rank_in_use for lora in buffers} == {32}


@pytest.mark.parametrize("warm_up", [False, True])
def test_the_start_warms_up_as_the_config_says(make_engine, monkeypatch, warm_up):
    """The runner's start runs the prompt steps exactly when EngineConfig.warm_up_at_start says so (on CUDA, unless
    skip_server_warmup: test_config.py); the answer is faked here, where the steps would never run."""
    from moelora.engine.config import EngineConfig
    from moelora.engine.model_runner import ModelRunner
    calls, real = [], ModelRunner.warm_up
    monkeypatch.setattr(EngineConfig, "warm_up_at_start", property(lambda self: warm_up))
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self, max_tokens: calls.append(max_tokens) or real(self, max_tokens))
    engine = make_engine(FAMILY, max_prefill_tokens=20)
    assert calls == ([20] if warm_up else [])
    assert_released(engine)


@pytest.mark.parametrize("phase, message", [
    ("warm-up", "running the start's prompt steps of up to 32 tokens: lower EngineConfig.chunked_prefill_size or "
                "EngineConfig.max_prefill_tokens"),
    ("decode graphs", "capturing the decode CUDA graphs to batch 4: lower EngineConfig.cuda_graph_max_bs, or set "
                      "EngineConfig.disable_cuda_graph"),
    ("prompt graphs", "capturing the prompt CUDA graphs to 16 tokens: lower EngineConfig.cuda_graph_max_prefill_tokens "
                      "(0: prompt steps run eagerly)")], ids=["warm-up", "decode-graphs", "prompt-graphs"])
@pytest.mark.parametrize("kv, kv_message", [
    ({"max_total_tokens": 64}, "EngineConfig.max_total_tokens (KV cache slots, 64 now)"),
    ({}, "EngineConfig.mem_fraction_static (the share of the GPU for the weights, LoRA slots and KV cache, 0.85 now)")],
    ids=["max_total_tokens", "mem_fraction_static"])
def test_a_start_out_of_gpu_memory_says_where_and_what_makes_room(make_engine, monkeypatch, phase, message, kv,
                                                                  kv_message):
    """Past the KV cache's allocation the start's prompt steps and CUDA graphs share the memory left: one that runs out
    fails the start with a message that names it and the settings that make room, not the allocator's traceback."""
    out_of_gpu_memory_in(phase, monkeypatch)
    with pytest.raises(ValueError) as failed:
        make_engine(FAMILY, max_prefill_tokens=32, cuda_graph_max_bs=4, cuda_graph_max_prefill_tokens=16, **kv)
    assert str(failed.value) == \
        f"the GPU ran out of memory {message}, or leave it more memory with a smaller {kv_message}"
    assert isinstance(failed.value.__cause__, torch.OutOfMemoryError)


def test_a_start_out_of_gpu_memory_says_the_memory_after_each_phase_before(make_engine, monkeypatch):
    """On a GPU the start reads the memory in use after each phase (ModelRunner.start_memory), and a phase that runs out
    of memory lists them: where it went, from the message alone (an H100 ran out capturing the 30B dummy's prompt
    graphs, and the server's log had nothing else). Faked on the CPU: each phase's reading is its order in GiB."""
    from moelora.engine import model_runner
    real = model_runner.ModelRunner._start_phase

    @contextlib.contextmanager
    def start_phase(self, name):
        with real(self, name):
            yield
        self.start_memory[name] = (len(self.start_memory) + 1) * 2**30
    monkeypatch.setattr(model_runner.ModelRunner, "_start_phase", start_phase)
    out_of_gpu_memory_in("prompt graphs", monkeypatch)
    with pytest.raises(ValueError) as failed:
        make_engine(FAMILY, max_prefill_tokens=32, cuda_graph_max_bs=4, cuda_graph_max_prefill_tokens=16)
    assert str(failed.value).endswith(
        " (in use after each phase of the start: model loaded: 1.00 GiB; LoRA slots allocated, 2 adapters loaded: 2.00 "
        "GiB; KV cache allocated: 3.00 GiB; prompt steps of 10 sizes run: 4.00 GiB; decode graphs to batch 4 captured: "
        "5.00 GiB)")


@pytest.mark.parametrize("phase", ["warm-up", "prompt graphs"])
def test_a_failed_start_lets_go_of_its_model_while_its_error_lives(make_engine, monkeypatch, phase):
    """The error's frames hold the runner that raised it: a caller that keeps the error (a notebook's last traceback,
    a retry with smaller settings) must not keep the failed start's weights, slots, KV cache and graphs with it."""
    from moelora.engine import model_runner
    models, load = [], model_runner.load_model

    def loaded(*args):
        model = load(*args)
        models.append(weakref.ref(model))
        return model
    monkeypatch.setattr(model_runner, "load_model", loaded)
    out_of_gpu_memory_in(phase, monkeypatch)
    with pytest.raises(ValueError, match="ran out of memory") as failed:
        make_engine(FAMILY, max_prefill_tokens=32, cuda_graph_max_bs=4, cuda_graph_max_prefill_tokens=16)
    gc.collect()
    assert failed.value is not None and len(models) == 1 and models[0]() is None, "the failed start's model is alive"


@pytest.mark.parametrize("error, ours", [
    (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), True),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False)], ids=["driver-oom", "other"])
def test_the_drivers_out_of_memory_in_a_graph_capture_gets_the_message_too(make_engine, monkeypatch, error, ours):
    """A graph's instantiation or a library's workspace allocates outside the caching allocator: the driver's
    out-of-memory is a plain RuntimeError, named the same way; any other error of the phase passes through as it is."""
    out_of_gpu_memory_in("decode graphs", monkeypatch, error)
    with pytest.raises(RuntimeError if not ours else ValueError) as failed:
        make_engine(FAMILY, cuda_graph_max_bs=4, max_total_tokens=64)
    if ours:
        assert str(failed.value).startswith("the GPU ran out of memory capturing the decode CUDA graphs to batch 4: ")
        assert failed.value.__cause__ is error
    else:
        assert failed.value is error


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_a_shut_down_engine_is_collected(make_engine, device):
    """Once shut down and dropped, an engine and its model go with the cyclic GC (on a GPU its CUDA graphs hold
    the runner's bound method: a cycle): nothing global keeps them, so a process that builds engines one after
    the other (benchmarks/bench_tp.py) gets each one's memory back."""
    options = dict(device="cuda", dtype="bfloat16", cuda_graph_max_bs=8, max_total_tokens=4096) if device == "cuda" \
        else {}
    engine = make_engine(FAMILY, **options)
    assert engine.generate(PROMPTS[:2], PARAMS[:2], lora=LORAS[:2])
    model, runner = weakref.ref(engine.runner.model), weakref.ref(engine.runner)
    engine.shutdown()
    del engine
    gc.collect()
    assert model() is None and runner() is None
