"""The canonical adapter drops straight into the MoE kernels' slot buffers (ExpertLoRASlots): tokens of
two adapters (one target_parameters, one per-expert with partial coverage) and of the base model in
one batch match the base model run with each adapter's merged weights."""
import torch
from peft import LoraConfig

from lora_builders import EXPERTS, HIDDEN, MOE_INTER, PerExpertModel, peft_adapter, tiny_config, tiny_model
from moelora.core import ExpertLoRASlots
from moelora.kernels.fused_moe import fused_moe_reference
from moelora.lora import load_adapter
from tests.support import random_topk

LAYER = 1  # the MoE layer of the tiny qwen3_moe


def fill_slots(adapters, max_rank: int) -> ExpertLoRASlots:
    """Slot s holds adapters[s]'s layer-LAYER experts, zero-padded to max_rank."""
    shapes = {"gate": (HIDDEN, MOE_INTER), "up": (HIDDEN, MOE_INTER), "down": (MOE_INTER, HIDDEN)}
    buffers, ranks = {}, torch.zeros(3, len(adapters), EXPERTS, dtype=torch.int32)
    for p, (name, (d_in, d_out)) in enumerate(shapes.items()):
        a = torch.zeros(len(adapters), EXPERTS, max_rank, d_in)
        b = torch.zeros(len(adapters), EXPERTS, max_rank, d_out)
        for s, adapter in enumerate(adapters):
            experts = adapter.layers[LAYER].experts.get(name)
            if experts is not None:
                a[s, :, : experts.rank], b[s, :, : experts.rank], ranks[p, s] = experts.a, experts.b.transpose(1, 2), experts.ranks
        buffers[f"a_{name}"], buffers[f"b_{name}"] = a, b
    return ExpertLoRASlots(**buffers, ranks=ranks)


def test_canonical_adapters_in_slots_match_merged_weights(tmp_path):
    config = tiny_config("qwen3_moe")
    model = tiny_model(config)
    w13 = model.model.layers[LAYER].mlp.experts.gate_up_proj.detach().clone()
    w2 = model.model.layers[LAYER].mlp.experts.down_proj.detach().clone()
    fused = peft_adapter(tiny_model(config), LoraConfig(r=4, lora_alpha=8, target_parameters=[
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]), tmp_path / "fused")
    per_expert = peft_adapter(PerExpertModel(tiny_model(config)), LoraConfig(
        r=2, lora_alpha=3, target_modules=r".*experts\.[02]\.(gate|up|down)_proj"), tmp_path / "per_expert")
    adapters = [load_adapter(tmp_path / "fused", config), load_adapter(tmp_path / "per_expert", config)]

    merged = [(w13 + fused[f"model.layers.{LAYER}.mlp.experts.gate_up_proj"], w2 + fused[f"model.layers.{LAYER}.mlp.experts.down_proj"])]
    w13_pe, w2_pe = w13.clone(), w2.clone()
    for e in (0, 2):
        key = f"model.layers.{LAYER}.mlp.experts.{e}.{{}}.weight"
        w13_pe[e] += torch.cat([per_expert[key.format("gate_proj")], per_expert[key.format("up_proj")]])
        w2_pe[e] += per_expert[key.format("down_proj")]
    merged.append((w13_pe, w2_pe))

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, HIDDEN, generator=gen)
    topk = random_topk(24, EXPERTS, 2, generator=gen)
    token_slots = torch.tensor([-1, 0, 1] * 8, dtype=torch.int32)
    out = fused_moe_reference(x, w13, w2, topk, fill_slots(adapters, max_rank=8), token_slots)
    for s, (w13_s, w2_s) in [(-1, (w13, w2)), (0, merged[0]), (1, merged[1])]:
        rows = token_slots == s
        sub = type(topk)(topk.weights[rows], topk.ids[rows])
        torch.testing.assert_close(out[rows], fused_moe_reference(x[rows], w13_s, w2_s, sub), atol=1e-5, rtol=1e-4)
