"""RoPE at real model shapes in bf16 on a GPU (scripts/gpu_check.sh); skipped on CPU machines."""
import pytest
import torch

from moelora.kernels.rotary import rotary_embedding
from moelora.layers.rotary import RotaryEmbedding
from tests.support import assert_rows_close, rel_tolerance

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MODELS = {  # q heads, k heads, rotary dims, interleaved, rope_parameters, max_position_embeddings
    "qwen3-30b-a3b": (32, 4, 128, False, dict(rope_type="default", rope_theta=1e6), 40960),
    "deepseek-v3": (128, 1, 64, True, dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0,
                                           mscale_all_dim=1.0, original_max_position_embeddings=4096), 163840),
    "deepseek-v2-lite": (16, 1, 64, True, dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=0.707,
                                               mscale_all_dim=0.707, original_max_position_embeddings=4096), 163840),
}


def _inputs(model, tokens, gen):
    """q and k as the models hand them over: Qwen3's from a fused qkv output (strided rows; its
    per-head RMSNorm makes them contiguous, a plain GQA model does not), DeepSeek's as the rotary
    tails of q heads and of the kv_a output."""
    q_heads, k_heads, dim, interleaved, rope, max_pos = MODELS[model]
    rotary = RotaryEmbedding(dim, rope, max_pos, interleaved).cuda()
    if interleaved:
        q = torch.randn(tokens, q_heads, 128 + dim, generator=gen).to("cuda", torch.bfloat16)[..., 128:]
        k = torch.randn(tokens, 512 + dim, generator=gen).to("cuda", torch.bfloat16)[:, 512:].unsqueeze(1)
    else:
        qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * dim, generator=gen).to("cuda", torch.bfloat16)
        q = qkv[:, :q_heads * dim].view(tokens, q_heads, dim)
        k = qkv[:, q_heads * dim:(q_heads + k_heads) * dim].view(tokens, k_heads, dim)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).cuda()
    return rotary, positions, q, k


def _reference(rotary, positions, q, k):
    return rotary_embedding(positions, q, k, rotary.inv_freq, rotary.scale, rotary.interleaved, impl="torch")


@pytest.mark.parametrize("tokens", [1, 7, 513, 8192])
@pytest.mark.parametrize("model", list(MODELS))
def test_real_shape_matches_reference(model, tokens, poison):
    gen = torch.Generator().manual_seed(torch.seed())
    rotary, positions, q, k = _inputs(model, tokens, gen)
    for name, got, want in zip("qk", rotary(positions, q, k), _reference(rotary, positions, q, k)):
        assert_rows_close(got.flatten(0, 1), want.flatten(0, 1), rel_tolerance(torch.bfloat16, "cuda"),
                          f"{model} T={tokens} {name}")


@pytest.mark.parametrize("model", list(MODELS))
def test_row_does_not_depend_on_batch(model, poison):
    gen = torch.Generator().manual_seed(torch.seed())
    rotary, positions, q, k = _inputs(model, 1000, gen)
    q_batch, k_batch = rotary(positions, q, k)
    for t in (0, 1, 500, 999):
        q_alone, k_alone = rotary(positions[t:t + 1], q[t:t + 1], k[t:t + 1])
        assert torch.equal(q_alone[0], q_batch[t]) and torch.equal(k_alone[0], k_batch[t]), f"token {t}"


def test_replays_in_a_cuda_graph():
    """Captured once, replayed with other positions and inputs: nothing is read back on the host."""
    gen = torch.Generator().manual_seed(torch.seed())
    rotary, positions, q, k = _inputs("qwen3-30b-a3b", 16, gen)
    pos_buf, q_buf, k_buf = positions.clone(), q.clone(), k.clone()
    rotary(pos_buf, q_buf, k_buf)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out, k_out = rotary(pos_buf, q_buf, k_buf)
    for _ in range(2):
        _, positions, q, k = _inputs("qwen3-30b-a3b", 16, gen)
        pos_buf.copy_(positions), q_buf.copy_(q), k_buf.copy_(k)
        graph.replay()
        want_q, want_k = _reference(rotary, positions, q, k)
        tol = rel_tolerance(torch.bfloat16, "cuda")
        assert_rows_close(q_out.flatten(0, 1), want_q.flatten(0, 1), tol, "graph replay q")
        assert_rows_close(k_out.flatten(0, 1), want_k.flatten(0, 1), tol, "graph replay k")
