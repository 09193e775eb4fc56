"""Model classes by the "architectures" entry of a checkpoint's config.json."""
from __future__ import annotations

from transformers import PretrainedConfig

from moelora.models.base import CausalLM
from moelora.models.qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def model_class(config: PretrainedConfig) -> type[CausalLM]:
    for arch in config.architectures or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ValueError(f"architectures {config.architectures} are not served (supported: {', '.join(sorted(ARCHITECTURES))})")
