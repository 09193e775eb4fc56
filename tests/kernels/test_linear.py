"""The batch-invariant dense GEMM against torch's linear (Triton in the interpreter on CPU machines,
fp16 and fp32: the interpreter's bf16 tl.dot is not usable)."""
import pytest
import torch

from moelora.kernels.linear import LinearConfig, default_config, linear
from moelora.testing import assert_rows_close, rel_tolerance

DTYPES = [torch.float16, torch.float32]
CASES = [  # M, N, K: non-powers of two, N = 1 (Qwen2-MoE's shared_expert_gate), K not a multiple of BLOCK_K
    (1, 1, 64),
    (1, 48, 100),
    (3, 130, 70),
    (17, 33, 200),  # M past the decode tile
    (70, 20, 129),
    (130, 300, 96),  # M past BLOCK_M 128
]
CONFIGS = [  # forced tiles: small and large, partial swizzle groups, one stage
    LinearConfig(16, 16, 3, 4, 1),
    LinearConfig(32, 64, 1, 4, 4),
    LinearConfig(64, 32, 2, 4, 3),
    LinearConfig(128, 256, 8, 8, 3),
]


def _inputs(m, n, k, dtype, device, gen, bias=True):
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    return x, w, b


def _check(x, w, b, config=None):
    got = linear(x, w, b, impl="triton", config=config)
    assert got.dtype == x.dtype and got.shape == (x.shape[0], w.shape[0]) and got.is_contiguous()
    assert_rows_close(got, linear(x, w, b, impl="torch"), rel_tolerance(x.dtype, x.device))
    return got


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(case, dtype, with_bias, device, poison):
    gen = torch.Generator().manual_seed(torch.seed())
    _check(*_inputs(*case, dtype, device, gen, with_bias))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.block_m}x{c.block_n}g{c.group_m}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_forced_configs(config, dtype, device, poison):
    """Every tile size writes every output element (NaN-poisoned) and agrees with torch; 5 row blocks and
    3 n-tiles of the smallest tile make a partial GROUP_M group."""
    gen = torch.Generator().manual_seed(torch.seed())
    for m, n, k in ((70, 40, 100), (1, 1, 64), (130, 300, 96)):
        _check(*_inputs(m, n, k, dtype, device, gen), config)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows(dtype, device, poison):
    """x as a column slice of a wider tensor (rows longer than K): read through its row stride, no copy."""
    gen = torch.Generator().manual_seed(torch.seed())
    wide, w, b = _inputs(9, 50, 300, dtype, device, gen)
    x = wide[:, 120:220]
    assert x.stride(0) == 300
    got = _check(x, w[:, :100].contiguous(), b)
    assert torch.equal(got, linear(x.contiguous(), w[:, :100].contiguous(), b, impl="triton"))


def test_bias_is_added_before_the_one_rounding(device):
    """x.w = 1 + 2^-11 + 2^-13 and bias 2^-11: once rounded, 1 + 2^-10; rounded before the bias too, the
    sum would land on a tie and round to 1 + 2^-9."""
    x = torch.tensor([[1.0, 2.0**-11, 2.0**-13]], dtype=torch.float16, device=device)
    w = torch.ones(1, 3, dtype=torch.float16, device=device)
    y = linear(x, w, torch.tensor([2.0**-11], dtype=torch.float16, device=device), impl="triton")
    assert y.item() == 1 + 2.0**-10


def test_empty(device):
    x = torch.randn(0, 64, dtype=torch.float16, device=device)
    w = torch.randn(32, 64, dtype=torch.float16, device=device)
    assert linear(x, w, impl="triton").shape == (0, 32)
    assert linear(w, w[:0], impl="triton").shape == (32, 0)


def test_default_config_tiles():
    """tl.dot's 16-wide minimum for narrow N; decode tiles narrow enough to give o_proj (N = 2048)
    about one program per SM; prefill on 128-row tiles."""
    assert default_config(1, 1).block_n == 16 and default_config(1, 5120).block_m == 16
    assert default_config(1, 2048).block_n == 16 and default_config(1, 151936).block_n == 64
    assert default_config(4096, 5120).block_m == 128


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_bad_inputs_name_the_tensor(impl, device):
    x = torch.randn(4, 64, device=device, dtype=torch.float16)
    w = torch.randn(32, 64, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"x must be .*\[M, K\].*\(2, 2, 64\)"):
        linear(x.view(2, 2, 64), w, impl=impl)
    with pytest.raises(ValueError, match=r"x must be .*contiguous in its last dimension.*\(64, 4\)"):
        linear(x.t(), w, impl=impl)
    with pytest.raises(ValueError, match=r"weight must be contiguous \[N, 64\] .*\(4, 64\).*\(32, 48\)"):
        linear(x, w[:, :48], impl=impl)
    with pytest.raises(ValueError, match=r"weight must be contiguous .*\(64, 32\) with strides \(1, 64\)"):
        linear(x[:, :32], w.t(), impl=impl)
    with pytest.raises(ValueError, match=r"bias must be .*\(32,\) .*\(16,\)"):
        linear(x, w, w[0, :16], impl=impl)
    with pytest.raises(ValueError, match=r"weight must have x's dtype torch.float16 .*torch.float32"):
        linear(x, w.float(), impl=impl)
    with pytest.raises(ValueError, match=r"impl must be"):
        linear(x, w, impl="cublas")
