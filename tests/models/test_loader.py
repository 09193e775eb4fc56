"""Loading checkpoints: both expert layouts, sharded or not, give the same model; a checkpoint that
does not fit fails naming the tensor; dummy weights read nothing but config.json."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moelora.layers.norm import RMSNorm
from moelora.models.loader import ModelLoadError, load_model
from tests.support import batch_logits, extend_batch, toy_kv_cache
from tests.models.families import (FAMILIES, assert_logprobs_close, family_config, hf_logits, hf_model, per_expert_layout,
                                   write_sharded)


def _params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def _load(path, **kw):
    return load_model(path, **{"dtype": torch.float32, "device": "cpu", **kw})


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_and_per_expert_layouts_sharded(family, checkpoint, tmp_path):
    """transformers v5's fused experts and the hub's per-expert tensors, each sharded with an index
    json, load into the same parameters as the save_pretrained checkpoint."""
    config, state = family_config(family), hf_model(family_config(family)).state_dict()
    reference = _params(_load(checkpoint(family)))
    for layout, tensors in (("fused", state), ("per_expert", per_expert_layout(state, family == "mixtral"))):
        model = _load(write_sharded(tensors, config, tmp_path / layout))
        got = _params(model)
        assert got.keys() == reference.keys()
        for name, p in reference.items():
            assert torch.equal(got[name], p), f"{layout}: {name} differs"


@pytest.fixture
def broken(checkpoint, tmp_path):
    """A copy of a checkpoint (qwen3_moe unless named) whose tensors a test edits: broken(edit) -> directory."""
    def make(edit, family: str = "qwen3_moe") -> str:
        shutil.copytree(checkpoint(family), tmp_path, dirs_exist_ok=True)
        tensors = load_file(tmp_path / "model.safetensors")
        edit(tensors)
        save_file(tensors, tmp_path / "model.safetensors")
        return tmp_path
    return make


@pytest.mark.parametrize("name", ["model.layers.2.self_attn.k_proj.weight", "model.layers.2.mlp.experts.5.up_proj.weight",
                                  "model.norm.weight", "model.layers.1.mlp.down_proj.weight"])
def test_missing_tensor_is_named(broken, name):
    with pytest.raises(ModelLoadError, match=f"missing tensor {name.replace('.', '[.]')}"):
        _load(broken(lambda t: t.pop(name)))


def test_missing_experts_name_the_fused_tensor(broken):
    def drop_experts(t):
        for name in [n for n in t if n.startswith("model.layers.0.mlp.experts.")]:
            del t[name]
    with pytest.raises(ModelLoadError, match=r"missing tensor model[.]layers[.]0[.]mlp[.]experts[.]gate_up_proj"):
        _load(broken(drop_experts))


def test_unexpected_tensor_is_named(broken):
    def add(t):
        t["model.layers.0.mlp.experts.8.up_proj.weight"] = torch.zeros(24, 64)  # expert 8 of 8
        t["model.layers.1.self_attn.q_norm.bias"] = torch.zeros(16)
    with pytest.raises(ModelLoadError) as err:
        _load(broken(add))
    assert "unexpected tensor 'model.layers.0.mlp.experts.8.up_proj.weight'" in str(err.value)
    assert "unexpected tensor 'model.layers.1.self_attn.q_norm.bias'" in str(err.value)


def test_a_checkpoint_of_another_model_lists_its_first_problems(broken):
    """A quantized or foreign checkpoint has a problem per tensor: the message shows 20 and counts the rest."""
    def add(t):
        for i in range(25):
            t[f"model.layers.0.mlp.extra_{i:02d}.weight_scale_inv"] = torch.zeros(1)
    with pytest.raises(ModelLoadError) as err:
        _load(broken(add))
    lines = str(err.value).splitlines()
    assert "unexpected tensor 'model.layers.0.mlp.extra_19.weight_scale_inv'" in lines[20], lines
    assert lines[21:] == ["  and 5 more"], lines


def test_shape_mismatch_is_named(broken):
    def grow(t):
        t["model.layers.2.self_attn.v_proj.weight"] = torch.zeros(33, 64)
    with pytest.raises(ModelLoadError, match=r"'model.layers.2.self_attn.v_proj.weight' has shape \(33, 64\), expected \(32, 64\)"):
        _load(broken(grow))


def test_both_layouts_at_once_is_an_error(broken):
    def add_fused(t):
        t["model.layers.0.mlp.experts.down_proj"] = torch.zeros(8, 64, 24)
    with pytest.raises(ModelLoadError, match="model.layers.0.mlp.experts.down_proj' fills a part of model.layers.0.mlp.experts.w2"):
        _load(broken(add_fused))


def test_deepseek_v3_multi_token_prediction_layers_are_skipped(broken):
    """DeepSeek-V3 checkpoints carry MTP layers after the last decoder layer (here layer 3 of 3)."""
    def add_mtp(t):
        t["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
        t["model.layers.3.mlp.experts.0.up_proj.weight"] = torch.zeros(24, 64)
    _load(broken(add_mtp, "deepseek_v3"))


def test_tied_embeddings(tmp_path):
    config = family_config("qwen3_moe", tie_word_embeddings=True)
    hf = hf_model(config)
    hf.save_pretrained(tmp_path)
    model = _load(tmp_path)
    assert model.lm_head is None and not any("lm_head" in n for n in _params(model))
    seq = [3, 1, 4, 1, 5, 9, 2, 6]
    assert_logprobs_close(batch_logits(model, extend_batch(toy_kv_cache(model, 1, 8), [seq])), hf_logits(hf, [seq])[0], "tied")


def test_dummy_weights_read_only_config(checkpoint, tmp_path):
    shutil.copy(checkpoint("qwen3_moe") / "config.json", tmp_path)
    a, b = _load(tmp_path, load_format="dummy", seed=3), _load(tmp_path, load_format="dummy", seed=3)
    real = _params(_load(checkpoint("qwen3_moe")))
    for name, p in _params(a).items():
        assert p.shape == real[name].shape and torch.equal(p, _params(b)[name]), name
    norms = [m.weight for m in a.modules() if isinstance(m, RMSNorm)]
    assert norms and all((w == 1).all() for w in norms)
    assert 0.015 < a.model.layers[0].mlp.experts.w13.std().item() < 0.025


def test_bf16(checkpoint):
    model = _load(checkpoint("qwen3_moe"), dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    seq = [7, 7, 1, 2, 50]
    got = batch_logits(model, extend_batch(toy_kv_cache(model, 1, 8), [seq]))
    want = hf_logits(hf_model(family_config("qwen3_moe")), [seq])[0]
    assert_logprobs_close(got, want, "bf16", atol=0.15)
