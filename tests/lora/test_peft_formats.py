"""Adapters written by PEFT itself: the canonical adapter's delta of every weight must equal what
PEFT's merge_and_unload() adds to that weight, in every supported model family."""
import pytest
import torch
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file

from lora_builders import (EXPERTS, FAMILIES, PerExpertModel, assert_deltas_equal, canonical_deltas, edit_config,
                           linear_suffixes, peft_adapter, peft_loaded_deltas, per_expert_deltas_as_v5, tiny_config,
                           tiny_model)
from moelora.lora import AdapterError, load_adapter

EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.parametrize("family", FAMILIES)
def test_target_parameters_and_modules_every_family(family, tmp_path):
    """Every linear of the decoder layers (attention incl. MLA, dense MLPs, shared experts) via
    target_modules; fused experts and the router via target_parameters."""
    config = tiny_config(family)
    model = tiny_model(config)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=linear_suffixes(model),
                      target_parameters=[*EXPERT_PARAMS, "mlp.gate.weight"])
    expected = peft_adapter(model, lora, tmp_path)
    adapter = load_adapter(tmp_path, config)
    assert adapter.formats == ("target-parameters",)
    assert_deltas_equal(canonical_deltas(adapter), expected)
    for layer in adapter.layers.values():
        for experts in layer.experts.values():  # gate_up may have r=8: PEFT fuses v4 gate_proj/up_proj targets
            assert experts.covered.all() and (experts.ranks == experts.rank).all()


def test_rank_alpha_patterns_and_rslora(tmp_path):
    """Patterns match module paths and parameter paths with PEFT's regex semantics; rslora scales by alpha/sqrt(r)."""
    config = tiny_config("qwen3_moe")
    lora = LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "o_proj", "k_proj"],
                      target_parameters=EXPERT_PARAMS,
                      rank_pattern={"experts.down_proj": 2, r"layers\.1\.self_attn\.q_proj": 6},
                      alpha_pattern={"experts.gate_up_proj": 3, "o_proj": 5})
    expected = peft_adapter(tiny_model(config), lora, tmp_path)
    adapter = load_adapter(tmp_path, config)
    assert_deltas_equal(canonical_deltas(adapter), expected)
    layer1 = adapter.layers[1]
    assert layer1.experts["down"].rank == 2 and layer1.experts["gate"].rank == 4
    assert layer1.modules["self_attn.q_proj"].rank == 6 and adapter.layers[0].modules["self_attn.q_proj"].rank == 4
    assert layer1.experts["gate"].scaling[0].item() == pytest.approx(3 / 2)      # alpha 3 / sqrt(4)
    assert layer1.modules["self_attn.o_proj"].scaling == pytest.approx(5 / 2)


@pytest.mark.parametrize("drop", [("r",), ("lora_alpha",), ("r", "lora_alpha")])
def test_config_without_r_or_lora_alpha_takes_peft_defaults(drop, tmp_path):
    """A field adapter_config.json does not have is LoraConfig's default, r=8 and lora_alpha=8, as when PEFT loads
    it: without lora_alpha an r=4 adapter scales by 8/4, not by 1 (alpha = r) or its training's 32/4."""
    config = tiny_config("qwen3_moe")
    r = 8 if "r" in drop else 4
    peft_adapter(tiny_model(config), LoraConfig(r=r, lora_alpha=32, target_modules=["q_proj"],
                                                target_parameters=EXPERT_PARAMS), tmp_path)
    edit_config(tmp_path, drop=drop)
    adapter = load_adapter(tmp_path, config)
    assert_deltas_equal(canonical_deltas(adapter), peft_loaded_deltas(config, tmp_path))
    assert (adapter.config.r, adapter.config.lora_alpha) == (r, 8 if "lora_alpha" in drop else 32)


def test_router_patterns_match_the_parameter_path(tmp_path):
    """A router LoRA from target_parameters=['mlp.gate.weight']: PEFT matches patterns against
    'model.layers.L.mlp.gate.weight', not the module path."""
    config = tiny_config("olmoe")
    lora = LoraConfig(r=4, lora_alpha=8, target_parameters=["mlp.gate.weight"], rank_pattern={"gate.weight": 2},
                      alpha_pattern={r"layers\.1\.mlp\.gate\.weight": 3})
    expected = peft_adapter(tiny_model(config), lora, tmp_path)
    adapter = load_adapter(tmp_path, config)
    assert_deltas_equal(canonical_deltas(adapter), expected)
    assert [adapter.layers[i].modules["mlp.gate"].scaling for i in (0, 1)] == [4.0, 1.5]


@pytest.mark.parametrize("target", EXPERT_PARAMS)
def test_lone_target_parameter(target, tmp_path):
    """With one expert parameter targeted, `experts.lora_*` is that parameter (gate_up or down)."""
    config = tiny_config("olmoe")
    expected = peft_adapter(tiny_model(config), LoraConfig(r=3, lora_alpha=5, target_parameters=[target]), tmp_path)
    adapter = load_adapter(tmp_path, config)
    assert_deltas_equal(canonical_deltas(adapter), expected)
    assert set(adapter.layers[0].experts) == ({"down"} if "down" in target else {"gate", "up"})


def test_pytorch_bin_and_bf16(tmp_path):
    """adapter_model.bin is read with weights_only; bf16 stays bf16 with scaling folded into B."""
    config = tiny_config("mixtral")
    model = tiny_model(config).to(torch.bfloat16)
    expected = peft_adapter(model, LoraConfig(r=4, lora_alpha=16, target_modules=["k_proj"], target_parameters=EXPERT_PARAMS),
                            tmp_path, safe_serialization=False)
    assert (tmp_path / "adapter_model.bin").is_file()
    adapter = load_adapter(tmp_path, config)
    assert adapter.layers[0].experts["gate"].b.dtype == torch.bfloat16
    got = canonical_deltas(adapter)
    for name, want in expected.items():  # merged - base is rounded to bf16 twice
        torch.testing.assert_close(got[name], want.float(), atol=0.05 * want.abs().max().item(), rtol=0.02)


@pytest.mark.parametrize("mixtral_names", [False, True])
def test_per_expert_modules(mixtral_names, tmp_path):
    """transformers v4 layout: PEFT target_modules on one nn.Linear per expert
    (`mlp.experts.<e>.gate_proj`, or Mixtral's `block_sparse_moe.experts.<e>.w1/w3/w2`) and the router."""
    config = tiny_config("mixtral" if mixtral_names else "qwen2_moe")
    per_expert = PerExpertModel(tiny_model(config), mixtral_names)
    names = ["w1", "w2", "w3"] if mixtral_names else ["gate_proj", "up_proj", "down_proj", "shared_expert_gate"]
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=[*names, "gate", "q_proj"], rank_pattern={"experts.1.w2": 2})
    expected = per_expert_deltas_as_v5(peft_adapter(per_expert, lora, tmp_path), mixtral_names)
    adapter = load_adapter(tmp_path, config)
    assert adapter.formats == ("expert-modules",)
    assert_deltas_equal(canonical_deltas(adapter), expected)
    down = adapter.layers[1].experts["down"]
    assert down.ranks.tolist() == ([4, 2, 4, 4] if mixtral_names else [4] * EXPERTS)


def test_per_expert_modules_partial_coverage(tmp_path):
    """Experts the adapter does not name are not covered: rank 0, zero A and B."""
    config = tiny_config("qwen3_moe")
    per_expert = PerExpertModel(tiny_model(config))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=r".*layers\.1\.mlp\.experts\.[13]\.(gate|up|down)_proj")
    expected = peft_adapter(per_expert, lora, tmp_path)
    adapter = load_adapter(tmp_path, config)
    for projection, name in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        experts = adapter.layers[1].experts[projection]
        assert experts.covered.tolist() == [False, True, False, True]
        assert experts.ranks.tolist() == [0, 4, 0, 4]
        for e in range(EXPERTS):
            want = expected.get(f"model.layers.1.mlp.experts.{e}.{name}.weight", torch.zeros(experts.b.shape[1], experts.a.shape[2]))
            torch.testing.assert_close(experts.delta(e), want, atol=1e-5, rtol=1e-5)
    assert set(adapter.layers) == {1}


def test_pissa_adapter_is_refused(tmp_path):
    """PEFT saves a PiSSA adapter as it was trained, against the base weights less their initial principal
    components, and PeftModel.from_pretrained takes those out of the base model again: its delta is not the
    adapter's B @ A, so serving it as plain LoRA on the unchanged base model would be wrong."""
    config = tiny_config("qwen3_moe")
    peft_adapter(tiny_model(config), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights="pissa"),
                 tmp_path)
    base = tiny_model(config)
    before = base.model.layers[0].self_attn.q_proj.weight.detach().clone()
    peft_delta = PeftModel.from_pretrained(base, tmp_path).merge_and_unload().model.layers[0].self_attn.q_proj.weight - before
    plain = load_file(tmp_path / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    plain_delta = 4 / 2 * plain[key.format("B")] @ plain[key.format("A")]
    assert (peft_delta - plain_delta).abs().max() > 1e-2
    with pytest.raises(AdapterError, match="init_lora_weights='pissa' \\(PiSSA changes the base model's weights"):
        load_adapter(tmp_path, config)


@pytest.mark.parametrize("bias", ["lora_only", "all"])
def test_trained_base_biases_are_refused(bias, tmp_path):
    """PEFT's bias='lora_only' / 'all' trains the base model's biases and saves them with the adapter
    ('q_proj.base_layer.bias', 'k_proj.bias'): each is refused, saying what it is."""
    config = tiny_config("qwen2_moe")  # q, k and v have biases
    peft_adapter(tiny_model(config), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], bias=bias), tmp_path)
    biases = sorted(k for k in load_file(tmp_path / "adapter_model.safetensors") if k.endswith(".bias"))
    assert len(biases) == (2 if bias == "lora_only" else 6)
    with pytest.raises(AdapterError) as e:
        load_adapter(tmp_path, config)
    assert e.value.problems == [f"{k}: a bias of the base model, trained with adapter_config.json's bias='lora_only' "
                                "or 'all' (only the LoRA weights are served)" for k in biases]


def test_fan_in_fan_out_is_served(tmp_path):
    """fan_in_fan_out describes the base weight's layout (GPT-2's Conv1D), not LoRA's: PEFT resets it to false on
    nn.Linear layers (and saves it so), and loads the adapter as plain LoRA."""
    config = tiny_config("qwen3_moe")
    peft_adapter(tiny_model(config),
                 LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERT_PARAMS), tmp_path)
    edit_config(tmp_path, fan_in_fan_out=True)
    assert_deltas_equal(canonical_deltas(load_adapter(tmp_path, config)), peft_loaded_deltas(config, tmp_path))


@pytest.mark.parametrize("variant", [dict(velora_config={}), dict(monteclora_config={})])
def test_variants_that_only_change_training_are_served(variant, tmp_path):
    """VeLoRA (a compressed backward pass) and MonteCLoRA (lora_A perturbed by a sampler in training mode) compute
    plain LoRA at inference: a module of PEFT's loaded model gives what it gives merged. Their training state saved
    with the adapter (lora_velora_embed, lora_monteclora_sampler.*) is left out."""
    from peft import PeftModel

    config = tiny_config("qwen3_moe")
    peft_adapter(tiny_model(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], **variant),
                 tmp_path)
    q_proj = PeftModel.from_pretrained(tiny_model(config), tmp_path).get_base_model().model.layers[0].self_attn.q_proj
    x = torch.randn(5, q_proj.in_features)
    with torch.no_grad():
        unmerged = q_proj(x)
        q_proj.merge()
        torch.testing.assert_close(q_proj(x), unmerged, atol=1e-5, rtol=1e-5)
    assert any(k.endswith(("lora_velora_embed", "lora_monteclora_sampler.std_prior"))
               for k in load_file(tmp_path / "adapter_model.safetensors"))
    assert_deltas_equal(canonical_deltas(load_adapter(tmp_path, config)), peft_loaded_deltas(config, tmp_path))


@pytest.mark.parametrize("variant, field", [
    (dict(use_bdlora={"target_modules_bd_a": ["q_proj"], "nblocks": 2}), "use_bdlora"),
    (dict(kasa_config={}), "kasa_config"),
    (dict(use_dora=True), "use_dora"),
])
def test_lora_variants_are_refused(variant, field, tmp_path):
    """PEFT's variants that compute more than scaling * B @ A (BD-LoRA's lora_A is stored as its diagonal blocks,
    KaSA's delta is B @ diag(lora_diag) @ A on truncated base weights, DoRA's is rescaled per column) are refused by
    the config field that turns them on."""
    config = tiny_config("qwen3_moe")
    peft_adapter(tiny_model(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], **variant), tmp_path)
    with pytest.raises(AdapterError, match=f"adapter_config.json: not served: {field}"):
        load_adapter(tmp_path, config)
