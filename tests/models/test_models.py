"""Every family against transformers in fp32 on CPU: log-probs within 1e-4 for the base model, for
PEFT adapters in LoRA slots (several adapters and the base model in one batch), and for a
sequence prefilled in chunks and decoded through the paged KV cache."""
import pytest
import torch

from moelora.engine.lora_slots import allocate_lora_slots, write_adapter_to_slot
from moelora.layers.linear import Linear
from moelora.layers.moe.layer import MoE
from moelora.lora import load_adapter, load_model_shapes
from moelora.models.loader import build_model, load_model
from tests.models.families import FAMILIES, assert_logprobs_close, family_config, hf_logits, hf_model, with_deltas
from tests.support import batch_logits, extend_batch, toy_kv_cache

SEQUENCES = [[5, 17, 2, 93, 41, 8, 8, 60, 3], [11, 4, 77], [30, 1, 2, 3, 4, 5, 6]]


def _load(checkpoint, family):
    return load_model(checkpoint(family), dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("family", FAMILIES)
def test_base_logits_match_transformers(family, checkpoint):
    model = _load(checkpoint, family)
    logits = batch_logits(model, extend_batch(toy_kv_cache(model, 4, 16), SEQUENCES)).split([len(s) for s in SEQUENCES])
    for i, (got, want) in enumerate(zip(logits, hf_logits(hf_model(family_config(family)), SEQUENCES))):
        assert_logprobs_close(got, want, f"sequence {i}")


@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_and_base_in_one_batch_match_peft(family, checkpoint, adapters):
    """Slot 0: the adapter on everything, slot 1: a partial one, -1: the base model; a stale
    adapter written to slot 1 first must leave no trace."""
    config, found = family_config(family), adapters(family)
    model = _load(checkpoint, family)
    allocate_lora_slots(model, num_slots=3, max_rank=8)
    write_adapter_to_slot(model, load_adapter(found["partial"].path, config), 1)  # overwritten below
    write_adapter_to_slot(model, load_adapter(found["full"].path, config), 1)
    write_adapter_to_slot(model, load_adapter(found["full"].path, config), 0)
    write_adapter_to_slot(model, load_adapter(found["partial"].path, config), 1)
    slots = [0, -1, 1, 0]
    sequences = [*SEQUENCES, SEQUENCES[1]]
    batch = extend_batch(toy_kv_cache(model, 4, 16), sequences, lora_slots=slots)
    logits = batch_logits(model, batch).split([len(s) for s in sequences])
    references = {-1: hf_model(config), 0: with_deltas(hf_model(config), found["full"].deltas),
                  1: with_deltas(hf_model(config), found["partial"].deltas)}
    for i, (slot, seq, got) in enumerate(zip(slots, sequences, logits)):
        assert_logprobs_close(got, hf_logits(references[slot], [seq])[0], f"sequence {i} (slot {slot})")


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_then_decode_match_full_prefill(family, checkpoint, adapters):
    """Prefill 4 tokens, extend by 2, then decode one: each step's logits equal transformers' logits
    of the whole sequence at those positions (two sequences, one with an adapter)."""
    config = family_config(family)
    model = _load(checkpoint, family)
    allocate_lora_slots(model, num_slots=1, max_rank=8)
    write_adapter_to_slot(model, load_adapter(adapters(family)["full"].path, config), 0)
    kv = toy_kv_cache(model, 2, 16)
    seqs, slots = SEQUENCES[0::2], [0, -1]
    want = [hf_logits(with_deltas(hf_model(config), adapters(family)["full"].deltas), [seqs[0]])[0],
            hf_logits(hf_model(config), [seqs[1]])[0]]
    for start, end in [(0, 4), (4, 6), (6, 7)]:
        batch = extend_batch(kv, [s[start:end] for s in seqs], prefix_lens=[start, start], lora_slots=slots)
        for i, got in enumerate(batch_logits(model, batch).split(end - start)):
            assert_logprobs_close(got, want[i][start:end], f"sequence {i}, positions {start}-{end - 1}")


@pytest.mark.parametrize("family", FAMILIES)
def test_part_names_and_kv_cache_shape(family):
    """Our LoRA-able modules are exactly the ones model_shapes lists (what adapters are checked against)."""
    config = family_config(family)
    model = build_model(config, torch.float32, "meta")
    ours = {(m.layer_id, name) for m in model.modules() if isinstance(m, Linear) for name in m.part_names}
    shapes = load_model_shapes(config)
    assert ours == {(layer, name) for layer, modules in enumerate(shapes.modules) for name in modules}
    assert {m.layer_id for m in model.modules() if isinstance(m, MoE)} == shapes.moe_layers
    kv = model.kv_cache_shape
    if hasattr(config, "kv_lora_rank"):  # MLA: per-head decompressed keys and values
        expected = (config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim)
    else:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        expected = (config.num_key_value_heads, head_dim, head_dim)
    assert (kv.num_layers, kv.num_kv_heads, kv.k_head_dim, kv.v_head_dim) == (config.num_hidden_layers, *expected)
