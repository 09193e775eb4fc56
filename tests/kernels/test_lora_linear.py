import pytest
import torch

from moelora.core import LinearLoRASlots
from moelora.kernels import linear as linear_module
from moelora.kernels import lora_linear as lora_linear_module
from moelora.kernels.linear import LinearConfig, LoRAEpilogue, linear
from moelora.kernels.lora_linear import LoRALinearConfig, align_tokens_by_slot, lora_linear
from tests.support import assert_rows_close, random_linear_lora, rel_tolerance, surrounded

DTYPES = [torch.bfloat16, torch.float16] if torch.cuda.is_available() else [torch.float16, torch.float32]
SLOT_RANKS = [[4, 4, 4], [8, 0, 16], [64, 16, 0], [0, 0, 0]]  # per slot and part; slot 3 adapts no part here
# several shrink K splits, and narrow output tiles (one may straddle parts) on tiny layers
SMALL = LoRALinearConfig(split_k=64, linear=LinearConfig(16, 32, 8, 4, 2))
CASES = [  # tokens, in features, out sizes
    (1, 48, (40, 24, 24)),
    (37, 80, (24, 40, 40)),  # more tokens than a block; parts off the tile grid
    (45, 150, (70,)),  # one part; in features not a multiple of the split
    (20, 64, (33, 31)),  # a tile straddles the two parts
]


def _case(tokens, in_features, out_sizes, dtype, device, bias=False):
    gen = torch.Generator().manual_seed(torch.seed())
    lora = random_linear_lora(in_features, out_sizes, [r[:len(out_sizes)] for r in SLOT_RANKS], dtype, device,
                              poison_unused=True, generator=gen)
    x = torch.randn(tokens, in_features, generator=gen).to(device, dtype)
    weight = (torch.randn(sum(out_sizes), in_features, generator=gen) / in_features**0.5).to(device, dtype)
    b = torch.randn(sum(out_sizes), generator=gen).to(device, dtype) if bias else None
    # a mixed batch: every slot, base tokens (-1) and an out-of-range slot (treated as base)
    slots = torch.randint(-1, len(SLOT_RANKS) + 1, (tokens,), generator=gen, dtype=torch.int32)
    slots[0] = 2  # token 0 has the rank-64 part
    if tokens > 3:
        slots[1], slots[2] = -1, len(SLOT_RANKS) + 2
    return x, weight, b, lora, out_sizes, slots.to(device)


def _naive(x, weight, bias, lora: LinearLoRASlots, out_sizes, slots):
    """Independent float64 formula, one token and one part at a time."""
    y = x.cpu().double() @ weight.cpu().double().T + (0 if bias is None else bias.cpu().double())
    for n, s in enumerate(slots.tolist()):
        if not 0 <= s < lora.num_slots:
            continue
        offset = 0
        for p, size in enumerate(out_sizes):
            r = int(lora.ranks[s, p])
            a, b = lora.a[s, p, :r].cpu().double(), lora.b[s, :r, offset:offset + size].T.cpu().double()
            y[n, offset:offset + size] += b @ (a @ x[n].cpu().double())
            offset += size
    return y


def _has_adapter(slots, lora):
    return (slots >= 0) & (slots < lora.num_slots)


def _bits(t):
    return t.view({torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_naive_formula(case, dtype, device):
    x, weight, bias, lora, out_sizes, slots = _case(*case, dtype, device, bias=True)
    got = lora_linear(x, weight, bias, lora, out_sizes, slots, impl="torch")
    assert_rows_close(got.cpu(), _naive(x, weight, bias, lora, out_sizes, slots), rel_tolerance(dtype), "reference")


def _shrink_in_own_launch(monkeypatch, tokens: int = 0, launch: str = "serial-16"):
    """Batches of more than `tokens` tokens run the shrink in a launch of its own, as prefill batches do: `launch`
    is the kernel (split: `_split_shrink_kernel`, serial: `_serial_shrink_kernel`) and the blocks' rows (16: as
    batches under 2048 tokens have them; 64: as the largest). The rules that choose them: test_own_launch_rules."""
    kind, rows = launch.split("-")
    monkeypatch.setattr(lora_linear_module, "FUSED_SHRINK_MAX_TOKENS", tokens)
    monkeypatch.setattr(lora_linear_module, "slot_block_rows", lambda n, config=None: int(rows) if n > tokens else 16)
    monkeypatch.setattr(lora_linear_module, "serial_shrink", lambda n, k, config=None: kind == "serial" and n > tokens)


def test_own_launch_rules():
    """Blocks of 16 tokens up to 4095 tokens, then the most rows up to 64 that give 128 blocks; the serial launch
    for K of up to 32 steps (Qwen3-30B-A3B's qkv, K 2048) from 2048 tokens, the split programs for o_proj (K 4096)
    and under 2048 tokens."""
    rows, serial = lora_linear_module.slot_block_rows, lora_linear_module.serial_shrink
    assert [rows(t) for t in (1, 256, 257, 2048, 4095, 4096, 8191, 8192, 65536)] == [16, 16, 16, 16, 16, 32, 32, 64, 64]
    assert [serial(t, 2048) for t in (256, 2047, 2048, 8192)] == [False, False, True, True]
    assert [serial(t, 4096) for t in (2048, 8192)] == [False, False]


@pytest.mark.parametrize("shrink_launch", [None, "split-16", "split-64", "serial-16", "serial-64"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_reference_and_keeps_base_rows(case, dtype, bias, shrink_launch, device, poison,
                                                      monkeypatch):
    """Adapter rows: the reference within the dtype's tolerance. Every other row: the bits of the plain GEMM
    (whose unused xa rows are NaN here, as is A past each rank and in parts of rank 0, and B there garbage,
    which the epilogue multiplies by xa's zeros). The shrink in the GEMM's launch or in its own (the split or the
    serial kernel, on blocks of 16 or 64 tokens); either way the launch leaves its counters at 0 for the next."""
    fused_shrink = shrink_launch is None
    if not fused_shrink:
        _shrink_in_own_launch(monkeypatch, launch=shrink_launch)
    x, weight, b, lora, out_sizes, slots = _case(*case, dtype, device, bias=bias)
    got = lora_linear(x, weight, b, lora, out_sizes, slots, impl="triton", config=SMALL)
    expected = lora_linear(x, weight, b, lora, out_sizes, slots, impl="torch")
    assert_rows_close(got, expected, rel_tolerance(dtype, device))
    base = ~_has_adapter(slots, lora)
    assert torch.equal(_bits(got[base]), _bits(linear(x, weight, b, impl="triton")[base]))
    counters = [lora_linear_module._counters, linear_module._counters] + [linear_module._shrink_done] * fused_shrink
    for store in counters:
        assert not store.get(x.device, torch.zeros(1)).any(), "a launch left a counter above 0"


@pytest.mark.parametrize("fused_shrink", [True, False])
def test_slots_in_chunks_give_the_bits_of_one_dot(fused_shrink, device, poison, monkeypatch):
    """Where one dot stacking every slot's B would not fit in shared memory (many slots of a large rank), the
    epilogue runs a dot per chunk of slots on the same tile (forced here: shared memory cut to what one or two of
    the four rank-64 slots take): the same bits as the one dot, rows of every slot and base rows in each tile."""
    if not fused_shrink:
        _shrink_in_own_launch(monkeypatch)
    x, weight, b, lora, out_sizes, slots = _case(37, 80, (24, 40, 40), DTYPES[0], device, bias=True)
    one_dot = lora_linear(x, weight, b, lora, out_sizes, slots, impl="triton", config=SMALL)
    slot_bytes = 64 * 2 * (SMALL.linear.block_m + SMALL.linear.block_n)  # rank tile 64: xa's and B's rows
    for chunk in (1, 2):
        monkeypatch.setattr(linear_module, "SMEM_BYTES", chunk * slot_bytes)
        shrink = (SMALL.block_m, SMALL.block_k) if fused_shrink else None
        assert linear_module.lora_epilogue_plan(SMALL.linear, LoRAEpilogue(4, 64, shrink)) == (chunk, False)
        got = lora_linear(x, weight, b, lora, out_sizes, slots, impl="triton", config=SMALL)
        assert torch.equal(_bits(got), _bits(one_dot)), f"chunks of {chunk} slot(s)"


@pytest.mark.parametrize("batch_shrink", [None, "split-16", "split-64", "serial-16", "serial-64"])
@pytest.mark.parametrize("linear_config", [None, LinearConfig(16, 16, 8, 4, 2, parallel_splits=True)])
def test_row_does_not_depend_on_batch(linear_config, batch_shrink, device, poison, monkeypatch):
    """Fixed K split, and the epilogue adds a row's products from its own slot only: a token's output is the same
    bits alone and in a batch (blocks passed in, as the engine does once per step, or aligned inside), on the
    default tiles and on narrow tiles whose K splits run in parallel programs, and with the batch's shrink in its
    own launch (the split programs or the serial kernel, blocks of 16 or 64 tokens) while the token alone has it in the GEMM's
    (the splits in programs of their own)."""
    if batch_shrink is not None:
        _shrink_in_own_launch(monkeypatch, tokens=1, launch=batch_shrink)
    dtype = DTYPES[0]
    x, weight, bias, lora, out_sizes, slots = _case(40, 150, (24, 40, 40), dtype, device)
    config = LoRALinearConfig(split_k=64, linear=linear_config)  # three K splits, the last a short one
    blocks = align_tokens_by_slot(slots, lora.num_slots)
    batch = lora_linear(x, weight, bias, lora, out_sizes, slots, blocks=blocks, impl="triton", config=config)
    for t in (0, 5, 39):
        alone = lora_linear(x[t:t + 1], weight, bias, lora, out_sizes, slots[t:t + 1], impl="triton", config=config)
        assert torch.equal(alone[0], batch[t]), f"token {t} (slot {int(slots[t])}) differs alone vs in the batch"


@pytest.mark.parametrize("fused_shrink", [True, False])
def test_rank_tile_past_the_buffers_reads_no_other_slot(fused_shrink, device, poison, monkeypatch):
    """Slots of rank 8 on the smallest rank tile (16 columns a slot): B's 8 rows a slot are read and no further, so
    the last slot's tile does not run past the buffer (NaN beyond it here), nor another slot's into the next's."""
    if not fused_shrink:
        _shrink_in_own_launch(monkeypatch)
    dtype = DTYPES[0]
    gen = torch.Generator().manual_seed(torch.seed())
    lora = random_linear_lora(48, (40, 24), [[8, 8], [4, 8], [8, 0]], dtype, device, poison_unused=True,
                              generator=gen)
    lora = LinearLoRASlots(lora.a, surrounded(lora.b, lora.b[0].numel(), float("nan")), lora.ranks)
    x = torch.randn(19, 48, generator=gen).to(device, dtype)
    weight = (torch.randn(64, 48, generator=gen) / 48**0.5).to(device, dtype)
    slots = torch.tensor([2, 0, 1, -1] * 4 + [2, 2, 1], dtype=torch.int32, device=device)
    got = lora_linear(x, weight, None, lora, (40, 24), slots, impl="triton", config=SMALL)
    assert_rows_close(got, lora_linear(x, weight, None, lora, (40, 24), slots, impl="torch"),
                      rel_tolerance(dtype, device))


@pytest.mark.parametrize("fused_shrink", [True, False])
def test_rank_bound_below_the_buffers_reads_no_row_past_it(fused_shrink, device, poison, monkeypatch):
    """Slots of rank 64 holding adapters of rank <= 16, run with max_rank_in_use 16 (a step's bound,
    LoRAManager.prepare): the smallest rank tile, so A's and B's rows past 16 (NaN here) are never read."""
    if not fused_shrink:
        _shrink_in_own_launch(monkeypatch)
    dtype = DTYPES[0]
    gen = torch.Generator().manual_seed(torch.seed())
    lora = random_linear_lora(48, (40, 24), [[16, 8], [4, 0], [16, 16]], dtype, device, poison_unused=True,
                              max_rank=64, generator=gen)
    assert lora.max_rank_in_use == 16
    lora.b[:, 16:] = float("nan")
    x = torch.randn(21, 48, generator=gen).to(device, dtype)
    weight = (torch.randn(64, 48, generator=gen) / 48**0.5).to(device, dtype)
    slots = torch.tensor([2, 0, 1, -1] * 5 + [2], dtype=torch.int32, device=device)
    got = lora_linear(x, weight, None, lora, (40, 24), slots, impl="triton", config=SMALL)
    assert_rows_close(got, lora_linear(x, weight, None, lora, (40, 24), slots, impl="torch"),
                      rel_tolerance(dtype, device))


def test_no_adapter_tokens_read_nothing(device, poison):
    """All tokens on slots whose ranks are 0 or outside the slots: the plain GEMM's bits, though every A is NaN
    and every B garbage (B past the ranks is read, times xa's zeros)."""
    dtype = DTYPES[0]
    x, weight, bias, lora, out_sizes, _ = _case(19, 48, (40, 24, 24), dtype, device)
    slots = torch.tensor([3, -1, 9] * 6 + [3], dtype=torch.int32, device=device)
    nan = LinearLoRASlots(torch.full_like(lora.a, float("nan")), 1e3 * torch.randn_like(lora.b), lora.ranks)
    got = lora_linear(x, weight, bias, nan, out_sizes, slots, impl="triton", config=SMALL)
    assert torch.equal(_bits(got), _bits(linear(x, weight, bias, impl="triton")))


def test_rejects_bad_inputs(device):
    x, weight, bias, lora, out_sizes, slots = _case(4, 48, (40, 24, 24), DTYPES[0], device)
    with pytest.raises(ValueError, match=r"LinearLoRASlots.b must be"):
        lora_linear(x, weight[:84], bias, lora, (40, 24, 20), slots)
    with pytest.raises(ValueError, match=r"weight must be contiguous"):
        lora_linear(x[:, :40], weight, bias, lora, out_sizes, slots)
    with pytest.raises(ValueError, match=r"LinearLoRASlots.a must be"):
        lora_linear(x[:, :40], weight[:, :40].contiguous(), bias, lora, out_sizes, slots)
    with pytest.raises(ValueError, match="weight has 84 output rows"):
        lora_linear(x, weight[:84], bias, lora, out_sizes, slots)
    with pytest.raises(ValueError, match="ranks must be contiguous int32"):
        lora_linear(x, weight, bias, LinearLoRASlots(lora.a, lora.b, lora.ranks.long()), out_sizes, slots)
    with pytest.raises(ValueError, match="token_slots must be int32"):
        lora_linear(x, weight, bias, lora, out_sizes, slots[:2])
    with pytest.raises(ValueError, match="blocks were aligned to 64 rows"):
        lora_linear(x, weight, bias, lora, out_sizes, slots, impl="triton", blocks=align_tokens_by_slot(slots, 4, 64))
    with pytest.raises(ValueError, match="impl must be"):
        lora_linear(x, weight, bias, lora, out_sizes, slots, impl="cuda")


@pytest.mark.parametrize("fused_shrink", [True, False])
@pytest.mark.parametrize("tokens", [1, 37])
def test_slots_no_token_names_are_never_read(fused_shrink, tokens, device, poison, monkeypatch):
    """A slot that no token of the batch names may be half written while the batch runs (an adapter loading into it
    on another stream): its A, B and ranks are never read. The same bits with every such slot NaN at the full rank."""
    if not fused_shrink:
        _shrink_in_own_launch(monkeypatch)
    dtype = DTYPES[0]
    x, weight, bias, lora, out_sizes, slots = _case(tokens, 80, (24, 40, 40), dtype, device)
    slots = torch.where(slots == 1, 0, torch.where(slots == 3, 2, slots))  # slots 1 and 3 are named by no token
    unread = torch.tensor([False, True, False, True], device=device)
    torn = LinearLoRASlots(lora.a.masked_fill(unread.view(-1, 1, 1, 1), float("nan")),
                           lora.b.masked_fill(unread.view(-1, 1, 1), float("nan")),
                           lora.ranks.masked_fill(unread.view(-1, 1), lora.a.shape[2]), lora.max_rank_in_use)
    for impl in ("triton", "torch"):
        got = lora_linear(x, weight, bias, torn, out_sizes, slots, impl=impl, config=SMALL)
        assert torch.equal(_bits(got), _bits(lora_linear(x, weight, bias, lora, out_sizes, slots, impl=impl,
                                                         config=SMALL))), impl
