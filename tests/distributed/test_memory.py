"""What one rank holds of DeepSeek-V3 and Qwen3-235B-A22B (their real config.json, the model built on the meta
device, nothing allocated) at tp 8 / ep 8, against one process: weights and LoRA slots about 1/8 (a little
more: norms, routers and MLA's low-rank projections are replicated), DeepSeek's KV cache 1/8 (MLA heads split),
Qwen3-235B's 1/4 (4 key/value heads over 8 ranks: each rank holds the one its query heads use). Every expert
is held by exactly one rank."""
from dataclasses import dataclass

import pytest
import torch
from transformers import DeepseekV3Config, Qwen3MoeConfig

from moelora.distributed.state import ParallelState, parallel_state
from moelora.engine.lora_slots import allocate_lora_slots, slot_bytes
from moelora.layers.moe.runner import Runner
from moelora.models.config import ModelConfig
from moelora.models.loader import build_model

DEEPSEEK_V3 = DeepseekV3Config(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8,
    topk_group=4, first_k_dense_replace=3, routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=163840, architectures=["DeepseekV3ForCausalLM"],
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                         mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1))
QWEN3_235B_A22B = Qwen3MoeConfig(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94,
    num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, max_position_embeddings=40960, tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"])


@dataclass
class RankMemory:
    weights: int
    lora_slots: int
    kv_per_token: int
    experts: list[range]  # per MoE layer, the routed experts the rank holds


def rank_memory(config: ModelConfig, state: ParallelState) -> RankMemory:
    """What one rank of `state`'s layout holds: 8 LoRA slots of rank 16, bf16."""
    with parallel_state(state):
        model = build_model(config, torch.bfloat16, "meta")
    allocate_lora_slots(model, 8, 16)
    return RankMemory(sum(p.numel() * p.element_size() for p in model.parameters()), slot_bytes(model),
                      model.kv_cache_shape.bytes_per_token(torch.bfloat16),
                      [range(m.experts.start, m.experts.stop) for m in model.modules() if isinstance(m, Runner)])


@pytest.mark.parametrize("hf, kv_share", [(DEEPSEEK_V3, 1 / 8), (QWEN3_235B_A22B, 1 / 4)], ids=["deepseek_v3", "qwen3_235b"])
def test_a_rank_holds_an_eighth(hf, kv_share, tmp_path):
    hf.save_pretrained(tmp_path)  # the dummy checkpoint: config.json is all a dummy load reads
    config = ModelConfig.from_pretrained(tmp_path)
    one = rank_memory(config, ParallelState())
    ranks = [rank_memory(config, ParallelState(r, 8, 8)) for r in (0, 7)]
    for rank in ranks:
        assert one.weights / 8 <= rank.weights <= 1.02 * one.weights / 8
        assert one.lora_slots / 8 <= rank.lora_slots <= 1.08 * one.lora_slots / 8
        assert rank.kv_per_token == one.kv_per_token * kv_share
    experts = config.num_experts
    assert ranks[0].experts[0] == range(0, experts // 8) and ranks[1].experts[-1] == range(experts - experts // 8, experts)
