import pytest
import torch

from moelora.kernels.rotary import rotary_embedding
from moelora.layers.rotary import RotaryEmbedding, rope_frequencies
from tests.support import assert_rows_close, rel_tolerance

# The interpreter rounds fp32 -> bf16 toward zero, so bf16 is checked on GPUs only.
DTYPES = [torch.bfloat16, torch.float16] if torch.cuda.is_available() else [torch.float16, torch.float32]
DEFAULT = dict(rope_type="default", rope_theta=1e6)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
            mscale=0.707, mscale_all_dim=1.0)  # scale = mscale(40, 0.707) / mscale(40, 1) != 1
CASES = [  # tokens, q heads, k heads, head_dim, interleaved, rope
    (1, 4, 1, 128, False, DEFAULT),
    (37, 8, 2, 64, False, DEFAULT),
    (37, 3, 3, 128, False, YARN),
    (37, 5, 1, 64, True, YARN),  # DeepSeek: rope_dim 64, one k head shared by every q head
    (1, 1, 1, 64, True, DEFAULT),
    (37, 2, 1, 20, True, DEFAULT),  # D/2 = 10: off the power-of-two tile
]


def _fused_qkv(tokens, q_heads, k_heads, head_dim, dtype, device, gen):
    """q and k as views of a fused [tokens, (Hq + 2 Hk) * D] projection output: strided rows."""
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * head_dim, generator=gen).to(device, dtype)
    q = qkv[:, :q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim:(q_heads + k_heads) * head_dim].view(tokens, k_heads, head_dim)
    return q, k


def _positions(tokens, device, gen):
    """Up to 300k, past every max_position_embeddings here: cos/sin are computed, not looked up."""
    positions = torch.randint(0, 300_000, (tokens,), generator=gen)
    positions[0] = 0
    return positions.to(device)


def _check(got, want, dtype, device, what):
    for name, g, w in zip("qk", got, want):
        assert g.is_contiguous() and g.dtype == w.dtype
        assert_rows_close(g.flatten(0, 1), w.flatten(0, 1), rel_tolerance(dtype, device), f"{what} {name}")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(case, dtype, device, poison):
    tokens, q_heads, k_heads, head_dim, interleaved, rope = case
    gen = torch.Generator().manual_seed(torch.seed())
    q, k = _fused_qkv(tokens, q_heads, k_heads, head_dim, dtype, device, gen)
    positions = _positions(tokens, device, gen)
    inv_freq, scale = rope_frequencies(head_dim, rope, 4096)
    inv_freq = inv_freq.to(device)
    q_in, k_in = q.clone(), k.clone()
    got = rotary_embedding(positions, q, k, inv_freq, scale, interleaved, impl="triton")
    assert torch.equal(q, q_in) and torch.equal(k, k_in), "inputs must be left as they were"
    want = rotary_embedding(positions, q, k, inv_freq, scale, interleaved, impl="torch")
    _check(got, want, dtype, device, f"{case}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_deepseek_views(dtype, device, poison):
    """MLA: q_rope is the tail of each [nope + rope] q head, k_rope the tail of the kv_a output."""
    tokens, heads, nope, rope_dim, kv_lora_rank = 37, 4, 32, 64, 48
    gen = torch.Generator().manual_seed(torch.seed())
    q = torch.randn(tokens, heads, nope + rope_dim, generator=gen).to(device, dtype)
    latent = torch.randn(tokens, kv_lora_rank + rope_dim, generator=gen).to(device, dtype)
    q_rope, k_rope = q[..., nope:], latent[:, kv_lora_rank:].unsqueeze(1)
    rotary = RotaryEmbedding(rope_dim, YARN, 163840, interleaved=True).to(device)
    positions = _positions(tokens, device, gen)
    got = rotary_embedding(positions, q_rope, k_rope, rotary.inv_freq, rotary.scale, True, impl="triton")
    _check(got, rotary_embedding(positions, q_rope, k_rope, rotary.inv_freq, rotary.scale, True, impl="torch"),
           dtype, device, "deepseek")


def test_empty_batch(device):
    q, k = torch.randn(0, 4, 64, device=device), torch.randn(0, 1, 64, device=device)
    positions = torch.zeros(0, dtype=torch.int64, device=device)
    got_q, got_k = rotary_embedding(positions, q, k, torch.ones(32, device=device), impl="triton")
    assert got_q.shape == q.shape and got_k.shape == k.shape


def test_rejects_bad_inputs():
    q, k, positions, inv_freq = torch.randn(3, 4, 64), torch.randn(3, 1, 64), torch.arange(3), torch.ones(32)
    with pytest.raises(ValueError, match="same tokens and head_dim"):
        rotary_embedding(positions, q, k[:, :, :32], inv_freq)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        rotary_embedding(positions, torch.randn(3, 4, 128)[..., ::2], k, inv_freq)
    with pytest.raises(ValueError, match="positions must be"):
        rotary_embedding(positions.float(), q, k, inv_freq)
    with pytest.raises(ValueError, match="inv_freq must be"):
        rotary_embedding(positions, q, k, torch.ones(64))
    with pytest.raises(ValueError, match="impl must be"):
        rotary_embedding(positions, q, k, inv_freq, impl="cuda")
