"""write_adapter_to_slot refuses, before writing anything, what does not fit the model's slots; an adapter's share
of one rank is all of it, not a copy; a staged share writes the same slots."""
import pytest
import torch

from moelora.engine.lora_slots import (allocate_lora_slots, share_of, staged_share, write_adapter_to_slot,
                                       write_share_to_slot)
from moelora.layers.moe.runner import Runner
from moelora.lora import AdapterError, load_adapter
from moelora.models.loader import load_model
from tests.models.families import family_config


@pytest.fixture
def model(checkpoint):
    model = load_model(checkpoint("qwen3_moe"), dtype=torch.float32, device="cpu")
    allocate_lora_slots(model, num_slots=2, max_rank=4)
    return model


def test_ranks_follow_the_adapter(model, adapters):
    write_adapter_to_slot(model, load_adapter(adapters("qwen3_moe")["partial"].path, family_config("qwen3_moe")), 1)
    attn = model.model.layers[0].self_attn.qkv_proj.lora
    assert attn.ranks.tolist() == [[0, 0, 0], [2, 0, 2]]  # q and v adapted, k not
    moe = next(m for m in model.modules() if isinstance(m, Runner)).lora
    assert (moe.ranks[:, 0] == 0).all() and (moe.ranks[:2, 1] == 0).all() and (moe.ranks[2, 1] == 2).all()
    assert moe.max_rank_in_use == 2


def test_rank_above_the_slots_max_is_refused(model, adapters):
    adapter = load_adapter(adapters("qwen3_moe")["full"].path, family_config("qwen3_moe"))  # gate/up rank 8
    with pytest.raises(AdapterError, match="layer 0 gate: rank 8 exceeds the slots' max rank 4"):
        write_adapter_to_slot(model, adapter, 0)
    assert all((m.lora.ranks == 0).all() for m in model.modules() if getattr(m, "lora", None) is not None)


def test_slot_out_of_range_and_unknown_module(model, adapters):
    adapter = load_adapter(adapters("qwen3_moe")["partial"].path, family_config("qwen3_moe"))
    with pytest.raises(ValueError, match=r"slot 2 out of range \[0, 2\)"):
        write_adapter_to_slot(model, adapter, 2)
    adapter.layers[0].modules["self_attn.qkv_fused"] = adapter.layers[0].modules["self_attn.q_proj"]
    with pytest.raises(AdapterError, match="layer 0 self_attn.qkv_fused: the model has no such LoRA-able module"):
        write_adapter_to_slot(model, adapter, 0)


def test_only_target_modules_get_slots_and_adapters_of_others_are_refused(checkpoint, adapters):
    model = load_model(checkpoint("qwen3_moe"), dtype=torch.float32, device="cpu")
    allocate_lora_slots(model, num_slots=2, max_rank=8, targets={"self_attn.q_proj", "mlp.experts.down_proj"})
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.lora is not None and layer.mlp.experts.lora is not None
    assert layer.self_attn.o_proj.lora is None and layer.mlp.gate.lora is None
    assert model.model.layers[1].mlp.gate_up_proj.lora is None  # the dense MLP's gate_proj is no expert's
    full = load_adapter(adapters("qwen3_moe")["full"].path, family_config("qwen3_moe"))
    with pytest.raises(AdapterError, match=r"cannot be put in slot 0: self_attn.o_proj \(layers 0-2\): this engine has "
                                           r"no LoRA slots for it; .*; mlp.gate \(layers 0, 2\): "):
        write_adapter_to_slot(model, full, 0)
    assert all((m.lora.ranks == 0).all() for m in model.modules() if getattr(m, "lora", None) is not None)
    write_adapter_to_slot(model, load_adapter(adapters("qwen3_moe")["partial"].path, family_config("qwen3_moe")), 0)
    assert layer.self_attn.qkv_proj.lora.ranks[0].tolist() == [2, 0, 2]


def test_the_share_of_one_rank_is_the_whole_adapter_uncopied(model, adapters):
    adapter = load_adapter(adapters("qwen3_moe")["partial"].path, family_config("qwen3_moe"))
    share = share_of(model, adapter)
    assert share.num_bytes() == adapter.num_bytes() and share.max_rank == 2
    for layer_id, layer in adapter.layers.items():
        for name, lora in [*layer.experts.items(), *layer.modules.items()]:
            got = share.layers[layer_id].experts.get(name) or share.layers[layer_id].modules[name]
            assert got.a is lora.a and got.b is lora.b, (layer_id, name)


def _slot_buffers(model) -> list[torch.Tensor]:
    return [t.clone() for m in model.modules() if getattr(m, "lora", None) is not None
            for t in vars(m.lora).values() if isinstance(t, torch.Tensor)]


def _out_of_page_locked_memory(t: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("CUDA error: out of memory")


@pytest.mark.parametrize("pinning", ["works", "fails"])
def test_a_staged_share_writes_the_same_slots(checkpoint, adapters, monkeypatch, caplog, pinning):
    """staged_share casts to the slots' dtype and lays B out as the copy reads it (contiguous once transposed), in
    page-locked memory (on a CPU-only machine, where nothing can be pinned, a copy stands in for it; where pinning
    fails, pageable memory with a warning): the slots it writes are bit for bit those of the share it came from."""
    if pinning == "fails":
        monkeypatch.setattr(torch.Tensor, "pin_memory", _out_of_page_locked_memory)
    elif not torch.cuda.is_available():
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t.clone())
    model = load_model(checkpoint("qwen3_moe"), dtype=torch.float16, device="cpu")
    allocate_lora_slots(model, num_slots=2, max_rank=8)
    share = share_of(model, load_adapter(adapters("qwen3_moe")["full"].path, family_config("qwen3_moe")))
    assert any(t.dtype == torch.float32 for layer in share.layers.values()
               for lora in [*layer.experts.values(), *layer.modules.values()] for t in (lora.a, lora.b))
    staged = staged_share(model, share)
    assert ("stays in pageable host memory (CUDA error: out of memory)" in caplog.text) == (pinning == "fails")
    for layer in staged.layers.values():
        for lora in layer.experts.values():
            assert lora.a.dtype == lora.b.dtype == torch.float16
            assert lora.a.is_contiguous() and lora.b.transpose(1, 2).is_contiguous() and lora.ranks.is_contiguous()
        for lora in layer.modules.values():
            assert lora.a.dtype == lora.b.dtype == torch.float16 and lora.a.is_contiguous() and lora.b.T.is_contiguous()
    assert staged.layers.keys() == share.layers.keys() and staged.num_bytes() < share.num_bytes()
    write_share_to_slot(model, share, 1)
    plain = _slot_buffers(model)
    write_share_to_slot(model, share_of(model, load_adapter(adapters("qwen3_moe")["partial"].path,
                                                            family_config("qwen3_moe"))), 1)
    write_share_to_slot(model, staged, 1)
    assert all(torch.equal(a, b) for a, b in zip(_slot_buffers(model), plain, strict=True))
