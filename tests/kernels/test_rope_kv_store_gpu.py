"""The fused q/k norm, RoPE and KV-cache store at real model shapes in bf16 on a GPU (scripts/gpu_check.sh),
bit for bit against the unfused chain it replaces (rms_norm -> rotary_embedding -> store_kv); and a model
step through it against the same step through the chain. Skipped on CPU machines."""
import pytest
import torch

from moelora.kernels import kv_store, rope_kv_store, rotary
from moelora.kernels.kv_store import store_kv
from moelora.kernels.rms_norm import rms_norm
from moelora.kernels.rope_kv_store import rope_store_kv
from moelora.kernels.rotary import rotary_embedding
from moelora.layers import attention as attention_layer
from moelora.layers.norm import RMSNorm
from moelora.layers.rotary import rope_frequencies
from moelora.models.loader import build_model, fill_dummy_weights
from tests.models.families import family_config
from tests.support import assert_rows_close, extend_batch, rel_tolerance, toy_kv_cache

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SLOTS = 5000
MODELS = {  # q heads, kv heads (one rank's), head_dim, per-head q/k norm, rope_theta
    "qwen3-30b-a3b": (32, 4, 128, True, 1e6),
    "qwen3-30b-a3b-tp8": (4, 1, 128, True, 1e6),
    "mixtral-8x7b": (32, 8, 128, False, 1e6),
    "qwen2-57b-a14b": (28, 4, 128, False, 1e6),
    "olmoe-1b-7b": (16, 16, 128, False, 1e4),
}


def _inputs(model, tokens, gen, weight_dtype=torch.bfloat16):
    """positions, q, k, v (views of a fused qkv output), slots, rope (inv_freq, scale, interleaved), norms."""
    q_heads, kv_heads, dim, norm, theta = MODELS[model]
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, generator=gen, device="cuda").to(torch.bfloat16)
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([q_heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    positions = torch.randint(0, 40960, (tokens,), generator=gen, device="cuda")
    loc = torch.randperm(SLOTS, generator=gen, device="cuda")[:tokens]
    inv_freq, scale = rope_frequencies(dim, dict(rope_type="default", rope_theta=theta), 40960)
    norms = tuple(((1 + 0.5 * torch.randn(dim, generator=gen, device="cuda")).to(weight_dtype), 1e-6)
                  for _ in range(2)) if norm else None
    return positions, q, k, v, loc, (inv_freq.cuda(), scale, False), norms


def _caches(kv_heads, dim):
    return [torch.full((SLOTS, kv_heads, dim), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(2)]


def _fused(positions, q, k, v, loc, rope, norms, impl="triton"):
    caches = _caches(k.shape[1], k.shape[2])
    return rope_store_kv(positions, q, k, v, *caches, loc, *rope, *(norms or (None, None)), impl=impl), caches


def _unfused(positions, q, k, v, k_cache, v_cache, loc, inv_freq, scale, interleaved, q_norm=None, k_norm=None):
    """The four launches the fused kernel replaces, with rope_store_kv's signature."""
    if q_norm is not None:
        q, k = rms_norm(q, *q_norm, impl="triton"), rms_norm(k, *k_norm, impl="triton")
    q, k = rotary_embedding(positions, q, k, inv_freq, scale, interleaved, impl="triton")
    store_kv(k_cache, v_cache, loc, k, v, impl="triton")
    return q


def _chain(positions, q, k, v, loc, rope, norms):
    caches = _caches(k.shape[1], k.shape[2])
    return _unfused(positions, q, k, v, *caches, loc, *rope, *(norms or (None, None))), caches


def _assert_same_bits(got, want, what):
    (q, caches), (want_q, want_caches) = got, want
    assert q.dtype == want_q.dtype and torch.equal(q.view(torch.int16 if q.itemsize == 2 else torch.int32),
                                                   want_q.view(torch.int16 if q.itemsize == 2 else torch.int32)), f"{what}: q"
    for name, g, w in zip("kv", caches, want_caches):
        assert torch.equal(g.view(torch.int16), w.view(torch.int16)), f"{what}: {name} cache"


@pytest.mark.parametrize("tokens", [1, 7, 4096])
@pytest.mark.parametrize("model", list(MODELS))
def test_matches_the_unfused_chain(model, tokens, poison):
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    args = _inputs(model, tokens, gen)
    got = _fused(*args)
    _assert_same_bits(got, _chain(*args), f"{model} T={tokens}")
    ref_q, ref_caches = _fused(*args, impl="torch")
    tol = 2 * rel_tolerance(torch.bfloat16, "cuda")  # the norm and the rotation each within rel_tolerance
    assert_rows_close(got[0].flatten(0, 1), ref_q.flatten(0, 1), tol, f"{model} T={tokens} q vs torch")
    loc = args[4]
    for name, g, r in zip("kv", got[1], ref_caches):
        assert_rows_close(g[loc].flatten(0, 1), r[loc].flatten(0, 1), tol, f"{model} T={tokens} {name} vs torch")


def test_fp32_norm_weights():
    """An fp32 weight on bf16 q and k: an fp32 rotation, stored into the bf16 cache (rounded to nearest)."""
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    args = _inputs("qwen3-30b-a3b", 300, gen, weight_dtype=torch.float32)
    got = _fused(*args)
    assert got[0].dtype == torch.float32
    _assert_same_bits(got, _chain(*args), "fp32 weights")


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_row_does_not_depend_on_batch(model):
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    positions, q, k, v, loc, rope, norms = _inputs(model, 1000, gen)
    q_batch, caches_batch = _fused(positions, q, k, v, loc, rope, norms)
    for t in (0, 1, 500, 999):
        one = slice(t, t + 1)
        q_alone, caches_alone = _fused(positions[one], q[one], k[one], v[one], loc[one], rope, norms)
        assert torch.equal(q_alone[0], q_batch[t]), f"q of token {t}"
        for name, alone, batch in zip("kv", caches_alone, caches_batch):
            assert torch.equal(alone[loc[t]], batch[loc[t]]), f"{name} of token {t}"


def test_replays_in_a_cuda_graph():
    """Captured once, replayed on new positions, inputs and slots written into the captured tensors."""
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    positions, q, k, v, loc, rope, norms = _inputs("qwen3-30b-a3b", 16, gen)
    caches = _caches(4, 128)
    rope_store_kv(positions, q, k, v, *caches, loc, *rope, *norms)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out = rope_store_kv(positions, q, k, v, *caches, loc, *rope, *norms)
    for _ in range(2):
        new = _inputs("qwen3-30b-a3b", 16, gen)
        for buffer, value in zip((positions, q, k, v, loc), new):  # q, k, v: views of one qkv buffer
            buffer.copy_(value)
        want = _chain(*new[:5], rope, norms)
        for c in caches:
            c.fill_(float("nan"))
        graph.replay()
        _assert_same_bits((q_out, caches), want, "graph replay")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"])
def test_model_steps_match_the_unfused_chain(family, monkeypatch):
    """A tiny model in bf16, prefill, decode, then a mixed step: the same hidden states and KV cache, bit for
    bit, through the fused kernel (one launch a layer, no rotary or store_kv launch) as through the chain."""
    model = build_model(family_config(family), torch.bfloat16, "cuda")
    fill_dummy_weights(model)
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    for m in model.modules():  # norms (Qwen3's per-head ones) with weights that are not all ones
        if isinstance(m, RMSNorm):
            m.weight.copy_(1 + 0.5 * torch.randn(m.weight.shape, generator=gen, device="cuda"))
    launches = dict.fromkeys(("fused", "rotary", "store_kv"), 0)

    def count(module, name, key):
        fn = getattr(module, name)

        def call(*args, **kwargs):
            launches[key] += 1
            return fn(*args, **kwargs)
        monkeypatch.setattr(module, name, call)

    count(rope_kv_store, "rope_store_kv_triton", "fused")
    count(rotary, "rotary_embedding_triton", "rotary")
    count(kv_store, "store_kv_triton", "store_kv")
    fused_kv, chain_kv = toy_kv_cache(model, 2, 16), toy_kv_cache(model, 2, 16)
    steps = [([[5, 17, 2, 93, 41], [11, 4, 77]], [0, 0], 0), ([[8], [60]], [5, 3], 2), ([[9], [1, 2, 3]], [6, 4], 1)]
    for tokens, prefix_lens, num_decode in steps:
        launches.update(fused=0, rotary=0, store_kv=0)
        got = model(extend_batch(fused_kv, tokens, prefix_lens, num_decode=num_decode))
        assert launches == dict(fused=len(model.model.layers), rotary=0, store_kv=0), launches
        with monkeypatch.context() as m:
            m.setattr(attention_layer, "rope_store_kv", _unfused)
            want = model(extend_batch(chain_kv, tokens, prefix_lens, num_decode=num_decode))
        assert torch.equal(got, want), f"{family}: hidden states of the step after {prefix_lens}"
        for layer, (k, want_k, v, want_v) in enumerate(zip(fused_kv.k, chain_kv.k, fused_kv.v, chain_kv.v)):
            assert torch.equal(k, want_k) and torch.equal(v, want_v), f"{family}: layer {layer}'s cache"
