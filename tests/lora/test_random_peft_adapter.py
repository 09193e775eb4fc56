"""write_random_peft_adapter writes what PEFT itself would save for a model it never builds: PEFT
loads every tensor back, and load_adapter finds every layer's attention and experts at its rank."""
import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file

from moelora.lora import load_adapter
from tests.support import ATTENTION_MODULES, qwen3_30b_a3b_config, tiny_model, write_random_peft_adapter


def test_random_adapter_is_read_by_peft_and_by_load_adapter(tmp_path):
    config = qwen3_30b_a3b_config(tiny=True)
    path = write_random_peft_adapter(config, tmp_path / "adapter", rank=4, seed=0)
    written = load_file(path / "adapter_model.safetensors")

    peft_model = PeftModel.from_pretrained(tiny_model(config), path)
    loaded = get_peft_model_state_dict(peft_model)
    assert loaded.keys() == written.keys()
    assert all(torch.equal(loaded[k].to(torch.bfloat16), written[k]) for k in written)

    adapter = load_adapter(path, config, max_lora_rank=4)
    assert sorted(adapter.layers) == list(range(config.num_hidden_layers))
    for layer in adapter.layers.values():
        assert set(layer.modules) == {f"self_attn.{m}" for m in ATTENTION_MODULES}
        assert set(layer.experts) == {"gate", "up", "down"}
        assert all(bool((e.ranks == 4).all()) for e in layer.experts.values())
