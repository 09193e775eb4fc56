"""Every broken or unsupported adapter is refused with a message naming the offending tensor (or
config field) and what was expected; nothing is dropped silently."""
import json
import re
import time

import pytest
import torch

from lora_builders import EXPERTS, HIDDEN, MOE_INTER, tiny_config, write_adapter
from moelora.lora import AdapterError, config, errors, load_adapter
from moelora.lora import adapter as adapter_module
from moelora.lora.config import AdapterConfig

LAYER1 = "base_model.model.model.layers.1"
Q_A, Q_B = f"{LAYER1}.self_attn.q_proj.lora_A.weight", f"{LAYER1}.self_attn.q_proj.lora_B.weight"
R = 8  # write_adapter's default r


def good() -> dict[str, torch.Tensor]:
    """A valid adapter: q_proj of layer 1 and expert 2's gate of layer 1 (qwen3_moe tiny: q is 16 -> 16)."""
    return {Q_A: torch.randn(R, HIDDEN), Q_B: torch.randn(16, R),
            f"{LAYER1}.mlp.experts.2.gate_proj.lora_A.weight": torch.randn(R, HIDDEN),
            f"{LAYER1}.mlp.experts.2.gate_proj.lora_B.weight": torch.randn(MOE_INTER, R)}


def refused(tmp_path, tensors, max_lora_rank=None, **config) -> str:
    write_adapter(tmp_path, tensors, **config)
    with pytest.raises(AdapterError) as e:
        load_adapter(tmp_path, tiny_config("qwen3_moe"), max_lora_rank=max_lora_rank)
    return str(e.value)


def test_good_adapter_loads(tmp_path):
    adapter = load_adapter(write_adapter(tmp_path, good()), tiny_config("qwen3_moe"), max_lora_rank=R)
    assert adapter.layers[1].experts["gate"].ranks.tolist() == [0, 0, R, 0]


EXPERT_B = f"{LAYER1}.mlp.experts.2.gate_proj.lora_B.weight"


@pytest.mark.parametrize("key, shape, expected", [
    (Q_B, (17, R), r"B \(17, 8\) does not fit self_attn.q_proj \(expected A \[r, 16\], B \[16, r\]; A \(8, 16\) fits\)"),
    (Q_A, (R, 15), r"A \(8, 15\) does not fit self_attn.q_proj .*; B \(16, 8\) fits\)"),
    (Q_B, (16, R + 1), r"B \(16, 9\) has rank 9 but its lora_A A \(8, 16\) has rank 8"),
    (EXPERT_B, (2 * MOE_INTER, R), r"B \(12, 8\) does not fit expert gate \(expected A \[r, 16\], B \[6, r\]; A \(8, 16\) fits\)"),
    (EXPERT_B, (MOE_INTER, R, 1), r"B \(6, 8, 1\) does not fit expert gate"),
])
def test_shape_mismatch_names_the_tensor_at_fault(tmp_path, key, shape, expected):
    tensors = good() | {key: torch.randn(*shape)}
    message = refused(tmp_path, tensors)
    assert re.search(re.escape(key) + ": " + expected, message), message
    other = key.replace("lora_B", "lora_A") if "lora_B" in key else key.replace("lora_A", "lora_B")
    assert not re.search(re.escape(other) + ":", message), "the tensor that fits is not blamed"


def test_both_halves_wrong_names_both(tmp_path):
    message = refused(tmp_path, good() | {Q_A: torch.randn(R, 15), Q_B: torch.randn(17, R)})
    assert f"{Q_A}, {Q_B}: A (8, 15) / B (17, 8) do not fit self_attn.q_proj" in message


def test_target_parameters_shape_mismatch(tmp_path):
    key = f"{LAYER1}.mlp.experts.lora_A.weight"
    message = refused(tmp_path, {key: torch.randn(EXPERTS * 2, HIDDEN + 1), key.replace("lora_A", "lora_B"): torch.randn(HIDDEN, EXPERTS * 2)},
                      r=2, target_parameters=["mlp.experts.down_proj"])
    assert (f"{key}: A (8, 17) does not fit a target_parameters LoRA of 4 experts (expected down_proj A [4*r, 6], "
            "B [16, 4*r], or in/out swapped as peft < 0.19.1 wrote; B (16, 8) fits)") in message


def test_stacked_shape_mismatch(tmp_path):
    key = f"{LAYER1}.mlp.experts.w2.lora_A"
    message = refused(tmp_path, {key: torch.randn(3, R, MOE_INTER), key.replace("lora_A", "lora_B"): torch.randn(EXPERTS, HIDDEN, R)})
    assert (f"{key}: A (3, 8, 6) does not fit stacked experts down (expected A [4 or 1, r, 6], B [4 or 1, 16, r]; "
            "B (4, 16, 8) fits)") in message


@pytest.mark.parametrize("drop", [Q_A, Q_B])
def test_a_without_b(tmp_path, drop):
    tensors = good()
    del tensors[drop]
    kept = Q_B if drop == Q_A else Q_A
    assert f"{kept}: has no matching {'lora_A' if drop == Q_A else 'lora_B'}" in refused(tmp_path, tensors)


def test_layer_out_of_range(tmp_path):
    key = Q_A.replace("layers.1", "layers.2")
    tensors = good() | {key: torch.randn(R, HIDDEN), key.replace("lora_A", "lora_B"): torch.randn(16, R)}
    assert f"{key}: layer 2 out of range (the model has 2 layers)" in refused(tmp_path, tensors)


def test_expert_out_of_range(tmp_path):
    key = f"{LAYER1}.mlp.experts.{EXPERTS}.down_proj.lora_A.weight"
    tensors = good() | {key: torch.randn(R, MOE_INTER), key.replace("lora_A", "lora_B"): torch.randn(HIDDEN, R)}
    assert f"{key}: expert {EXPERTS} out of range (the model has {EXPERTS} experts)" in refused(tmp_path, tensors)


def test_experts_on_a_dense_layer(tmp_path):
    key = "base_model.model.model.layers.0.mlp.experts.0.up_proj.lora_A.weight"
    tensors = good() | {key: torch.randn(R, HIDDEN), key.replace("lora_A", "lora_B"): torch.randn(MOE_INTER, R)}
    assert f"{key}: layer 0 of this qwen3_moe model has no routed experts (MoE layers: 1)" in refused(tmp_path, tensors)


def test_module_the_layer_does_not_have(tmp_path):
    key = f"{LAYER1}.mlp.gate_proj.lora_A.weight"  # layer 1 is MoE: no dense MLP
    tensors = good() | {key: torch.randn(R, HIDDEN), key.replace("lora_A", "lora_B"): torch.randn(20, R)}
    assert f"{key}: layer 1 of this qwen3_moe model has no module 'mlp.gate_proj'" in refused(tmp_path, tensors)


def test_rank_above_max_lora_rank(tmp_path):
    message = refused(tmp_path, good(), max_lora_rank=4)
    assert f"{Q_A}: rank 8 is above the engine's max_lora_rank=4" in message
    assert "experts.2.gate_proj.lora_A.weight: rank 8 is above" in message


def test_rank_differs_from_config(tmp_path):
    message = refused(tmp_path, good(), rank_pattern={"q_proj": 4})
    assert f"{Q_A}: rank 8, but adapter_config.json gives r=4 for model.layers.1.self_attn.q_proj" in message


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_inf(tmp_path, bad):
    tensors = good()
    tensors[Q_B][3, 1] = bad
    message = refused(tmp_path, tensors)
    assert f"{Q_B}: contains 1 NaN/Inf values" in message
    assert "has no matching" not in message, "its lora_A is not blamed for the refused lora_B"
    assert message.count("\n  - ") == 1


@pytest.mark.parametrize("dtype", [torch.int64, torch.float8_e4m3fn])
def test_tensor_of_a_dtype_lora_is_not_saved_in(tmp_path, dtype):
    message = refused(tmp_path, good() | {Q_A: torch.ones(R, HIDDEN).to(dtype)})
    assert f"{Q_A}: dtype {dtype}, expected a floating point tensor of float16, bfloat16, float32, float64" in message


def test_bin_of_sparse_tensors_or_keys_that_are_not_names(tmp_path):
    write_adapter(tmp_path, good())
    (tmp_path / "adapter_model.safetensors").unlink()
    torch.save(good() | {Q_A: torch.randn(R, HIDDEN).to_sparse()}, tmp_path / "adapter_model.bin")
    with pytest.raises(AdapterError, match=f"{Q_A}: layout torch.sparse_coo, expected a dense tensor"):
        load_adapter(tmp_path, tiny_config("qwen3_moe"))
    torch.save(good() | {7: torch.randn(R, HIDDEN)}, tmp_path / "adapter_model.bin")
    with pytest.raises(AdapterError, match="adapter_model.bin: expected a dict of tensors by name"):
        load_adapter(tmp_path, tiny_config("qwen3_moe"))


def test_scaling_that_overflows_the_files_dtype(tmp_path):
    """The scaling is folded into B in B's dtype: where that overflows (float16 up to 65504) the adapter is refused
    with the tensor named, not served with Inf weights."""
    tensors = {k: v.half() for k, v in good().items()}
    tensors[Q_B][0, 0] = 30.0
    message = refused(tmp_path, tensors, r=R, lora_alpha=4000 * R)
    assert f"{Q_B}: times its scaling 4000 (lora_alpha / r) it reaches 1.2e+05, past torch.float16's largest value" \
        in message


@pytest.mark.parametrize("key, reason", [
    (f"{LAYER1}.self_attn.q_proj.weight", "unknown key"),
    (f"{LAYER1}.self_attn.q_proj.lora_A.default.weight", "unknown key"),
    (f"{LAYER1}.self_attn.q_proj.lora_magnitude_vector", "DoRA magnitude vector"),
    (f"{LAYER1}.self_attn.q_proj.lora_diag", "KaSA singular-value diagonal"),
    (f"{LAYER1}.self_attn.q_proj.lora_B.bias", "lora_bias"),
    ("base_model.model.model.embed_tokens.weight", "modules_to_save"),
    ("base_model.model.lm_head.weight", "modules_to_save"),
    ("base_model.model.model.embed_tokens.lora_embedding_A", "LoRA on an embedding"),
    ("base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta", "trainable/added tokens"),
])
def test_unknown_and_refused_keys(tmp_path, key, reason):
    message = refused(tmp_path, good() | {key: torch.randn(16)})
    assert f"{key}: " in message and reason in message


@pytest.mark.parametrize("module", ["lm_head", "model.vision_tower.encoder.layers.1.self_attn.q_proj",
                                    "model.visual.layers.1.self_attn.q_proj", "model.mtp.layers.1.self_attn.q_proj"])
def test_module_outside_decoder_layers(tmp_path, module):
    """Another tower's layers.N is no decoder layer, even where its shapes fit one."""
    key = f"base_model.model.{module}.lora_A.weight"
    tensors = good() | {key: torch.randn(R, HIDDEN), key.replace("lora_A", "lora_B"): torch.randn(16, R)}
    assert f"{key}: not inside a decoder layer" in refused(tmp_path, tensors)


@pytest.mark.parametrize("prefix", ["base_model.model.model.language_model.", "base_model.model.",
                                    "base_model.model.language_model.model."])
def test_decoder_layers_under_the_names_transformers_gives_them(tmp_path, prefix):
    tensors = {k.replace("base_model.model.model.", prefix): v for k, v in good().items()}
    adapter = load_adapter(write_adapter(tmp_path, tensors), tiny_config("qwen3_moe"))
    assert adapter.layers[1].modules["self_attn.q_proj"].rank == R and "gate" in adapter.layers[1].experts


@pytest.mark.parametrize("field, value, reason", [
    ("use_dora", True, "DoRA"),
    ("lora_bias", True, "lora_bias"),
    ("modules_to_save", ["embed_tokens", "lm_head"], "modules_to_save"),
    ("target_modules", ["q_proj", "lm_head"], "embed_tokens/lm_head"),
    ("trainable_token_indices", [5, 7], "added or retrained tokens"),
    ("peft_type", "LOHA", "only LORA"),
    ("lora_B_layout", "interleaved", "unknown lora_B_layout"),
    ("init_lora_weights", "pissa", "init_lora_weights='pissa' (PiSSA changes the base model's weights"),
    ("init_lora_weights", "pissa_niter_4", "init_lora_weights='pissa_niter_4' (PiSSA changes"),
    ("init_lora_weights", "olora", "OLoRA changes"),
    ("init_lora_weights", "corda", "CorDA changes"),
    ("init_lora_weights", "lora_ga", "LoRA-GA changes"),
    ("init_lora_weights", "loftq", "LoftQ changes"),
    ("alora_invocation_tokens", [5, 7], "alora_invocation_tokens (activated LoRA"),
    ("layer_replication", [[0, 2], [1, 2]], "layer_replication (the adapter expects a model with duplicated layers"),
    ("use_qalora", True, "use_qalora=true (QA-LoRA"),
    ("use_bdlora", {"target_modules_bd_a": ["q_proj"], "nblocks": 2}, "use_bdlora (BD-LoRA"),
    ("use_bdlora", {}, "use_bdlora (BD-LoRA"),  # PEFT turns BD-LoRA on with its defaults
    ("kasa_config", {"beta": 0.0001, "gamma": 0.001}, "kasa_config (KaSA"),
    ("arrow_config", {"top_k": 2}, "arrow_config (Arrow"),
])
def test_refused_config(tmp_path, field, value, reason):
    message = refused(tmp_path, good(), **{field: value})
    assert "adapter_config.json" in message and reason in message


@pytest.mark.parametrize("init", [True, False, "gaussian", "eva", "orthogonal", "mica"])
def test_initializations_that_leave_the_base_model_alone_load(tmp_path, init):
    """Only how A and B started differs: the saved adapter is plain LoRA on the unchanged base model."""
    adapter = load_adapter(write_adapter(tmp_path, good(), init_lora_weights=init), tiny_config("qwen3_moe"))
    assert adapter.layers[1].modules["self_attn.q_proj"].rank == R


@pytest.mark.parametrize("field, value", [("lora_alpha", "16"), ("lora_alpha", True), ("rank_pattern", [1]),
                                          ("alpha_pattern", "x"), ("target_modules", 5), ("target_parameters", "x"),
                                          ("target_modules", [["q_proj"]]), ("target_parameters", [1]),
                                          ("peft_version", 19.1)])
def test_config_field_of_the_wrong_type(tmp_path, field, value):
    assert f"adapter_config.json: {field!r} must be" in refused(tmp_path, good(), **{field: value})


@pytest.mark.parametrize("field, value, expected", [
    ("lora_alpha", float("nan"), "'lora_alpha' must be a finite number, got nan"),
    ("lora_alpha", float("inf"), "'lora_alpha' must be a finite number, got inf"),
    ("lora_alpha", -float("inf"), "'lora_alpha' must be a finite number, got -inf"),
    ("r", 0, "'r' must be a positive integer, got 0"),
    ("r", True, "'r' must be a positive integer, got True"),
    ("r", 8.0, "'r' must be a positive integer, got 8.0"),
    ("r", None, "'r' must be a positive integer, got None"),  # null is no missing field: PEFT fails on it too
    ("lora_alpha", None, "'lora_alpha' must be a finite number, got None"),
    ("rank_pattern", {"q_proj": 0}, "rank_pattern['q_proj'] must be a positive integer, got 0"),
    ("alpha_pattern", {"q_proj": float("nan")}, "alpha_pattern['q_proj'] must be a finite number, got nan"),
    ("rank_pattern", {"q_proj(": 8}, "rank_pattern key 'q_proj(' is not a regular expression (missing ), "),
    ("alpha_pattern", {"*": 8}, "alpha_pattern key '*' is not a regular expression (nothing to repeat"),
    # valid alone, not inside PEFT's get_pattern_key (which matches '(.*\.)?(key)$')
    ("rank_pattern", {"(?i)Q_PROJ": 8}, "rank_pattern key '(?i)Q_PROJ' is not a regular expression (global flags"),
])
def test_config_values_the_adapter_cannot_have(tmp_path, field, value, expected):
    """json writes NaN and Infinity, and Python's json reads them: a NaN alpha would make every output NaN."""
    assert f"adapter_config.json: {expected}" in refused(tmp_path, good(), **{field: value})


def test_a_pattern_key_that_backtracks_without_bound_is_refused_in_its_time_budget(tmp_path, monkeypatch):
    """'((.|..)+)+[^j]' takes exponential time on a module path ending in 'q_proj': matched without a limit it held
    the GIL, and a server loading the adapter, for hours."""
    monkeypatch.setattr(config, "PATTERN_MATCH_BUDGET_S", 0.2)
    start = time.perf_counter()
    message = refused(tmp_path, good(), rank_pattern={"gate_proj": R, "((.|..)+)+[^j]": 4})
    assert time.perf_counter() - start < 5
    assert "rank_pattern key '((.|..)+)+[^j]': matching the pattern keys against the module paths took over 0.2 s" \
        in message, message


def test_a_pattern_key_matches_as_in_peft(tmp_path):
    adapter = load_adapter(write_adapter(tmp_path, good() | {Q_A: torch.randn(4, HIDDEN), Q_B: torch.randn(16, 4)},
                                         rank_pattern={"layers\\.1\\.self_attn\\.q_.*": 4}), tiny_config("qwen3_moe"))
    assert adapter.layers[1].modules["self_attn.q_proj"].rank == 4


def test_an_integer_past_pythons_digit_limit_in_the_config(tmp_path):
    write_adapter(tmp_path, good())
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": ' + "9" * 5000 + "}")
    with pytest.raises(AdapterError, match="adapter_config.json: cannot be read .*4300"):
        load_adapter(tmp_path, tiny_config("qwen3_moe"))


def test_a_peft_version_of_numbers_no_release_has_is_unknown():
    assert AdapterConfig.from_dict({"peft_version": "0." + "9" * 5000}).param_orientation_fixed() is None
    assert AdapterConfig.from_dict({"peft_version": "0.19.1"}).param_orientation_fixed() is True


def test_an_adapter_without_lora_weights(tmp_path):
    """PEFT would load it as the base model with a warning; an empty file is a broken save, not an adapter."""
    message = refused(tmp_path, {})
    assert "holds no LoRA weights (no lora_A / lora_B pair): nothing to serve" in message, message


def test_a_meta_tensor_in_a_bin(tmp_path):
    write_adapter(tmp_path, good())
    (tmp_path / "adapter_model.safetensors").unlink()
    torch.save(good() | {Q_A: torch.empty(R, HIDDEN, device="meta")}, tmp_path / "adapter_model.bin")
    with pytest.raises(AdapterError, match=f"{Q_A}: a meta tensor"):
        load_adapter(tmp_path, tiny_config("qwen3_moe"))


def test_a_float64_b_is_scaled_in_float64(tmp_path):
    """Past float32's range but not float64's: the adapter holds it (the engine's slots then check it against the
    model's dtype)."""
    tensors = {k: v.double() for k, v in good().items()}
    tensors[Q_B][0, 0] = 1e39
    adapter = load_adapter(write_adapter(tmp_path, tensors, r=R, lora_alpha=2 * R), tiny_config("qwen3_moe"))
    assert adapter.layers[1].modules["self_attn.q_proj"].b[0, 0].item() == 2e39


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-le", "utf-32"])
def test_config_in_any_unicode_encoding_loads(tmp_path, encoding):
    write_adapter(tmp_path, good())
    text = (tmp_path / "adapter_config.json").read_text()
    (tmp_path / "adapter_config.json").write_bytes(text.encode(encoding))
    assert load_adapter(tmp_path, tiny_config("qwen3_moe")).layers[1].modules["self_attn.q_proj"].rank == R


def test_config_in_no_unicode_encoding(tmp_path):
    write_adapter(tmp_path, good())
    (tmp_path / "adapter_config.json").write_bytes(b'{"r": 8, "x": "\xff\xfe\xfd"}')
    with pytest.raises(AdapterError, match="adapter_config.json: not valid JSON in UTF-8, UTF-16 or UTF-32"):
        load_adapter(tmp_path, tiny_config("qwen3_moe"))


@pytest.mark.parametrize("path, expected", [
    ("x" * 5000, "5000 bytes long, the limit is"),
    ("a\0b", "without NUL characters"),
    ("\ud800", "not valid Unicode"),
    ("", "must be a non-empty path"),
])
def test_paths_the_os_cannot_take(path, expected):
    with pytest.raises(AdapterError, match=expected):
        load_adapter(path, tiny_config("qwen3_moe"))


def test_unreadable_paths(tmp_path):
    with pytest.raises(AdapterError, match="cannot be read: File name too long"):
        load_adapter(tmp_path / ("x" * 300), tiny_config("qwen3_moe"))
    write_adapter(tmp_path, good())
    (tmp_path / "adapter_model.safetensors").unlink()
    (tmp_path / "adapter_model.safetensors").mkdir()  # a directory where the file should be
    with pytest.raises(AdapterError, match="no adapter_model.safetensors or adapter_model.bin"):
        load_adapter(tmp_path, tiny_config("qwen3_moe"))


def test_config_nested_too_deep(tmp_path):
    write_adapter(tmp_path, good())
    (tmp_path / "adapter_config.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(AdapterError, match="adapter_config.json: JSON nested too deep to read"):
        load_adapter(tmp_path, tiny_config("qwen3_moe"))


def test_config_that_is_not_an_object(tmp_path):
    write_adapter(tmp_path, good())
    (tmp_path / "adapter_config.json").write_text("[1]")
    with pytest.raises(AdapterError, match="adapter_config.json: must hold a JSON object, got list"):
        load_adapter(tmp_path, tiny_config("qwen3_moe"))


def test_added_tokens_past_the_vocabulary(tmp_path):
    """A token past the base model's 32 embedding rows needs resized embeddings, which are not served."""
    (tmp_path / "added_tokens.json").write_text(json.dumps({"<|im_end|>": 31, "<sql>": 32, "<table>": 40}))
    message = refused(tmp_path, good())
    assert ("added_tokens.json: '<sql>' (id 32), '<table>' (id 40) lie outside the base model's vocabulary of 32 tokens"
            in message), message
    assert "<|im_end|>" not in message


def test_added_tokens_of_the_base_vocabulary_load(tmp_path):
    """transformers 4 tokenizers save every special token past their BPE vocabulary in added_tokens.json, the base
    model's own ones too (Qwen's <|endoftext|>, <|im_start|>, ... at 151643-151668 of the model's 151936): an
    adapter saved with its tokenizer lists them, and adds nothing to the model."""
    (tmp_path / "added_tokens.json").write_text(json.dumps({"<|endoftext|>": 29, "<|im_start|>": 30, "<|im_end|>": 31}))
    adapter = load_adapter(write_adapter(tmp_path, good()), tiny_config("qwen3_moe"))
    assert adapter.layers[1].modules["self_attn.q_proj"].rank == R


@pytest.mark.parametrize("tokenizer_file", ["tokenizer_config.json", "tokenizer.json"])
def test_added_tokens_against_the_base_tokenizer(tmp_path, tokenizer_file):
    """With the base model's tokenizer files at hand an added token must be the base tokenizer's own, at its id: a new
    token inside the embedding's rows (vocabularies are padded) would be split into other tokens by the served
    tokenizer, so the adapter would see other ids than in its training."""
    model = tmp_path / "model"
    tiny_config("qwen3_moe").save_pretrained(model)
    base = {"<|endoftext|>": 29, "<|im_start|>": 30}
    (model / tokenizer_file).write_text(json.dumps(
        {"added_tokens_decoder": {str(i): {"content": t, "special": True} for t, i in base.items()}}
        if tokenizer_file == "tokenizer_config.json" else {"added_tokens": [{"id": i, "content": t} for t, i in base.items()]}))
    adapter = tmp_path / "adapter"
    (adapter / "added_tokens.json").parent.mkdir()
    (adapter / "added_tokens.json").write_text(json.dumps(base))
    assert load_adapter(write_adapter(adapter, good()), model).layers[1].modules["self_attn.q_proj"].rank == R
    (adapter / "added_tokens.json").write_text(json.dumps({"<|endoftext|>": 29, "<sql>": 20, "<|im_start|>": 31}))
    with pytest.raises(AdapterError) as e:
        load_adapter(adapter, model)
    assert ("added_tokens.json: '<sql>' (id 20), '<|im_start|>' (id 31) are not tokens of the base model's tokenizer "
            "at those ids") in str(e.value), str(e.value)


@pytest.mark.parametrize("text, expected", [("{not json", "not valid JSON"), ("[32]", "must map each token to its id (an integer), got [32]"),
                                            ('{"<sql>": "32"}', "must map each token to its id (an integer), got {'<sql>': '32'}"),
                                            ("[" * 100000 + "]" * 100000, "JSON nested too deep to read")])
def test_added_tokens_file_unreadable(tmp_path, text, expected):
    (tmp_path / "added_tokens.json").write_text(text)
    assert f"added_tokens.json: {expected}" in refused(tmp_path, good())


def test_defined_twice(tmp_path):
    """Expert 2's gate by a per-expert module and by a stacked tensor of all experts."""
    stacked = f"{LAYER1}.mlp.experts.gate_proj.lora_A"
    tensors = good() | {stacked: torch.randn(EXPERTS, R, HIDDEN), stacked.replace("lora_A", "lora_B"): torch.randn(EXPERTS, MOE_INTER, R)}
    assert re.search(r"experts\.(2\.)?gate_proj\.lora_A(\.weight)?: expert 2 gate is already given by", refused(tmp_path, tensors))


def test_half_given_twice(tmp_path):
    """A bare 'lora_A' and a 'lora_A.weight' of the same module: neither is dropped silently."""
    bare = Q_A.removesuffix(".weight")
    message = refused(tmp_path, good() | {bare: torch.randn(R, HIDDEN)})
    assert f"{Q_A}: lora_A of {bare.removesuffix('.lora_A')} is given twice, also by {bare}" in message


def test_all_problems_reported_together(tmp_path):
    tensors = good()
    tensors[Q_B] = torch.randn(16, 4)
    tensors["base_model.model.model.norm.weight"] = torch.randn(HIDDEN)
    message = refused(tmp_path, tensors, max_lora_rank=4)
    assert "3 problem(s)" in message  # q_proj shapes, the norm key, expert 2's rank
    assert Q_B in message and "model.norm.weight" in message and "experts.2.gate_proj" in message


def test_corrupt_safetensors(tmp_path):
    write_adapter(tmp_path, good())
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(AdapterError, match="adapter_model.safetensors: cannot be read as safetensors"):
        load_adapter(tmp_path, tiny_config("qwen3_moe"))


class NotATensor:
    pass


def test_bin_with_code_is_refused(tmp_path):
    """adapter_model.bin is loaded with weights_only=True: a pickle that carries objects is refused."""
    write_adapter(tmp_path, good())
    (tmp_path / "adapter_model.safetensors").unlink()
    torch.save({Q_A: torch.randn(R, HIDDEN), "payload": NotATensor()}, tmp_path / "adapter_model.bin")
    with pytest.raises(AdapterError, match=r"adapter_model.bin: cannot be read with torch.load\(weights_only=True\)"):
        load_adapter(tmp_path, tiny_config("qwen3_moe"))


@pytest.mark.parametrize("name", ["adapter_config.json", "added_tokens.json"])
def test_a_json_file_past_the_size_limit_is_refused_unread(tmp_path, monkeypatch, name):
    """Read whole, a config of gigabytes took the server's memory with it."""
    monkeypatch.setattr(errors, "MAX_JSON_BYTES", 1 << 10)
    write_adapter(tmp_path, good())
    if name == "added_tokens.json":
        (tmp_path / name).write_text(json.dumps({f"<t{i}>": i for i in range(200)}))
    else:
        config = json.loads((tmp_path / name).read_text())
        (tmp_path / name).write_text(json.dumps({**config, "padding": "x" * 2000}))
    with pytest.raises(AdapterError, match=re.escape(f"{tmp_path / name}: more than 0 MiB, not an adapter's JSON")):
        load_adapter(tmp_path, tiny_config("qwen3_moe"))


def test_files_replaced_while_they_are_read_are_refused(tmp_path, monkeypatch):
    """An adapter updated in place while it was read would be served as neither version: the old config's scaling
    with the new tensors."""
    write_adapter(tmp_path, good())
    real = adapter_module.read_tensors

    def read_then_replace(path):
        tensors = real(path)
        config = json.loads((tmp_path / "adapter_config.json").read_text())
        (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 2 * config["lora_alpha"]}))
        return tensors
    monkeypatch.setattr(adapter_module, "read_tensors", read_then_replace)
    with pytest.raises(AdapterError, match="its files changed while they were read; load it again"):
        load_adapter(tmp_path, tiny_config("qwen3_moe"))
    monkeypatch.setattr(adapter_module, "read_tensors", real)
    load_adapter(tmp_path, tiny_config("qwen3_moe"))  # written: it loads
