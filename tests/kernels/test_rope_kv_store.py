import pytest
import torch

from moelora.kernels.kv_store import store_kv
from moelora.kernels.rms_norm import rms_norm
from moelora.kernels.rope_kv_store import (MAX_HEAD_BLOCKS, PROGRAMS, head_blocks_per_program, rope_store_kv,
                                           rope_store_kv_triton)
from moelora.kernels.rotary import rotary_embedding
from moelora.layers.rotary import rope_frequencies
from tests.support import assert_rows_close, rel_tolerance

# The interpreter rounds fp32 -> bf16 toward zero, so bf16 is checked on GPUs only.
DTYPES = [torch.bfloat16, torch.float16] if torch.cuda.is_available() else [torch.float16, torch.float32]
DEFAULT = dict(rope_type="default", rope_theta=1e6)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
            mscale=0.707, mscale_all_dim=1.0)  # scale != 1
CASES = [  # tokens, q heads, kv heads, head_dim, interleaved, rope
    (5, 6, 2, 64, False, DEFAULT),
    (1, 32, 4, 128, False, DEFAULT),  # Qwen3-30B-A3B, one decode token: 8 q blocks, 1 kv block
    (3, 4, 1, 128, False, YARN),  # one kv head a rank (TP): three masked heads in its block
    (4, 6, 2, 64, True, YARN),
    (7, 5, 3, 80, False, DEFAULT),  # non-power-of-two head_dim
    (3, 3, 1, 20, True, DEFAULT),  # D/2 = 10: off the power-of-two tile
    (70, 2, 2, 32, False, DEFAULT),  # many tokens of small heads: 16 a block, 14 of them masked
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that torch.equal also compares the NaNs of the slots nobody wrote."""
    return t.view({2: torch.int16, 4: torch.int32}[t.itemsize])


def _inputs(tokens, q_heads, kv_heads, head_dim, dtype, device, gen):
    """q, k, v as GQAttention passes them: [N, H, D] views of column slices of a fused qkv output."""
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, 300_000, (tokens,), generator=gen)  # computed cos/sin: past any table
    positions[0] = 0
    return positions.to(device), *(t.view(tokens, -1, head_dim) for t in (q, k, v))


def _norms(head_dim, dtype, device, gen):
    """(weight, eps) of the q and the k norm: weights not all ones, some negative; different eps."""
    return tuple(((1 + 0.5 * torch.randn(head_dim, generator=gen)).to(device, dtype), eps) for eps in (1e-6, 1e-5))


def _caches(slots, heads, head_dim, dtype, device):
    """NaN-filled caches: a slot the kernel should write and does not stays NaN."""
    return [torch.full((slots, heads, head_dim), float("nan"), dtype=dtype, device=device) for _ in range(2)]


def _unfused(positions, q, k, v, caches, loc, inv_freq, scale, interleaved, norms, impl):
    """q_norm, k_norm, rotary, store_kv: the four launches the fused kernel replaces."""
    if norms is not None:
        q, k = (rms_norm(x, *norm, impl=impl) for x, norm in zip((q, k), norms))
    q, k = rotary_embedding(positions, q, k, inv_freq, scale, interleaved, impl=impl)
    store_kv(*caches, loc, k, v, impl=impl)
    return q


def _check(positions, q, k, v, loc, rope, interleaved, norms, cache_dtype, slots) -> torch.Tensor:
    """The rotated q of the fused kernel, checked against the unfused Triton chain bit for bit (q and both
    caches, NaNs of unwritten slots included; on a GPU with an fp32 q and a norm, within the tolerance: the
    compiler lays out the norm's sums of squares differently there, see kernels/rope_kv_store.py), against the
    torch reference within the dtype's tolerance, inputs left as they were."""
    head_dim, device = q.shape[-1], q.device
    inv_freq, scale = rope_frequencies(head_dim, rope, 4096)
    rope_args = (inv_freq.to(device), scale, interleaved)
    inputs = [t.clone() for t in (positions, q, k, v, loc)]
    fused, chain, ref = (_caches(slots, k.shape[1], head_dim, cache_dtype, device) for _ in range(3))
    q_norm, k_norm = norms or (None, None)
    got = rope_store_kv(positions, q, k, v, *fused, loc, *rope_args, q_norm, k_norm, impl="triton")
    assert all(torch.equal(a, b) for a, b in zip(inputs, (positions, q, k, v, loc))), "inputs must be left as they were"
    want = _unfused(positions, q, k, v, chain, loc, *rope_args, norms, impl="triton")
    assert got.is_contiguous() and got.dtype == want.dtype and got.shape == q.shape
    if device.type == "cuda" and q.dtype == torch.float32 and norms is not None:
        tol = 16 * torch.finfo(torch.float32).eps  # a few ulps: one sum of squares rounded in another order
        assert_rows_close(got.flatten(0, 1), want.flatten(0, 1), tol, "q against the unfused chain")
        for name, g, w in zip("kv", fused, chain):
            assert torch.equal(g.isnan(), w.isnan()), f"{name} cache: other slots written than the unfused chain's"
            assert_rows_close(g.nan_to_num().flatten(0, 1), w.nan_to_num().flatten(0, 1), max(tol, rel_tolerance(
                cache_dtype, device)), f"{name} cache against the unfused chain")
    else:
        assert torch.equal(_bits(got), _bits(want)), "q differs from the unfused chain's"
        for name, g, w in zip("kv", fused, chain):
            assert torch.equal(_bits(g), _bits(w)), f"{name} cache differs from the unfused chain's"

    ref_q = rope_store_kv(positions, q, k, v, *ref, loc, *rope_args, q_norm, k_norm, impl="torch")
    # the norm and the rotation each round within rel_tolerance of torch's; the norm rounds x * rsqrt(mean x^2)
    # to q's dtype before the weight (as HF's), so a one-ulp difference of the rsqrt can move an element by an
    # ulp of q's dtype even when an fp32 weight makes the output fp32
    tol = 2 * rel_tolerance(q.dtype, device)
    assert_rows_close(got.flatten(0, 1), ref_q.flatten(0, 1), tol, "q")
    written = torch.zeros(slots, dtype=torch.bool, device=device)
    written[loc.long()] = True
    tol = max(tol, rel_tolerance(cache_dtype, device))  # a value a hair off may round to the cache's next value
    for name, g, r in zip("kv", fused, ref):
        assert not g[written].isnan().any(), f"{name}: a slot in loc was not written"
        assert g[~written].isnan().all(), f"{name}: a slot not in loc was written"
        assert_rows_close(g[written].flatten(0, 1), r[written].flatten(0, 1), tol, f"{name} cache")
    return got


@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_the_unfused_chain(case, dtype, with_norm, device, poison):
    tokens, q_heads, kv_heads, head_dim, interleaved, rope = case
    gen = torch.Generator().manual_seed(torch.seed())
    positions, q, k, v = _inputs(tokens, q_heads, kv_heads, head_dim, dtype, device, gen)
    assert tokens == 1 or q.stride(0) == k.stride(0) == v.stride(0) == (q_heads + 2 * kv_heads) * head_dim
    norms = _norms(head_dim, dtype, device, gen) if with_norm else None
    loc = torch.randperm(tokens + 9, generator=gen)[:tokens].to(device)
    _check(positions, q, k, v, loc, rope, interleaved, norms, dtype, tokens + 9)


@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float16, torch.float32), (torch.float32, torch.float16)])
def test_converts_to_the_cache_dtype(dtype, cache_dtype, loc_dtype, device, poison):
    """k rounded to q's dtype by the rotation, then converted to the cache's (to nearest even, as torch's .to)."""
    gen = torch.Generator().manual_seed(torch.seed())
    positions, q, k, v = _inputs(6, 6, 2, 64, dtype, device, gen)
    loc = torch.randperm(12, generator=gen)[:6].to(device, loc_dtype)
    _check(positions, q, k, v, loc, DEFAULT, False, _norms(64, dtype, device, gen), cache_dtype, 12)


def test_weight_dtype_promotes(device, poison):
    """fp32 norm weights on 16-bit q and k (an uncast checkpoint): the norm's output and so the rotation
    are fp32, as rms_norm types them; the cache keeps its dtype."""
    gen = torch.Generator().manual_seed(torch.seed())
    positions, q, k, v = _inputs(5, 6, 2, 64, torch.float16, device, gen)
    norms = _norms(64, torch.float32, device, gen)
    loc = torch.randperm(9, generator=gen)[:5].to(device)
    assert _check(positions, q, k, v, loc, DEFAULT, False, norms, torch.float16, 9).dtype == torch.float32


def test_no_tokens(device):
    q, k = torch.empty(0, 4, 64, device=device), torch.empty(0, 2, 64, device=device)
    caches = _caches(4, 2, 64, torch.float32, device)
    empty_int = torch.empty(0, dtype=torch.int64, device=device)
    got = rope_store_kv(empty_int, q, k, k, *caches, empty_int, torch.ones(32, device=device), impl="triton")
    assert got.shape == q.shape and all(c.isnan().all() for c in caches)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_bad_inputs_name_the_tensor(impl, device):
    positions, q, k, v = _inputs(3, 4, 2, 64, torch.float32, device, torch.Generator().manual_seed(0))
    caches, loc, inv_freq = _caches(8, 2, 64, torch.float32, device), torch.tensor([1, 5, 3], device=device), torch.ones(32)
    inv_freq, weight = inv_freq.to(device), torch.ones(64, device=device)
    args = (positions, q, k, v, *caches, loc, inv_freq)

    def call(*changed, **kwargs):
        rope_store_kv(*changed, *args[len(changed):], **kwargs, impl=impl)

    with pytest.raises(ValueError, match=r"same tokens and head_dim.*\(3, 4, 64\) and \(3, 2, 32\)"):
        call(positions, q, k[..., :32])
    with pytest.raises(ValueError, match=r"v must be .*\(3, 2, 64\).*\(2, 2, 64\)"):
        call(positions, q, k, v[:2])
    with pytest.raises(ValueError, match=r"k_cache must be contiguous .*\(8, 64, 2\)"):
        call(positions, q, k, v, caches[0].transpose(1, 2))
    with pytest.raises(ValueError, match=r"v must have q's head_dim 64 .*\(3, 2, 32\)"):
        call(positions, q, k, v[..., :32], caches[0], caches[1][..., :32].contiguous())
    with pytest.raises(ValueError, match=r"loc must be \[N\] int32 or int64.*torch.float32 \(3,\)"):
        call(positions, q, k, v, *caches, loc.float())
    with pytest.raises(ValueError, match=r"positions must be .*\(3,\).*\(2,\)"):
        call(positions[:2])
    with pytest.raises(ValueError, match=r"inv_freq must be .*\(32,\).*\(64,\)"):
        call(*args[:-1], torch.ones(64, device=device))
    with pytest.raises(ValueError, match=r"q_norm and k_norm go together"):
        call(*args, q_norm=(weight, 1e-6))
    with pytest.raises(ValueError, match=r"k_norm's weight .*\(64,\).*\(3, 4, 64\).*\(32,\)"):
        call(*args, q_norm=(weight, 1e-6), k_norm=(weight[:32], 1e-6))
    with pytest.raises(ValueError, match=r"k_norm's weight .*q_norm's dtype torch.float32.*torch.float16"):
        call(*args, q_norm=(weight, 1e-6), k_norm=(weight.half(), 1e-6))
    with pytest.raises(ValueError, match=r"impl must be"):
        rope_store_kv(*args, impl="cuda")


@pytest.mark.parametrize("with_norm", [False, True])
def test_head_blocks_per_program_keep_the_bits(with_norm, device, poison):
    """Programs that loop over several head tiles (prefill sizes) give each tile the bits of a program of one."""
    gen = torch.Generator().manual_seed(torch.seed())
    dtype = DTYPES[0]
    positions, q, k, v = _inputs(3, 32, 4, 128, dtype, device, gen)  # Qwen3-30B-A3B: 8 q tiles, 1 kv tile
    norms = _norms(128, dtype, device, gen) if with_norm else (None, None)
    loc = torch.randperm(12, generator=gen)[:3].to(device)
    inv_freq, scale = rope_frequencies(128, DEFAULT, 4096)
    outs = []
    for head_blocks in (1, 2, 3, 8):
        caches = _caches(12, 4, 128, dtype, device)
        q_out = rope_store_kv_triton(positions, q, k, v, *caches, loc, inv_freq.to(device), scale, False, *norms,
                                     head_blocks=head_blocks)
        outs.append([_bits(t) for t in (q_out, *caches)])
    for head_blocks, got in zip((2, 3, 8), outs[1:]):
        assert all(torch.equal(g, o) for g, o in zip(got, outs[0])), f"{head_blocks} head tiles a program: other bits"


def test_prefill_sizes_loop_over_head_blocks():
    assert head_blocks_per_program(1) == head_blocks_per_program(PROGRAMS) == 1  # decode: a program per head tile
    assert head_blocks_per_program(4 * PROGRAMS) == 4
    assert head_blocks_per_program(1 << 30) == MAX_HEAD_BLOCKS
