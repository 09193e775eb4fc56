"""Model classes by the "architectures" entry of a checkpoint's config.json."""
from __future__ import annotations

from moelora.models.base import CausalLM
from moelora.models.config import ModelConfig
from moelora.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from moelora.models.mixtral import MixtralForCausalLM
from moelora.models.olmoe import OlmoeForCausalLM
from moelora.models.qwen2_moe import Qwen2MoeForCausalLM
from moelora.models.qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}


def model_class(config: ModelConfig) -> type[CausalLM]:
    for arch in config.architectures:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ValueError(f"architectures {config.architectures} are not served (supported: {', '.join(sorted(ARCHITECTURES))})")
