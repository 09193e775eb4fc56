"""`moelora inspect`: text and JSON reports, with and without the base model, exit status 1 on problems."""
import json

import torch
from safetensors.torch import load_file, save_file

from lora_builders import EXPERTS, HIDDEN, MOE_INTER, tiny_config, write_adapter
from moelora.cli import main

LAYER1 = "base_model.model.model.layers.1"


def partial_per_expert(tmp_path, r=4):
    """Experts 1 and 3 of layer 1 (gate and down) and layer 0's q_proj with rank 2 via rank_pattern."""
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(2, HIDDEN),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(16, 2)}
    for e in (1, 3):
        tensors[f"{LAYER1}.mlp.experts.{e}.gate_proj.lora_A.weight"] = torch.randn(r, HIDDEN)
        tensors[f"{LAYER1}.mlp.experts.{e}.gate_proj.lora_B.weight"] = torch.randn(MOE_INTER, r)
        tensors[f"{LAYER1}.mlp.experts.{e}.down_proj.lora_A.weight"] = torch.randn(r, MOE_INTER)
        tensors[f"{LAYER1}.mlp.experts.{e}.down_proj.lora_B.weight"] = torch.randn(HIDDEN, r)
    return write_adapter(tmp_path / "adapter", tensors, r=r, lora_alpha=8, rank_pattern={"q_proj": 2}, peft_version="0.15.0")


def model_dir(tmp_path):
    tiny_config("qwen3_moe").save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


def test_inspect_file_only(tmp_path, capsys):
    assert main(["inspect", str(partial_per_expert(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "format    expert-modules; peft 0.15.0" in out
    assert "layers 1: experts.down 1, 3, experts.gate 1, 3" in out
    assert "self_attn.q_proj  r=2    scaling=4" in out and "memory    needs --model" in out


def test_inspect_with_model_json(tmp_path, capsys):
    assert main(["inspect", str(partial_per_expert(tmp_path)), "--model", model_dir(tmp_path), "--json", "--max-lora-rank", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["formats"] == ["expert-modules"] and report["model"]["model_type"] == "qwen3_moe"
    assert {"name": "experts.gate", "rank": 4, "scaling": 2.0, "layers": "1"} in report["modules"]
    assert {"name": "self_attn.q_proj", "rank": 2, "scaling": 4.0, "layers": "0"} in report["modules"]
    assert report["experts_covered"] == [{"layers": "1", "experts.down": f"2/{EXPERTS} (1, 3)", "experts.gate": f"2/{EXPERTS} (1, 3)"}]
    memory = report["memory"]  # one MoE layer, slots at rank 8, 2 bytes per element
    assert memory["expert_slot_bytes"] == 1 * 3 * EXPERTS * 8 * (HIDDEN + MOE_INTER) * 2
    assert memory["module_slot_bytes"] == 8 * (HIDDEN + 16) * 2
    assert report["problems"] == []


def test_inspect_reports_problems(tmp_path, capsys):
    adapter = partial_per_expert(tmp_path)
    assert main(["inspect", str(adapter), "--model", model_dir(tmp_path), "--max-lora-rank", "2"]) == 1
    out = capsys.readouterr().out
    assert f"{LAYER1}.mlp.experts.1.gate_proj.lora_A.weight: rank 4 is above the engine's max_lora_rank=2" in out
    assert "problems  4" in out and "experts.gate" in out  # the file's modules are still listed


def test_inspect_checks_ranks_without_the_model(tmp_path, capsys):
    """The engine's limit applies to the file alone too: the flag's, else the largest rank an engine serves."""
    assert main(["inspect", str(partial_per_expert(tmp_path)), "--max-lora-rank", "2"]) == 1
    assert "experts.gate (layers 1): rank 4 is above the engine's max_lora_rank=2" in capsys.readouterr().out
    assert main(["inspect", str(partial_per_expert(tmp_path / "big", r=257))]) == 1
    assert "experts.down (layers 1): rank 257 is above the engine's max_lora_rank=256" in capsys.readouterr().out
    assert main(["inspect", str(partial_per_expert(tmp_path)), "--max-lora-rank", "300"]) == 1
    assert capsys.readouterr().err == ("moelora inspect: error: --max-lora-rank must be in 1..256 (the engine's "
                                       "largest), got 300\n")


def test_inspect_missing_adapter(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope"), "--json"]) == 1
    assert "nope: does not exist (an adapter directory expected)" in json.loads(capsys.readouterr().out)["problems"][0]
    (tmp_path / "empty").mkdir()
    assert main(["inspect", str(tmp_path / "empty"), "--json"]) == 1
    assert "empty: no adapter_config.json" in json.loads(capsys.readouterr().out)["problems"][0]


def test_inspect_a_pair_whose_a_gives_no_rank(tmp_path, capsys):
    """A rank-0 A, or a stacked A of too few dimensions, is a problem of the report, with or without the model, not
    a crash of the rows that describe the file."""
    rank0 = {f"{LAYER1}.self_attn.q_proj.lora_A.weight": torch.randn(0, HIDDEN),
             f"{LAYER1}.self_attn.q_proj.lora_B.weight": torch.randn(16, 0)}
    flat = {f"{LAYER1}.mlp.experts.down_proj.lora_A.weight": torch.randn(5),
            f"{LAYER1}.mlp.experts.down_proj.lora_B.weight": torch.randn(5)}
    for name, tensors, shape in (("rank0", rank0, (0, HIDDEN)), ("flat", flat, (5,))):
        adapter = str(write_adapter(tmp_path / name, tensors))
        assert main(["inspect", adapter, "--json"]) == 1
        problems = json.loads(capsys.readouterr().out)["problems"]
        assert any(f"lora_A.weight: shape {shape} gives no rank" in p for p in problems), problems
        assert main(["inspect", adapter, "--model", model_dir(tmp_path), "--json"]) == 1
        assert json.loads(capsys.readouterr().out)["problems"]


def test_inspect_lists_training_only_tensors_left_out(tmp_path, capsys):
    """VeLoRA's and MonteCLoRA's training state is not served (formats.py); the report says so, key by key, and the
    adapter has no problem for it."""
    adapter = partial_per_expert(tmp_path)
    tensors = load_file(adapter / "adapter_model.safetensors")
    extra = {"base_model.model.model.layers.0.self_attn.q_proj.lora_velora_embed": torch.randn(4, HIDDEN),
             "base_model.model.model.layers.0.self_attn.q_proj.lora_monteclora_sampler.std_prior": torch.randn(1)}
    save_file({**tensors, **extra}, adapter / "adapter_model.safetensors")
    assert main(["inspect", str(adapter)]) == 0
    out = capsys.readouterr().out
    assert "left out  2 tensor(s) of training-only state" in out and all(f"  - {key}" in out for key in extra)
    assert main(["inspect", str(adapter), "--model", model_dir(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(report["left_out"]) == sorted(extra) and report["problems"] == []
