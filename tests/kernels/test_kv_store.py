import pytest
import torch

from moelora.kernels.kv_store import TILE, store_kv

# same-dtype copies are exact in the interpreter for bf16 too; it rounds fp32 -> bf16 toward zero (GPUs: to
# nearest), so that conversion is tested in test_kv_store_gpu.py only
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
CASES = [  # tokens, kv heads, Dk, Dv
    (1, 4, 128, 128),  # Qwen3, one decode token
    (5, 1, 192, 128),  # DeepSeek MLA as one kv head
    (3, 16, 192, 128),  # DeepSeek-V2-Lite: a kv head per query head
    (7, 3, 80, 48),  # non-power-of-two dims
    (130, 2, 64, 64),  # more tokens than a block of anything
    (2, 40, 128, 128),  # two programs of 32 heads, the second part masked
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that torch.equal also compares the NaNs of the slots nobody wrote."""
    return t.view({2: torch.int16, 4: torch.int32}[t.itemsize])


def _caches(slots, heads, k_dim, v_dim, dtype, device):
    """NaN-filled caches: a slot the kernel should write and does not stays NaN."""
    return tuple(torch.full((slots, heads, d), float("nan"), dtype=dtype, device=device) for d in (k_dim, v_dim))


def _loc(tokens, slots, dtype, device, gen):
    return torch.randperm(slots, generator=gen)[:tokens].to(device, dtype)


def _check(k_cache, v_cache, loc, k, v):
    """Triton against the torch reference, bit for bit, on copies of the caches; slots not in loc untouched."""
    got, ref = (k_cache.clone(), v_cache.clone()), (k_cache.clone(), v_cache.clone())
    store_kv(*got, loc, k, v, impl="triton")
    store_kv(*ref, loc, k, v, impl="torch")
    written = torch.zeros(k_cache.shape[0], dtype=torch.bool, device=k_cache.device)
    written[loc.long()] = True
    for name, g, r, before, new in zip("kv", got, ref, (k_cache, v_cache), (k, v)):
        assert torch.equal(_bits(g), _bits(r)), f"{name} cache differs from torch's"
        assert torch.equal(_bits(g[~written]), _bits(before[~written])), f"{name}: a slot not in loc was written"
        assert torch.equal(g[loc.long()], new.to(g.dtype)), f"{name}: written slots differ from the new tokens"


@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(case, dtype, loc_dtype, device):
    gen = torch.Generator().manual_seed(torch.seed())
    tokens, heads, k_dim, v_dim = case
    k_cache, v_cache = _caches(tokens + 9, heads, k_dim, v_dim, dtype, device)
    k, v = (torch.randn(tokens, heads, d, generator=gen).to(device, dtype) for d in (k_dim, v_dim))
    _check(k_cache, v_cache, _loc(tokens, tokens + 9, loc_dtype, device, gen), k, v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views(dtype, device):
    """k and v as the models pass them, no copy: column slices of the fused qkv output (Qwen3), MLA's
    per-head split of kv_b's output, an expanded (stride 0) head, and heads outer to tokens."""
    gen = torch.Generator().manual_seed(torch.seed())
    tokens, heads, dim = 6, 4, 128
    qkv = torch.randn(tokens, (8 + 2 * heads) * dim, generator=gen).to(device, dtype)
    _, k, v = qkv.split([8 * dim, heads * dim, heads * dim], dim=-1)
    k, v = k.view(tokens, heads, dim), v.view(tokens, heads, dim)
    assert k.stride(0) == v.stride(0) == (8 + 2 * heads) * dim
    kv = torch.randn(tokens, heads, 128 + 96, generator=gen).to(device, dtype)
    mla_k, mla_v = torch.randn(tokens, 1, 192, generator=gen).to(device, dtype).expand(-1, heads, -1), kv[..., 128:]
    transposed = torch.randn(heads, tokens, dim, generator=gen).to(device, dtype).transpose(0, 1)
    for k, v in ((k, v), (mla_k, mla_v), (transposed, v), (k, transposed)):
        loc = _loc(tokens, 20, torch.int64, device, gen)
        _check(*_caches(20, heads, k.shape[-1], v.shape[-1], dtype, device), loc, k, v)


def test_last_dimension_not_contiguous(device):
    """Copied first on the Triton path."""
    gen = torch.Generator().manual_seed(torch.seed())
    k = torch.randn(3, 2, 128, generator=gen).to(device)[..., ::2]
    v = torch.randn(3, 32, 2, generator=gen).to(device).transpose(1, 2)
    _check(*_caches(8, 2, 64, 32, torch.float32, device), _loc(3, 8, torch.int64, device, gen), k, v)


@pytest.mark.parametrize("new_dtype, cache_dtype", [(torch.float32, torch.float16), (torch.float16, torch.float32),
                                                    (torch.bfloat16, torch.float32)])
def test_converts_to_the_cache_dtype(new_dtype, cache_dtype, device):
    """fp32 -> fp16 rounds to nearest even, as torch's .to does."""
    gen = torch.Generator().manual_seed(torch.seed())
    k, v = (torch.randn(9, 2, d, generator=gen).to(device, new_dtype) * 100 for d in (96, 64))
    _check(*_caches(12, 2, 96, 64, cache_dtype, device), _loc(9, 12, torch.int32, device, gen), k, v)


def test_no_tokens(device):
    k_cache, v_cache = _caches(4, 2, 64, 64, torch.float16, device)
    empty = torch.empty(0, 2, 64, dtype=torch.float16, device=device)
    store_kv(k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=device), empty, empty, impl="triton")
    assert k_cache.isnan().all() and v_cache.isnan().all()


def test_many_heads_of_small_dims_share_a_program(device):
    """TILE / Dk heads a program: 256 heads of 32 in two programs a token."""
    gen = torch.Generator().manual_seed(torch.seed())
    heads, dim = 2 * TILE // 32, 32
    k, v = (torch.randn(2, heads, dim, generator=gen).to(device, torch.float16) for _ in range(2))
    _check(*_caches(5, heads, dim, dim, torch.float16, device), _loc(2, 5, torch.int64, device, gen), k, v)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_bad_inputs_name_the_tensor(impl, device):
    k_cache, v_cache = _caches(8, 2, 64, 32, torch.float16, device)
    loc = torch.tensor([1, 5, 3], device=device)
    k, v = torch.randn(3, 2, 64, device=device), torch.randn(3, 2, 32, device=device)
    with pytest.raises(ValueError, match=r"k must be .*\(3, 2, 64\).*\(3,\).*\(8, 2, 64\).*\(3, 2, 32\)"):
        store_kv(k_cache, v_cache, loc, v, v, impl=impl)
    with pytest.raises(ValueError, match=r"v must be .*\(3, 2, 32\).*\(2, 2, 32\)"):
        store_kv(k_cache, v_cache, loc, k, v[:2], impl=impl)
    with pytest.raises(ValueError, match=r"loc must be \[N\] int32 or int64.*torch.float32 \(3,\)"):
        store_kv(k_cache, v_cache, loc.float(), k, v, impl=impl)
    with pytest.raises(ValueError, match=r"loc must be .*\(3, 1\)"):
        store_kv(k_cache, v_cache, loc[:, None], k, v, impl=impl)
    with pytest.raises(ValueError, match=r"v_cache \(8, 3, 32\).*k_cache \(8, 2, 64\)"):
        store_kv(k_cache, torch.zeros(8, 3, 32, device=device), loc, k, v, impl=impl)
    with pytest.raises(ValueError, match=r"k_cache must be contiguous .*\(8, 64, 2\)"):
        store_kv(k_cache.transpose(1, 2), v_cache, loc, k, v, impl=impl)
    with pytest.raises(ValueError, match=r"v must be floating point .*torch.int64"):
        store_kv(k_cache, v_cache, loc, k, v.long(), impl=impl)
    with pytest.raises(ValueError, match=r"impl must be"):
        store_kv(k_cache, v_cache, loc, k, v, impl="cuda")
