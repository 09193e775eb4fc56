import os

import pytest
import torch

from moelora.kernels.rms_norm import MAX_D, rms_norm
from moelora.layers.norm import RMSNorm
from tests.support import assert_rows_close, rel_tolerance

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# the interpreter rounds fp32 -> bf16 toward zero (GPUs: to nearest): up to a whole ulp per rounding, not half
TRUNCATES_BF16 = os.environ.get("TRITON_INTERPRET") == "1"
CASES = [  # leading shape, D
    ((5,), 48),
    ((3,), 100),
    ((4,), 128),
    ((2,), 2048),
    ((1,), 8192),  # the largest single-block rows (16 warps)
    ((), 100),  # a lone vector
    ((3, 2), 48),  # leading dimensions that merge: [rows, heads, D]
]


def _rand(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen).to(device, dtype)


def _weight(dim, dtype, device, gen):
    return (1 + 0.5 * torch.randn(dim, generator=gen)).to(device, dtype)  # not all ones, some negative


def _qkv_views(tokens, heads, kv_heads, head_dim, dtype, device, gen):
    """q and k as Qwen3's attention normalises them: [N, heads, D] views of column slices of the fused
    qkv output, whose rows are longer than heads * D."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = _rand((tokens, q_size + 2 * kv_size), dtype, device, gen)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)


def _check(x, weight, residual, eps=1e-6):
    """Triton against the torch reference: the output within the dtype's tolerance, the sum bit for bit
    (interpreted bf16: within the tolerance too)."""
    truncated = TRUNCATES_BF16 and x.dtype == torch.bfloat16
    tol = rel_tolerance(x.dtype, x.device) * (2 if truncated else 1)
    got, ref = rms_norm(x, weight, eps, residual, impl="triton"), rms_norm(x, weight, eps, residual, impl="torch")
    if residual is not None:
        (got, got_sum), (ref, ref_sum) = got, ref
        assert got_sum.dtype == x.dtype and got_sum.is_contiguous()
        if truncated:
            assert_rows_close(got_sum.view(-1, x.shape[-1]), ref_sum.view(-1, x.shape[-1]), tol, "x + residual")
        else:
            assert torch.equal(got_sum, ref_sum), "x + residual differs from torch's"
    assert got.dtype == ref.dtype and got.shape == x.shape and got.is_contiguous()
    assert_rows_close(got.view(-1, x.shape[-1]), ref.view(-1, x.shape[-1]), tol)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(case, dtype, with_residual, device, poison):
    gen = torch.Generator().manual_seed(torch.seed())
    lead, dim = case
    x = _rand((*lead, dim), dtype, device, gen) * 3
    residual = _rand(x.shape, dtype, device, gen) if with_residual else None
    _check(x, _weight(dim, dtype, device, gen), residual)


@pytest.mark.parametrize("head_dim", [48, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_norm_of_qkv_slices(head_dim, dtype, device, poison):
    """Strided 3D views, no copy; 40 heads of 128 fill ten programs of four, 4 heads of 48 half of one of
    eight (the other half masked)."""
    gen = torch.Generator().manual_seed(torch.seed())
    q, k = _qkv_views(3, 40, 4, head_dim, dtype, device, gen)
    assert q.stride(0) != 40 * head_dim
    for t in (q, k):
        _check(t, _weight(head_dim, dtype, device, gen), None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_with_residual(dtype, device, poison):
    """OLMoE's q norm over a whole column slice (2D, row stride != D) and DeepSeek's kv latent, with a
    residual that is itself a strided view."""
    gen = torch.Generator().manual_seed(torch.seed())
    wide = _rand((6, 160), dtype, device, gen)
    x, residual = wide[:, :100], _rand((6, 300), dtype, device, gen)[:, 200:]
    _check(x, _weight(100, dtype, device, gen), residual)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
def test_weight_dtype_promotes(x_dtype, device, poison):
    """weight * h as torch types it: an fp32 weight on 16-bit activations gives fp32, as transformers does
    before the model is cast."""
    gen = torch.Generator().manual_seed(torch.seed())
    x = _rand((5, 100), x_dtype, device, gen)
    weight = _weight(100, torch.float32, device, gen)
    _check(x, weight, _rand(x.shape, x_dtype, device, gen))
    out = rms_norm(x, weight, 1e-6, impl="triton")
    assert out.dtype == torch.float32
    assert not torch.equal(out, out.to(x_dtype).float()), "the product was rounded to x's dtype"


def test_no_rows(device):
    x = torch.empty(0, 64, dtype=torch.float16, device=device)
    out, summed = rms_norm(x, torch.ones(64, dtype=torch.float16, device=device), 1e-6, x, impl="triton")
    assert out.shape == summed.shape == (0, 64)


def test_module_matches_transformers_formula(device):
    """RMSNorm (torch on CPU, Triton on CUDA) against transformers' Qwen3MoeRMSNorm, with and without residual."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    gen = torch.Generator().manual_seed(torch.seed())
    norm, hf = RMSNorm(96, 1e-5).to(device, torch.float16), Qwen3MoeRMSNorm(96, 1e-5).to(device, torch.float16)
    with torch.no_grad():
        hf.weight.copy_(_weight(96, torch.float16, device, gen))
        norm.weight.copy_(hf.weight)
    x, residual = _rand((4, 96), torch.float16, device, gen), _rand((4, 96), torch.float16, device, gen)
    tol = rel_tolerance(torch.float16, device)
    assert_rows_close(norm(x), hf(x), tol)
    out, summed = norm(x, residual)
    assert torch.equal(summed, x + residual)
    assert_rows_close(out, hf(x + residual), tol)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_bad_inputs_name_the_tensor(impl, device):
    x = torch.randn(4, 64, device=device, dtype=torch.float16)
    weight = torch.ones(64, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"weight .*\(64,\).*\(4, 64\).*\(32,\)"):
        rms_norm(x, weight[:32], 1e-6, impl=impl)
    with pytest.raises(ValueError, match=r"residual must be torch.float16 .*\(4, 64\).*torch.float32"):
        rms_norm(x, weight, 1e-6, x.float(), impl=impl)
    with pytest.raises(ValueError, match=r"residual .*\(4, 64\).*\(4, 32\)"):
        rms_norm(x, weight, 1e-6, x[:, :32], impl=impl)
    with pytest.raises(ValueError, match=r"x must be .*contiguous in its last dimension.*\(64, 4\)"):
        rms_norm(x.t(), torch.ones(4, device=device), 1e-6, impl=impl)


def test_rows_longer_than_a_block_are_refused(device):
    x = torch.randn(1, MAX_D + 16, device=device)
    with pytest.raises(ValueError, match=rf"x: .*{MAX_D}.*\(1, {MAX_D + 16}\)"):
        rms_norm(x, torch.ones(MAX_D + 16, device=device), 1e-6, impl="triton")
