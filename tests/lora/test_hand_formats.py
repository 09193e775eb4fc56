"""Formats PEFT 0.21 cannot write here, built by hand from their documented layouts (lora_builders' writers,
shared with the tensor-parallel test of these formats); each expected delta is computed from the file's tensors
with that tool's own formula, not with the loader."""
import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file

from lora_builders import (EXPERTS, HIDDEN, HandLoRA, assert_deltas_equal, canonical_deltas, fused_linears_lora,
                           peft_adapter, stacked_lora, target_parameters_lora, tiny_config, tiny_model, write_adapter)
from moelora.lora import AdapterError, load_adapter

R, ALPHA = 2, 6
EXPERTS_KEY = "base_model.model.model.layers.{}.mlp.experts"
TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _assert_loads_as_written(lora: HandLoRA, config, tmp_path) -> None:
    assert_deltas_equal(canonical_deltas(load_adapter(lora.write(tmp_path), config)), lora.deltas)


def test_target_parameters_peft_0_18_orientation(tmp_path):
    """PEFT 0.17-0.18: in/out taken from dims 1, 2 of the [E, out, in] parameter, so gate_up has
    A [E*r, 2I], B [H, E*r]; its delta is einsum('o r e, e r i -> e i o') (PEFT 0.18 get_delta_weight)."""
    config = tiny_config("olmoe")
    lora = target_parameters_lora(tiny_model(config), R, ALPHA, old_orientation=True, peft_version="0.18.0")
    _assert_loads_as_written(lora, config, tmp_path)


@pytest.mark.parametrize("params", [("down_proj",), ("gate_up_proj", "down_proj")])
def test_target_parameters_grouped_by_expert(params, tmp_path):
    """Older Unsloth: B's columns grouped by expert, read as (out, E, r); a lone wrapper and nested ones."""
    config = tiny_config("mixtral")
    _assert_loads_as_written(target_parameters_lora(tiny_model(config), R, ALPHA, params=params, grouped=True),
                             config, tmp_path)


@pytest.mark.parametrize("peft_version", ["0.21.2", "0.18.1", None, "main"])
def test_orientation_tie_broken_by_peft_version(peft_version, tmp_path):
    """hidden == 2 * intermediate: both orientations fit the shapes, peft_version decides (or it is an error: none,
    or one with no release number)."""
    config = tiny_config("qwen3_moe", moe_intermediate_size=HIDDEN // 2)
    lora = target_parameters_lora(tiny_model(config), R, ALPHA, params=("gate_up_proj",),
                                  old_orientation=peft_version == "0.18.1",
                                  **({"peft_version": peft_version} if peft_version else {}))
    if peft_version in (None, "main"):
        key = f"{EXPERTS_KEY.format(1)}.lora_A.weight"
        with pytest.raises(AdapterError, match=rf"{key}: .* fit both the peft >= 0.19.1 and the older orientation"):
            load_adapter(lora.write(tmp_path), config)
        return
    _assert_loads_as_written(lora, config, tmp_path)


@pytest.mark.parametrize("names", [("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"),
                                   ("gate_up_proj", None, "down_proj")])
@pytest.mark.parametrize("suffix", [".weight", ""])
def test_stacked_3d(names, suffix, tmp_path):
    """A [E, r, in], B [E, out, r] per projection; delta[e] = scaling * B[e] @ A[e]."""
    config = tiny_config("qwen2_moe")
    lora = stacked_lora(tiny_model(config), R, ALPHA, names=names, suffix=suffix)
    adapter = load_adapter(lora.write(tmp_path), config)
    assert adapter.formats == ("stacked-3d",)
    assert_deltas_equal(canonical_deltas(adapter), lora.deltas)


def test_stacked_shared_outer(tmp_path):
    """One side with E = 1 is shared by every expert: the input side of gate_up, the output side of down."""
    config = tiny_config("olmoe")
    lora = stacked_lora(tiny_model(config), R, ALPHA, suffix="", shared_outer=True)
    assert {t.shape[0] for k, t in lora.tensors.items() if "gate_up_proj.lora_A" in k or "down_proj.lora_B" in k} == {1}
    _assert_loads_as_written(lora, config, tmp_path)


def test_fused_qkv_and_dense_gate_up(tmp_path):
    """Fused qkv_proj / gate_up_proj linears split into their parts, each with the shared A."""
    config = tiny_config("qwen3_moe")  # layer 0 is dense; q 16, k 8, v 8 outputs
    lora = fused_linears_lora(tiny_model(config), R, ALPHA)
    assert sorted(lora.tensors) == sorted(f"base_model.model.model.layers.{layer}.{m}.lora_{s}.weight"
                                          for layer, m in ((0, "self_attn.qkv_proj"), (1, "self_attn.qkv_proj"),
                                                           (0, "mlp.gate_up_proj")) for s in "AB")
    assert [lora.deltas[f"model.layers.0.self_attn.{p}_proj.weight"].shape[0] for p in "qkv"] == [16, 8, 8]
    _assert_loads_as_written(lora, config, tmp_path)


def test_same_adapter_in_two_formats(tmp_path):
    """A PEFT target_parameters adapter rewritten as per-expert modules gives the same canonical adapter."""
    config = tiny_config("qwen3_moe")
    fused_dir, per_expert_dir = tmp_path / "fused", tmp_path / "per_expert"
    peft_adapter(tiny_model(config), LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["v_proj"], target_parameters=TARGETS), fused_dir)
    tensors = {}
    for key, t in load_file(fused_dir / "adapter_model.safetensors").items():
        if ".experts." not in key:
            tensors[key] = t
            continue
        prefix, wrapper = key.split(".experts.")[0], key.split(".experts.")[1]
        side = "lora_A" if "lora_A" in wrapper else "lora_B"
        for e in range(EXPERTS):  # PEFT's layout: A rows (E, r), B columns (r, E)
            part = t.reshape(EXPERTS, R, -1)[e] if side == "lora_A" else t.reshape(-1, R, EXPERTS)[:, :, e]
            if "base_layer" not in wrapper:
                tensors[f"{prefix}.experts.{e}.down_proj.{side}.weight"] = part
            elif side == "lora_A":
                tensors[f"{prefix}.experts.{e}.gate_proj.lora_A.weight"] = tensors[f"{prefix}.experts.{e}.up_proj.lora_A.weight"] = part
            else:
                tensors[f"{prefix}.experts.{e}.gate_proj.lora_B.weight"], tensors[f"{prefix}.experts.{e}.up_proj.lora_B.weight"] = part.chunk(2)
    write_adapter(per_expert_dir, tensors, r=R, lora_alpha=ALPHA, target_modules=["v_proj", "gate_proj", "up_proj", "down_proj"])
    fused, per_expert = load_adapter(fused_dir, config), load_adapter(per_expert_dir, config)
    assert (fused.formats, per_expert.formats) == (("target-parameters",), ("expert-modules",))
    assert fused.layers.keys() == per_expert.layers.keys()
    for layer, lora in fused.layers.items():
        other = per_expert.layers[layer]
        assert lora.modules.keys() == other.modules.keys() and lora.experts.keys() == other.experts.keys()
        for name, m in lora.modules.items():
            assert torch.equal(m.a, other.modules[name].a) and torch.equal(m.b, other.modules[name].b)
        for name, x in lora.experts.items():
            y = other.experts[name]
            assert torch.equal(x.a, y.a) and torch.equal(x.b, y.b) and torch.equal(x.ranks, y.ranks)
