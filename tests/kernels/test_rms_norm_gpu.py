"""RMSNorm at Qwen3-30B-A3B's shapes in bf16 on a GPU (scripts/gpu_check.sh); skipped on CPU machines."""
import pytest
import torch

from moelora.kernels.rms_norm import rms_norm
from moelora.layers.norm import RMSNorm
from tests.support import assert_rows_close, rel_tolerance

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128  # Qwen3-30B-A3B attention; hidden 2048, o_proj input 4096


def _inputs(tokens, dim, gen):
    x, residual = (torch.randn(tokens, dim, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    return x, residual, (1 + 0.5 * torch.randn(dim, generator=gen, device="cuda")).to(torch.bfloat16)


def _qk(tokens, gen):
    """q and k: [N, heads, 128] views of column slices of the fused qkv output (rows of 5120)."""
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    q, k, _ = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    return q.view(tokens, HEADS, HEAD_DIM), k.view(tokens, KV_HEADS, HEAD_DIM)


@pytest.mark.parametrize("dim", [2048, 4096])
@pytest.mark.parametrize("tokens", [1, 7, 4096])
def test_hidden_norm_with_residual(dim, tokens, poison):
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    x, residual, weight = _inputs(tokens, dim, gen)
    out, summed = rms_norm(x, weight, 1e-6, residual, impl="triton")
    ref, ref_sum = rms_norm(x, weight, 1e-6, residual, impl="torch")
    assert torch.equal(summed, ref_sum)
    assert_rows_close(out, ref, rel_tolerance(torch.bfloat16, "cuda"))
    assert_rows_close(rms_norm(x, weight, 1e-6, impl="triton"), rms_norm(x, weight, 1e-6, impl="torch"),
                      rel_tolerance(torch.bfloat16, "cuda"))


@pytest.mark.parametrize("tokens", [1, 300])
def test_per_head_qk_norm(tokens, poison):
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    weight = (1 + 0.5 * torch.randn(HEAD_DIM, generator=gen, device="cuda")).to(torch.bfloat16)
    for t in _qk(tokens, gen):
        got, ref = rms_norm(t, weight, 1e-6, impl="triton"), rms_norm(t, weight, 1e-6, impl="torch")
        assert got.is_contiguous()
        assert_rows_close(got.flatten(0, 1), ref.flatten(0, 1), rel_tolerance(torch.bfloat16, "cuda"))


def test_rows_do_not_depend_on_the_batch():
    """A token alone gives the same bits as in a batch of 1000 (hidden norms and the per-head q/k norms)."""
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    x, residual, weight = _inputs(1000, 2048, gen)
    out, summed = rms_norm(x, weight, 1e-6, residual)
    q, k = _qk(1000, gen)
    head_weight = torch.randn(HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    q_out, k_out = rms_norm(q, head_weight, 1e-6), rms_norm(k, head_weight, 1e-6)
    for i in (0, 1, 517, 999):
        alone, alone_sum = rms_norm(x[i:i + 1], weight, 1e-6, residual[i:i + 1])
        assert torch.equal(alone[0], out[i]) and torch.equal(alone_sum[0], summed[i]), f"row {i}"
        assert torch.equal(rms_norm(q[i:i + 1], head_weight, 1e-6)[0], q_out[i]), f"q of token {i}"
        assert torch.equal(rms_norm(k[i:i + 1], head_weight, 1e-6)[0], k_out[i]), f"k of token {i}"


def test_module_runs_the_kernel_on_cuda():
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    x, residual, weight = _inputs(5, 2048, gen)
    norm = RMSNorm(2048).to("cuda", torch.bfloat16)
    norm.weight.copy_(weight)
    out, summed = norm(x, residual)
    expected, expected_sum = rms_norm(x, weight, norm.eps, residual, impl="triton")
    assert torch.equal(out, expected) and torch.equal(summed, expected_sum)
