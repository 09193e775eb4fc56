"""Dense-layer LoRA at real model shapes in bf16 on a GPU (scripts/gpu_check.sh); skipped on CPU machines."""
import pytest
import torch

from moelora.kernels.linear import _shrink_done, linear
from moelora.kernels.lora_linear import lora_linear
from tests.support import (assert_gpu_finishes, assert_rows_close, random_linear_lora,
                           rel_tolerance)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LAYERS = {  # Qwen3-30B-A3B attention: in features, out sizes
    "qkv": (2048, (4096, 512, 512)),
    "o": (4096, (2048,)),
}
SLOT_RANKS = [[16, 16, 16]] * 6 + [[16, 0, 16], [0, 0, 0]]  # 8 slots of rank 16; one skips k, one adapts nothing


def _layer(layer, tokens, gen):
    in_features, out_sizes = LAYERS[layer]
    lora = random_linear_lora(in_features, out_sizes, [r[:len(out_sizes)] for r in SLOT_RANKS], torch.bfloat16,
                              "cuda", poison_unused=True, generator=gen)
    x = torch.randn(tokens, in_features, generator=gen).to("cuda", torch.bfloat16)
    weight = (torch.randn(sum(out_sizes), in_features, generator=gen) / in_features**0.5).to("cuda", torch.bfloat16)
    slots = torch.randint(-1, len(SLOT_RANKS), (tokens,), generator=gen, dtype=torch.int32).cuda()
    return x, weight, lora, out_sizes, slots


@pytest.mark.parametrize("tokens", [1, 7, 64, 513, 4096])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_real_shape_matches_reference(layer, tokens, poison):
    gen = torch.Generator().manual_seed(torch.seed())
    x, weight, lora, out_sizes, slots = _layer(layer, tokens, gen)
    got = lora_linear(x, weight, None, lora, out_sizes, slots)
    expected = lora_linear(x, weight, None, lora, out_sizes, slots, impl="torch")
    assert_rows_close(got, expected, rel_tolerance(torch.bfloat16, "cuda"), f"{layer} T={tokens}")
    base = slots < 0
    assert torch.equal(got[base].view(torch.int16), linear(x, weight)[base].view(torch.int16)), \
        "base rows must be the plain GEMM's bits"


@pytest.mark.parametrize("tokens", [1, 200, 4096])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_eight_slots_of_rank_64_run(layer, tokens, poison):
    """8 slots of rank 64 (--max-loras-per-batch 8 --max-lora-rank 64): one dot of the epilogue stacks 512 rows of
    B, which most tiles cannot hold in shared memory (the engine's start failed, sessions 47 and 48): the epilogue
    loads B after the shrink's wait or runs in chunks of slots, and matches the reference; base rows keep the plain
    GEMM's bits."""
    gen = torch.Generator().manual_seed(torch.seed())
    in_features, out_sizes = LAYERS[layer]
    ranks = [[64] * len(out_sizes)] * 4 + [[8] * len(out_sizes)] * 3 + [[0] * len(out_sizes)]
    lora = random_linear_lora(in_features, out_sizes, ranks, torch.bfloat16, "cuda", poison_unused=True, generator=gen)
    x = torch.randn(tokens, in_features, generator=gen).to("cuda", torch.bfloat16)
    weight = (torch.randn(sum(out_sizes), in_features, generator=gen) / in_features**0.5).to("cuda", torch.bfloat16)
    slots = torch.randint(-1, len(ranks), (tokens,), generator=gen, dtype=torch.int32).cuda()
    got = lora_linear(x, weight, None, lora, out_sizes, slots)
    assert_rows_close(got, lora_linear(x, weight, None, lora, out_sizes, slots, impl="torch"),
                      rel_tolerance(torch.bfloat16, "cuda"), f"{layer} T={tokens}")
    base = slots < 0
    assert torch.equal(got[base].view(torch.int16), linear(x, weight)[base].view(torch.int16))


# the batch's shrink on blocks of 16 and of 64 tokens (qkv: the serial launch, o_proj: the split programs)
@pytest.mark.parametrize("tokens", [2048, 8192])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_row_does_not_depend_on_batch(layer, tokens, poison):
    gen = torch.Generator().manual_seed(torch.seed())
    x, weight, lora, out_sizes, slots = _layer(layer, tokens, gen)
    batch = lora_linear(x, weight, None, lora, out_sizes, slots)
    for t in (0, 1, 2, tokens // 2 + 1, tokens - 1):
        alone = lora_linear(x[t:t + 1], weight, None, lora, out_sizes, slots[t:t + 1])
        assert torch.equal(alone[0], batch[t]), f"token {t} (slot {int(slots[t])}) differs alone vs in the batch"


def test_replays_in_a_cuda_graph():
    """Sorting by slot, shrink and the GEMM with its LoRA epilogue are captured once and replayed with other
    slots: no host sync."""
    gen = torch.Generator().manual_seed(torch.seed())
    x, weight, lora, out_sizes, slots = _layer("qkv", 48, gen)
    slots_buf = slots.clone()
    lora_linear(x, weight, None, lora, out_sizes, slots_buf)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = lora_linear(x, weight, None, lora, out_sizes, slots_buf)
    for new_slots in (slots, torch.randint(-1, len(SLOT_RANKS), slots.shape, generator=gen, dtype=torch.int32).cuda()):
        slots_buf.copy_(new_slots)
        graph.replay()
        expected = lora_linear(x, weight, None, lora, out_sizes, new_slots, impl="torch")
        assert_rows_close(y, expected, rel_tolerance(torch.bfloat16, "cuda"), "graph replay")


@pytest.mark.parametrize("layer", list(LAYERS))
def test_shrink_in_the_gemm_launch_never_waits_forever(layer):
    """Decode rows of 8 adapters: the shrink runs in the GEMM's first programs and each tile's last program waits
    for it (gemm_tiles.wait_arrivals), then the last waiter puts the counter back to 0. 4000 launches back to back
    from a CUDA graph, as a server's decode steps run them, finish and agree with the reference; a program that
    counted in while one of its warps still polled let that warp wait forever (bench_serving at batch 8 with 8
    adapters hung the GPU so)."""
    gen = torch.Generator().manual_seed(torch.seed())
    x, weight, lora, out_sizes, _ = _layer(layer, 8, gen)
    slots = torch.arange(8, dtype=torch.int32, device="cuda")
    lora_linear(x, weight, None, lora, out_sizes, slots)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(100):
            y = lora_linear(x, weight, None, lora, out_sizes, slots)
    for _ in range(40):
        graph.replay()
    assert_gpu_finishes(60, f"{layer}: 4000 launches with the shrink in the GEMM")
    expected = lora_linear(x, weight, None, lora, out_sizes, slots, impl="torch")
    assert_rows_close(y, expected, rel_tolerance(torch.bfloat16, "cuda"), "after 4000 launches")
    assert not _shrink_done[x.device].any(), "the shrink's counter not back at 0"
