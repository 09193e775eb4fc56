"""RoPE against transformers: yarn frequencies and attention factors (DeepSeek's mscale), and the
rotation itself, in half-split and interleaved (DeepSeek) layouts."""
import pytest
import torch
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3RotaryEmbedding, apply_rotary_pos_emb,
                                                                  apply_rotary_pos_emb_interleave, yarn_apply_mscale)

from moelora.layers.rotary import RotaryEmbedding, rope_frequencies, softmax_scale_factor

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1)


@pytest.mark.parametrize("rope", [
    dict(rope_type="default", rope_theta=500000.0),
    dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0},  # DeepSeek-V3's own
    {**YARN, "mscale": 0.707, "mscale_all_dim": 0.8},
    {**YARN, "truncate": False},
    {**YARN, "attention_factor": 1.3, "beta_fast": 16},
])
def test_frequencies_and_scales_match_transformers(rope):
    config = DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=163840, rope_parameters=rope)
    init = DeepseekV3RotaryEmbedding.compute_default_rope_parameters if rope["rope_type"] == "default" else \
        ROPE_INIT_FUNCTIONS[rope["rope_type"]]
    want_freq, want_scale = init(config)
    freq, scale = rope_frequencies(64, config.rope_parameters, config.max_position_embeddings)
    torch.testing.assert_close(freq, want_freq, rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale, rel=1e-6)
    assert softmax_scale_factor(config.rope_parameters) == pytest.approx(yarn_apply_mscale(config.rope_parameters, 1.0))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotation_matches_transformers(interleaved):
    config = DeepseekV3Config(qk_rope_head_dim=16, max_position_embeddings=1024, rope_parameters={**YARN, "mscale": 0.9,
                              "mscale_all_dim": 0.7, "original_max_position_embeddings": 64})
    positions = torch.tensor([0, 1, 7, 300, 5])
    q, k = torch.randn(5, 4, 16), torch.randn(5, 1, 16)
    cos, sin = DeepseekV3RotaryEmbedding(config)(q, positions[None])
    apply = apply_rotary_pos_emb_interleave if interleaved else apply_rotary_pos_emb
    want_q, want_k = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    rope = RotaryEmbedding(16, config.rope_parameters, config.max_position_embeddings, interleaved)
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
