"""Formats PEFT 0.21 cannot write here, built by hand from their documented layouts; each expected
delta is computed from the file's tensors with that tool's own formula, not with the loader."""
import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file

from lora_builders import (EXPERTS, HIDDEN, MOE_INTER, assert_deltas_equal, canonical_deltas, peft_adapter,
                           tiny_config, tiny_model, write_adapter)
from moelora.lora import AdapterError, load_adapter

R, ALPHA = 2, 6
SCALING = ALPHA / R
EXPERTS_KEY = "base_model.model.model.layers.{}.mlp.experts"
TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + sum(shape)))


def test_target_parameters_peft_0_18_orientation(tmp_path):
    """PEFT 0.17-0.18: in/out taken from dims 1, 2 of the [E, out, in] parameter, so gate_up has
    A [E*r, 2I], B [H, E*r]; its delta is einsum('o r e, e r i -> e i o') (PEFT 0.18 get_delta_weight)."""
    tensors, expected = {}, {}
    for layer in (0, 1):
        for wrapper, param, (d1, d2) in (("base_layer.", "gate_up_proj", (2 * MOE_INTER, HIDDEN)), ("", "down_proj", (HIDDEN, MOE_INTER))):
            a, b = rand(EXPERTS * R, d1, seed=layer), rand(d2, EXPERTS * R, seed=layer)
            tensors[f"{EXPERTS_KEY.format(layer)}.{wrapper}lora_A.weight"] = a
            tensors[f"{EXPERTS_KEY.format(layer)}.{wrapper}lora_B.weight"] = b
            expected[f"model.layers.{layer}.mlp.experts.{param}"] = SCALING * torch.einsum(
                "ore,eri->eio", b.reshape(d2, R, EXPERTS), a.reshape(EXPERTS, R, d1))
    write_adapter(tmp_path, tensors, r=R, lora_alpha=ALPHA, target_parameters=TARGETS, peft_version="0.18.0")
    assert_deltas_equal(canonical_deltas(load_adapter(tmp_path, tiny_config("olmoe"))), expected)


def test_target_parameters_grouped_by_expert(tmp_path):
    """Older Unsloth: B's columns grouped by expert, read as (out, E, r)."""
    a, b = rand(EXPERTS * R, MOE_INTER), rand(HIDDEN, EXPERTS * R)
    write_adapter(tmp_path, {f"{EXPERTS_KEY.format(0)}.lora_A.weight": a, f"{EXPERTS_KEY.format(0)}.lora_B.weight": b},
                  r=R, lora_alpha=ALPHA, target_parameters=["mlp.experts.down_proj"], lora_B_layout="grouped_by_expert")
    expected = SCALING * torch.einsum("oer,eri->eoi", b.reshape(HIDDEN, EXPERTS, R), a.reshape(EXPERTS, R, MOE_INTER))
    adapter = load_adapter(tmp_path, tiny_config("mixtral"))
    assert_deltas_equal(canonical_deltas(adapter), {"model.layers.0.mlp.experts.down_proj": expected})


@pytest.mark.parametrize("peft_version", ["0.21.2", "0.18.1", None])
def test_orientation_tie_broken_by_peft_version(peft_version, tmp_path):
    """hidden == 2 * intermediate: both orientations fit the shapes, peft_version decides (or it is an error)."""
    config = tiny_config("qwen3_moe")
    config.moe_intermediate_size = HIDDEN // 2
    a, b = rand(EXPERTS * R, HIDDEN), rand(HIDDEN, EXPERTS * R)
    key = f"{EXPERTS_KEY.format(1)}.lora_A.weight"
    write_adapter(tmp_path, {key: a, key.replace("lora_A", "lora_B"): b}, r=R, lora_alpha=ALPHA,
                  target_parameters=["mlp.experts.gate_up_proj"], **({"peft_version": peft_version} if peft_version else {}))
    if peft_version is None:
        with pytest.raises(AdapterError, match=rf"{key}: .* fit both the peft >= 0.19.1 and the older orientation"):
            load_adapter(tmp_path, config)
        return
    pattern = "ore,eri->eoi" if peft_version == "0.21.2" else "ore,eri->eio"
    expected = SCALING * torch.einsum(pattern, b.reshape(HIDDEN, R, EXPERTS), a.reshape(EXPERTS, R, HIDDEN))
    assert_deltas_equal(canonical_deltas(load_adapter(tmp_path, config)), {"model.layers.1.mlp.experts.gate_up_proj": expected})


@pytest.mark.parametrize("names", [("w1", "w3", "w2"), ("gate_up_proj", None, "down_proj")])
@pytest.mark.parametrize("suffix", [".weight", ""])
def test_stacked_3d(names, suffix, tmp_path):
    """A [E, r, in], B [E, out, r] per projection; delta[e] = scaling * B[e] @ A[e]."""
    gate, up, down = names
    shapes = {gate: (HIDDEN, MOE_INTER * (1 if up else 2)), down: (MOE_INTER, HIDDEN)}
    if up:
        shapes[up] = (HIDDEN, MOE_INTER)
    tensors, deltas = {}, {}
    for name, (d_in, d_out) in shapes.items():
        a, b = rand(EXPERTS, R, d_in), rand(EXPERTS, d_out, R)
        tensors[f"{EXPERTS_KEY.format(1)}.{name}.lora_A{suffix}"] = a
        tensors[f"{EXPERTS_KEY.format(1)}.{name}.lora_B{suffix}"] = b
        deltas[name] = SCALING * b @ a
    write_adapter(tmp_path, tensors, r=R, lora_alpha=ALPHA)
    gate_up = torch.cat([deltas[gate], deltas[up]], dim=1) if up else deltas[gate]
    adapter = load_adapter(tmp_path, tiny_config("qwen2_moe"))
    assert adapter.formats == ("stacked-3d",)
    assert_deltas_equal(canonical_deltas(adapter), {"model.layers.1.mlp.experts.gate_up_proj": gate_up,
                                                    "model.layers.1.mlp.experts.down_proj": deltas[down]})


def test_stacked_shared_outer(tmp_path):
    """One side with E = 1 is shared by every expert: the input side of gate_up, the output side of down."""
    a_gu, b_gu = rand(1, R, HIDDEN), rand(EXPERTS, 2 * MOE_INTER, R)
    a_d, b_d = rand(EXPERTS, R, MOE_INTER), rand(1, HIDDEN, R)
    key = EXPERTS_KEY.format(0)
    write_adapter(tmp_path, {f"{key}.gate_up_proj.lora_A": a_gu, f"{key}.gate_up_proj.lora_B": b_gu,
                             f"{key}.down_proj.lora_A": a_d, f"{key}.down_proj.lora_B": b_d}, r=R, lora_alpha=ALPHA)
    expected = {"model.layers.0.mlp.experts.gate_up_proj": SCALING * torch.einsum("eor,ri->eoi", b_gu, a_gu[0]),
                "model.layers.0.mlp.experts.down_proj": SCALING * torch.einsum("or,eri->eoi", b_d[0], a_d)}
    assert_deltas_equal(canonical_deltas(load_adapter(tmp_path, tiny_config("olmoe"))), expected)


def test_fused_qkv_and_dense_gate_up(tmp_path):
    """Fused qkv_proj / gate_up_proj linears split into their parts, each with the shared A."""
    config = tiny_config("qwen3_moe")  # layer 0 is dense; q 16, k 8, v 8 outputs
    a_qkv, b_qkv = rand(R, HIDDEN), rand(32, R)
    a_gu, b_gu = rand(R, HIDDEN), rand(2 * config.intermediate_size, R)
    prefix = "base_model.model.model.layers.0"
    write_adapter(tmp_path, {f"{prefix}.self_attn.qkv_proj.lora_A.weight": a_qkv, f"{prefix}.self_attn.qkv_proj.lora_B.weight": b_qkv,
                             f"{prefix}.mlp.gate_up_proj.lora_A.weight": a_gu, f"{prefix}.mlp.gate_up_proj.lora_B.weight": b_gu},
                  r=R, lora_alpha=ALPHA)
    q, k, v = (SCALING * b_qkv @ a_qkv).split([16, 8, 8])
    gate, up = (SCALING * b_gu @ a_gu).chunk(2)
    expected = {f"model.layers.0.{n}.weight": d for n, d in (("self_attn.q_proj", q), ("self_attn.k_proj", k),
                ("self_attn.v_proj", v), ("mlp.gate_proj", gate), ("mlp.up_proj", up))}
    assert_deltas_equal(canonical_deltas(load_adapter(tmp_path, config)), expected)


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
