"""The shape table of each family against the modules transformers builds from the same config."""
import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config, LlamaConfig

from lora_builders import FAMILIES, tiny_config
from moelora.lora import AdapterError, load_model_shapes


def transformers_shapes(config) -> dict[int, dict[str, tuple[int, int]]]:
    """(in, out) of every 2D weight in the decoder layers, experts as 'mlp.experts.<param>' (E, in, out)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers: dict[int, dict] = {}
    for name, p in model.named_parameters():
        if ".layers." not in name or p.ndim == 1:
            continue
        _, _, layer, rel = name.split(".", 3)
        shape = (p.shape[0], p.shape[2], p.shape[1]) if p.ndim == 3 else (p.shape[1], p.shape[0])
        layers.setdefault(int(layer), {})[rel.removesuffix(".weight")] = shape
    return layers


@pytest.mark.parametrize("config", [*(tiny_config(f) for f in FAMILIES),
                                    DeepseekV2Config(num_hidden_layers=3), DeepseekV3Config(num_hidden_layers=4)],
                         ids=[*FAMILIES, "deepseek_v2_full_width", "deepseek_v3_full_width"])
def test_shapes_match_transformers(config):
    shapes = load_model_shapes(config)
    for layer, found in transformers_shapes(config).items():
        experts = {k: found.pop(k) for k in [k for k in found if k.startswith("mlp.experts.")]}
        assert shapes.modules[layer] == found, f"layer {layer}"
        assert (layer in shapes.moe_layers) == bool(experts)
        if experts:
            e, h, i = shapes.num_experts, shapes.hidden_size, shapes.moe_intermediate_size
            assert experts == {"mlp.experts.gate_up_proj": (e, h, 2 * i), "mlp.experts.down_proj": (e, i, h)}
    assert shapes.num_layers == config.num_hidden_layers


def test_model_dir_and_unsupported_family(tmp_path):
    tiny_config("olmoe").save_pretrained(tmp_path / "olmoe")
    assert load_model_shapes(tmp_path / "olmoe").model_type == "olmoe"
    with pytest.raises(AdapterError, match="no config.json"):
        load_model_shapes(tmp_path)
    with pytest.raises(AdapterError, match="does not exist \\(a local model directory expected\\)"):
        load_model_shapes(tmp_path / "nope")
    with pytest.raises(AdapterError, match="config.json: is a file, not a local model directory"):
        load_model_shapes(tmp_path / "olmoe" / "config.json")
    with pytest.raises(AdapterError, match="model_type 'llama' is not served"):
        load_model_shapes(LlamaConfig())
