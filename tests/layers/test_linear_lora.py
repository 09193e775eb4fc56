import torch

from moelora.core import LoRABatch
from moelora.kernels.linear import linear
from moelora.kernels.lora_linear import lora_linear_reference
from moelora.layers.linear import Linear
from tests.support import assert_rows_close, random_linear_lora, rel_tolerance


def test_linear_adds_each_tokens_adapter_and_keeps_base_rows(device):
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(torch.seed())
    layer = Linear(64, (48, 16, 16), part_names=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))
    layer.weight.data = (torch.randn(80, 64, generator=gen) / 8).to(device, dtype)
    layer.lora = random_linear_lora(64, layer.out_sizes, [[8, 8, 8], [16, 0, 4]], dtype, device, generator=gen)
    x = torch.randn(9, 64, generator=gen).to(device, dtype)
    slots = torch.tensor([0, -1, 1, 1, -1, 0, 5, 1, 0], dtype=torch.int32, device=device)
    y = layer(x, LoRABatch(slots))
    base = linear(x, layer.weight)
    plain = (slots < 0) | (slots >= 2)
    assert torch.equal(y[plain], base[plain])
    expected = (base.float() + lora_linear_reference(x, layer.lora, layer.out_sizes, slots)).to(dtype)
    assert_rows_close(y[~plain], expected[~plain], rel_tolerance(dtype, device))
    assert (y[~plain] != base[~plain]).any(-1).all(), "LoRA was not applied"
