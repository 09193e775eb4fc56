"""What one rank holds of DeepSeek-V3 and Qwen3-235B-A22B (their real config.json, the model built on the meta
device, nothing allocated) at tp 8 / ep 8, against one process: weights and LoRA slots about 1/8 (a little
more: norms, routers and MLA's low-rank projections are replicated), DeepSeek's KV cache 1/8 (MLA heads split),
Qwen3-235B's 1/4 (4 key/value heads over 8 ranks: each rank holds the one its query heads use). Every expert
is held by exactly one rank."""
from dataclasses import dataclass

import pytest
import torch

from moelora.distributed.state import ParallelState, parallel_state
from moelora.engine.lora_slots import allocate_lora_slots, slot_bytes
from moelora.layers.moe.runner import Runner
from moelora.models.config import ModelConfig
from moelora.models.loader import build_model
from tests.support import deepseek_v3_config, qwen3_235b_a22b_config

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


@pytest.mark.parametrize("hf, kv_share", [(deepseek_v3_config, 1 / 8), (qwen3_235b_a22b_config, 1 / 4)],
                         ids=["deepseek_v3", "qwen3_235b"])
def test_a_rank_holds_an_eighth(hf, kv_share, tmp_path):
    hf().save_pretrained(tmp_path)  # the dummy checkpoint: config.json is all a dummy load reads
    config = ModelConfig.from_pretrained(tmp_path)
    one = rank_memory(config, ParallelState())
    ranks = [rank_memory(config, ParallelState(r, 8, 8)) for r in (0, 7)]
    for rank in ranks:
        assert one.weights / 8 <= rank.weights <= 1.02 * one.weights / 8
        assert one.lora_slots / 8 <= rank.lora_slots <= 1.08 * one.lora_slots / 8
        assert rank.kv_per_token == one.kv_per_token * kv_share
    experts = config.num_experts
    assert ranks[0].experts[0] == range(0, experts // 8) and ranks[1].experts[-1] == range(experts - experts // 8, experts)
