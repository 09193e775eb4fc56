import pytest
import torch

from moelora.core import LinearLoRASlots
from moelora.kernels.lora_linear import LoRALinearConfig, align_tokens_by_slot, lora_linear
from tests.support import assert_rows_close, random_linear_lora, rel_tolerance

DTYPES = [torch.bfloat16, torch.float16] if torch.cuda.is_available() else [torch.float16, torch.float32]
SLOT_RANKS = [[4, 4, 4], [8, 0, 16], [64, 16, 0], [0, 0, 0]]  # per slot and part; slot 3 adapts no part here
SMALL = LoRALinearConfig(block_n=32, split_k=64)  # several K splits and output tiles on tiny layers
CASES = [  # tokens, in features, out sizes
    (1, 48, (40, 24, 24)),
    (37, 80, (24, 40, 40)),  # more tokens than a block; parts off the tile grid
    (45, 150, (70,)),  # one part; in features not a multiple of the split
    (20, 64, (33, 31)),  # a tile straddles the two parts
]


def _case(tokens, in_features, out_sizes, dtype, device):
    gen = torch.Generator().manual_seed(torch.seed())
    lora = random_linear_lora(in_features, out_sizes, [r[:len(out_sizes)] for r in SLOT_RANKS], dtype, device,
                              poison_unused=True, generator=gen)
    x = torch.randn(tokens, in_features, generator=gen).to(device, dtype)
    # a mixed batch: every slot, base tokens (-1) and an out-of-range slot (treated as base)
    slots = torch.randint(-1, len(SLOT_RANKS) + 1, (tokens,), generator=gen, dtype=torch.int32)
    slots[0] = 2  # token 0 has the rank-64 part
    if tokens > 3:
        slots[1], slots[2] = -1, len(SLOT_RANKS) + 2
    return x, lora, out_sizes, slots.to(device)


def _naive(x, lora: LinearLoRASlots, out_sizes, slots):
    """Independent float64 formula, one token and one part at a time."""
    delta = torch.zeros(x.shape[0], sum(out_sizes), dtype=torch.float64)
    for n, s in enumerate(slots.tolist()):
        if not 0 <= s < lora.num_slots:
            continue
        offset = 0
        for p, size in enumerate(out_sizes):
            r = int(lora.ranks[s, p])
            a, b = lora.a[s, p, :r].cpu().double(), lora.b[s, :r, offset:offset + size].T.cpu().double()
            delta[n, offset:offset + size] = b @ (a @ x[n].cpu().double())
            offset += size
    return delta


def _has_adapter(slots, lora):
    return (slots >= 0) & (slots < lora.num_slots)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_naive_formula(case, dtype, device):
    x, lora, out_sizes, slots = _case(*case, dtype, device)
    got = lora_linear(x, lora, out_sizes, slots, impl="torch")
    assert_rows_close(got.cpu(), _naive(x, lora, out_sizes, slots), 1e-5, "reference")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_delta_matches_reference(case, dtype, device, poison):
    x, lora, out_sizes, slots = _case(*case, dtype, device)
    got = lora_linear(x, lora, out_sizes, slots, impl="triton", config=SMALL)
    assert_rows_close(got, lora_linear(x, lora, out_sizes, slots, impl="torch"), rel_tolerance(dtype, device))
    assert (got[~_has_adapter(slots, lora)] == 0).all()


@pytest.mark.parametrize("case", CASES[1:3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_in_place(case, dtype, device, poison):
    """out=: the layer output of adapter tokens gets the delta (fp32 sum, rounded once); the bits of
    every other row are untouched (-0.0 included)."""
    x, lora, out_sizes, slots = _case(*case, dtype, device)
    y = torch.randn(x.shape[0], sum(out_sizes), device=device).to(dtype)
    y[:, ::7] = -0.0
    before = y.clone()
    got = lora_linear(x, lora, out_sizes, slots, out=y, impl="triton", config=SMALL)
    assert got is y
    base = ~_has_adapter(slots, lora)
    bits = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}[dtype]
    assert torch.equal(y[base].view(bits), before[base].view(bits))
    expected = lora_linear(x, lora, out_sizes, slots, out=before.clone(), impl="torch")
    assert_rows_close(y[~base], expected[~base], rel_tolerance(dtype, device))


def test_row_does_not_depend_on_batch(device, poison):
    """Fixed block and K split: a token's delta is the same bits alone and in a batch (blocks passed in,
    as the engine does once per step, or aligned inside)."""
    dtype = DTYPES[0]
    x, lora, out_sizes, slots = _case(40, 80, (24, 40, 40), dtype, device)
    blocks = align_tokens_by_slot(slots, lora.num_slots)
    batch = lora_linear(x, lora, out_sizes, slots, blocks=blocks, impl="triton")
    for t in (0, 5, 39):
        alone = lora_linear(x[t:t + 1], lora, out_sizes, slots[t:t + 1], impl="triton")
        assert torch.equal(alone[0], batch[t]), f"token {t} (slot {int(slots[t])}) differs alone vs in the batch"


def test_no_adapter_tokens_read_nothing(device, poison):
    """All tokens on slots whose ranks are 0 or outside the slots: zero delta, though every weight is NaN."""
    dtype = DTYPES[0]
    x, lora, out_sizes, _ = _case(19, 48, (40, 24, 24), dtype, device)
    slots = torch.tensor([3, -1, 9] * 6 + [3], dtype=torch.int32, device=device)
    nan = LinearLoRASlots(torch.full_like(lora.a, float("nan")), torch.full_like(lora.b, float("nan")), lora.ranks)
    got = lora_linear(x, nan, out_sizes, slots, impl="triton", config=SMALL)
    assert torch.equal(got, torch.zeros_like(got))


def test_rejects_bad_inputs(device):
    x, lora, out_sizes, slots = _case(4, 48, (40, 24, 24), DTYPES[0], device)
    with pytest.raises(ValueError, match=r"LinearLoRASlots.b must be"):
        lora_linear(x, lora, (40, 24, 20), slots)
    with pytest.raises(ValueError, match=r"LinearLoRASlots.a must be"):
        lora_linear(x[:, :40], lora, out_sizes, slots)
    with pytest.raises(ValueError, match="ranks must be contiguous int32"):
        lora_linear(x, LinearLoRASlots(lora.a, lora.b, lora.ranks.long()), out_sizes, slots)
    with pytest.raises(ValueError, match="token_slots must be int32"):
        lora_linear(x, lora, out_sizes, slots[:2])
    with pytest.raises(ValueError, match="out must be"):
        lora_linear(x, lora, out_sizes, slots, out=torch.zeros(4, 10, device=device))
    with pytest.raises(ValueError, match="blocks were aligned to 64 rows"):
        lora_linear(x, lora, out_sizes, slots, impl="triton", blocks=align_tokens_by_slot(slots, 4, 64))
    with pytest.raises(ValueError, match="impl must be"):
        lora_linear(x, lora, out_sizes, slots, impl="cuda")
