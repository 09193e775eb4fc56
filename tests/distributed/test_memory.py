"""What one rank holds of DeepSeek-V3 and Qwen3-235B-A22B (their real config.json, the model built on the meta
device, nothing allocated) at tp 8 / ep 8, against one process: weights and LoRA slots about 1/8 (a little
more: norms, routers and MLA's low-rank projections are replicated), DeepSeek's KV cache 1/8 (MLA heads split),
Qwen3-235B's 1/4 (4 key/value heads over 8 ranks: each rank holds the one its query heads use). Every expert
is held by exactly one rank."""
import pytest
import torch

from moelora.distributed.state import ParallelState
from moelora.models.config import ModelConfig
from tests.support import deepseek_v3_config, qwen3_235b_a22b_config, rank_memory

SLOTS = (torch.bfloat16, 8, 16)  # bf16, 8 LoRA slots of rank 16


@pytest.mark.parametrize("hf, kv_share", [(deepseek_v3_config, 1 / 8), (qwen3_235b_a22b_config, 1 / 4)],
                         ids=["deepseek_v3", "qwen3_235b"])
def test_a_rank_holds_an_eighth(hf, kv_share, tmp_path):
    hf().save_pretrained(tmp_path)  # the dummy checkpoint: config.json is all a dummy load reads
    config = ModelConfig.from_pretrained(tmp_path)
    one = rank_memory(config, ParallelState(), *SLOTS)
    ranks = [rank_memory(config, ParallelState(r, 8, 8), *SLOTS) for r in (0, 7)]
    for rank in ranks:
        assert one.weights / 8 <= rank.weights <= 1.02 * one.weights / 8
        assert one.lora_slots / 8 <= rank.lora_slots <= 1.08 * one.lora_slots / 8
        assert rank.kv_per_token == one.kv_per_token * kv_share
    experts = config.num_experts
    assert ranks[0].experts[0] == range(0, experts // 8) and ranks[1].experts[-1] == range(experts - experts // 8, experts)
