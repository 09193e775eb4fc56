"""sum_in_order: the Triton kernel equals its torch reference bit for bit, adds the parts in their order (values
chosen so that any other order rounds differently), writes every output element and nothing past it, reads nothing
past the parts, and gives an element the same bits whatever the size of the tensor around it."""
import pytest
import torch

from moelora.kernels.sum_in_order import BLOCK, sum_in_order

# the interpreter rounds fp32 -> bf16 toward zero (GPUs: to nearest), so bf16 outputs are compared on GPUs only
OUT_DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])
PART_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.itemsize])


def _sum(parts: torch.Tensor, out_dtype: torch.dtype, impl: str) -> torch.Tensor:
    """out in the middle of a NaN-filled buffer, parts followed by NaNs: out's elements must all be written, the
    rest of the buffer none, and no NaN past the parts may be read into the sums."""
    n = parts[0].numel()
    buffer = torch.full((n + 2 * BLOCK,), float("nan"), dtype=out_dtype, device=parts.device)
    out = buffer[BLOCK:BLOCK + n].view(parts.shape[1:])
    padded = torch.full((parts.numel() + BLOCK,), float("nan"), dtype=parts.dtype, device=parts.device)
    padded[:parts.numel()] = parts.flatten()
    assert sum_in_order(padded[:parts.numel()].view(parts.shape), out, impl=impl) is out
    assert torch.isnan(buffer[:BLOCK]).all() and torch.isnan(buffer[BLOCK + n:]).all(), "wrote past out"
    return out


@pytest.mark.parametrize("parts_count", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(1, 64), (3, 2048), (5, 1000), (BLOCK + 1,)])
@pytest.mark.parametrize("part_dtype", PART_DTYPES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_matches_reference(parts_count, shape, part_dtype, out_dtype, device):
    seed = torch.seed()
    gen = torch.Generator().manual_seed(seed)
    # magnitudes 2^-8..2^8: the sums' roundings depend on their order
    parts = (torch.randn(parts_count, *shape, generator=gen) * 2.0 ** torch.randint(-8, 9, (parts_count, *shape),
                                                                                       generator=gen))
    parts = parts.to(part_dtype).to(device)
    got, want = _sum(parts, out_dtype, "triton"), _sum(parts, out_dtype, "torch")
    assert not torch.isnan(got).any(), f"an element was not written, or a NaN past the parts was read (seed {seed})"
    assert torch.equal(_bits(got), _bits(want)), f"the kernel's sums differ from the reference's (seed {seed})"
    close = parts.double().sum(0)
    assert torch.allclose(got.double(), close, rtol=4 * torch.finfo(out_dtype).eps, atol=1e-3), \
        f"far from the exact sum (seed {seed})"


def test_adds_in_the_parts_order(device):
    # 2^24 + 1 rounds to 2^24 in fp32: in order ((2^24 + 1) - 2^24) + 1 = 1; any other order that meets the two
    # large ones first gives 2
    parts = torch.tensor([[2.0**24], [1.0], [-2.0**24], [1.0]], dtype=torch.float32, device=device)
    for impl in ("triton", "torch"):
        assert _sum(parts, torch.float32, impl).item() == 1.0, impl
        assert _sum(parts[[0, 2, 1, 3]], torch.float32, impl).item() == 2.0, impl


def test_an_element_does_not_depend_on_the_tensor_around_it(device):
    seed = torch.seed()
    gen = torch.Generator().manual_seed(seed)
    parts = (torch.randn(4, 37, 96, generator=gen) * 100).to(torch.float16).to(device)
    whole = _sum(parts, torch.float32, "triton")
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20)):
        assert torch.equal(_sum(parts[:, rows].contiguous(), torch.float32, "triton"), whole[rows]), f"seed {seed}"


@pytest.mark.parametrize("parts_count", [1, 3, 8])
def test_sums_a_middle_dimension_of_a_transposed_view(parts_count, device):
    """parts [R, P, C] transposed to [P, R, C] (strides C, P * C, 1): out[r] = parts[r, 0] + parts[r, 1] + ..."""
    seed = torch.seed()
    gen = torch.Generator().manual_seed(seed)
    rows = (torch.randn(7, parts_count, 300, generator=gen) * 64).to(torch.float16).to(device)
    got = sum_in_order(rows.transpose(0, 1), torch.empty(7, 300, device=device), impl="triton")
    want = sum_in_order(rows.transpose(0, 1).contiguous(), torch.empty(7, 300, device=device), impl="torch")
    assert torch.equal(got, want), f"seed {seed}"


def test_refuses_mismatched_shapes(device):
    with pytest.raises(ValueError, match=r"parts must be floating point \[P, \*\(3, 4\)\]"):
        sum_in_order(torch.zeros(2, 3, 5, device=device), torch.zeros(3, 4, device=device))
    with pytest.raises(ValueError, match="parts must be"):
        sum_in_order(torch.zeros(0, 3, 4, device=device), torch.zeros(3, 4, device=device))
    with pytest.raises(ValueError, match="of unit stride"):
        sum_in_order(torch.zeros(2, 4, 3, device=device).transpose(1, 2), torch.zeros(3, 4, device=device))
    with pytest.raises(ValueError, match="impl must be"):
        sum_in_order(torch.zeros(2, 3, device=device), torch.zeros(3, device=device), impl="cuda")
