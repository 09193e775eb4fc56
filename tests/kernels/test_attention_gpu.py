"""Paged attention at real model shapes in bf16 on a GPU (scripts/gpu_check.sh); skipped on CPU machines."""
import pytest
import torch

from moelora.kernels.attention import attention
from tests.support import assert_rows_close, random_paged_attention, rel_tolerance

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HEADS = {  # q heads, kv heads, key head size, value head size
    "qwen3-30b-a3b": (32, 4, 128, 128),
    "deepseek-v2-lite-mla": (16, 16, 192, 128),  # MLA keys and values stored decompressed per head
}


def _check(case, got, what):
    ref = attention(*case, impl="torch")
    assert_rows_close(got.flatten(0, 1), ref.flatten(0, 1), rel_tolerance(torch.bfloat16, "cuda"), what)


@pytest.mark.parametrize("model", list(HEADS))
def test_prefill_and_chunked_prefill(model, poison):
    """Fresh prompts and chunks after cached prefixes, contexts up to 8k."""
    gen = torch.Generator().manual_seed(torch.seed())
    prefix, extend = [0, 0, 1000, 6000, 4095], [2048, 1, 517, 2192, 1]
    case = random_paged_attention(prefix, extend, *HEADS[model], torch.bfloat16, "cuda", generator=gen)
    _check(case, attention(*case), f"{model} extend")


@pytest.mark.parametrize("model", list(HEADS))
def test_decode_long_contexts(model, poison):
    gen = torch.Generator().manual_seed(torch.seed())
    seq_lens = [1, 2, 63, 64, 65, 700, 4096, 8192] + torch.randint(1, 8192, (24,), generator=gen).tolist()
    case = random_paged_attention([n - 1 for n in seq_lens], [1] * len(seq_lens), *HEADS[model], torch.bfloat16,
                                  "cuda", generator=gen)
    batch = attention(*case, is_decode=True)
    _check(case, batch, f"{model} decode")
    q, k, v, req_to_token, rows, lens, ext, starts, scale = case
    for i in (0, 6, 7, 20):
        alone = attention(q[i:i + 1], k, v, req_to_token, rows[i:i + 1], lens[i:i + 1], ext[i:i + 1],
                          torch.zeros_like(starts[:1]), scale, is_decode=True)
        assert torch.equal(alone[0], batch[i]), f"sequence {i} (length {seq_lens[i]}) differs alone vs in the batch"


def test_decode_replays_in_a_cuda_graph():
    """Captured once, replayed after every sequence grew: the grid must not depend on the lengths."""
    gen = torch.Generator().manual_seed(torch.seed())
    seq_lens = [3000, 17, 512, 8000]
    case = random_paged_attention([n - 1 for n in seq_lens], [1] * 4, *HEADS["qwen3-30b-a3b"], torch.bfloat16,
                                  "cuda", spare_slots=4096, generator=gen)
    q, k, v, req_to_token, rows, lens, ext, starts, scale = case
    short = lens - torch.tensor([2000, 10, 500, 3000], dtype=torch.int32, device="cuda")
    lens_buf = short.clone()
    attention(q, k, v, req_to_token, rows, lens_buf, ext, starts, scale, is_decode=True)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention(q, k, v, req_to_token, rows, lens_buf, ext, starts, scale, is_decode=True)
    for lengths in (short, lens):
        lens_buf.copy_(lengths)
        graph.replay()
        _check(case._replace(seq_lens=lengths), out, f"graph replay, lengths {lengths.tolist()}")
