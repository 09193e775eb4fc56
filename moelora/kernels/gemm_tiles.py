"""Pieces shared by the dense GEMM (linear) and the grouped expert GEMMs (fused_moe).

Both keep a row's result independent of what it is batched with by fixing the order of its fp32
sums: one BLOCK_K per dtype (`gemm_block_k`), a K loop from 0 to K in BLOCK_K steps into one
accumulator (`gemm_loop`), no split-K that follows the batch (linear's K splits are fixed by N and
K). Tile sizes along M and N, the swizzle, warps and stages may follow the batch: they change which
program computes a row, not the order of its sums.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

SMEM_BYTES = 232448  # shared memory one program may take on an H100 / H200 (Triton's "Hardware limit")
# A round of sum_loads_in_order loads at most this many fp32 elements a program: 64 registers a thread on 4 warps
# (32 partials of a 16 x 16 tile). Each round is a round trip to L2 that the program waits for.
SUM_ROUND_ELEMENTS = 8192
TMA_ALIGN_BYTES = 16  # the copy engine's alignment of a tensor's start and of its strides but the last


def tma_descriptor(t: torch.Tensor, block: tuple[int, ...]) -> TensorDescriptor | None:
    """A descriptor through which a kernel loads `block` tiles of t with the copy engine (TMA; a tile's elements
    past t's edges read as zeros), or None where it cannot: a device without one (`has_copy_engine`), t's last
    dimension not contiguous, or its start or another stride not TMA_ALIGN_BYTES aligned."""
    if not has_copy_engine(t.device) or t.stride(-1) != 1 or t.data_ptr() % TMA_ALIGN_BYTES or \
            any(stride * t.element_size() % TMA_ALIGN_BYTES for stride in t.stride()[:-1]):
        return None
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))


def has_copy_engine(device: torch.device) -> bool:
    """Whether kernels on `device` load tiles by TMA: NVIDIA GPUs from Hopper on, and the CPU, where kernels run in
    Triton's interpreter (tests), which emulates it."""
    if device.type != "cuda":
        return device.type == "cpu"
    return _tma_capable(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _tma_capable(device_index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] >= 9


def stages_that_fit(rows: int, block_k: int, stages: int) -> int:
    """`stages`, or fewer where a software pipeline of `rows` rows of BLOCK_K 16-bit columns a stage (a buffer per
    stage at most, as Triton lays them out for sm_90) would not fit in SMEM_BYTES; at least 1. Fewer stages change
    no sum's order."""
    return max(1, min(stages, SMEM_BYTES // (rows * block_k * 2)))


def zeroed_counters(store: dict[torch.device, torch.Tensor], size: int, device: torch.device,
                    owner: str) -> torch.Tensor:
    """`size` int32 counters on `device`, zeroed once when made and kept in `store`: the kernels that count in
    them put every counter they used back to 0 before their launch ends, so each launch finds them zero with no
    memset of its own (CUDA graphs too). Never replaced or freed, as captured graphs hold its address; launches
    that may overlap (other streams) must not both count in one store."""
    if device not in store:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{owner}: run a call once before capturing a CUDA graph "
                               "(its zeroed counters are made outside the capture)")
        store[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return store[device]


def gemm_block_k(dtype: torch.dtype) -> int:
    """The one BLOCK_K of every GEMM config for `dtype` (fp32 tiles are twice the bytes)."""
    return 32 if dtype == torch.float32 else 64


@triton.jit
def grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid`: GROUP_M consecutive row blocks walk the n-tiles together,
    so they share each weight tile through L2."""
    first_m = pid // (GROUP_M * num_n) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_size
    pid_n = (pid % (GROUP_M * num_n)) // group_size
    return pid_m, pid_n


@triton.jit
def gemm_loop(in_ptrs, row_ok, K, w1_ptrs, w2_ptrs, n_mask, DUAL: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc_i = in @ W_i^T over K (two weight streams sharing the input when DUAL: gate and up).
    in_ptrs [BLOCK_M, BLOCK_K] and w_ptrs [BLOCK_K, BLOCK_N] point at column 0 of the input rows and
    of the weight rows (K contiguous)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k < K)[:, None]
        xt = tl.load(in_ptrs + k0, mask=row_ok[:, None] & k_mask.T, other=0.0)
        acc1 += tl.dot(xt, tl.load(w1_ptrs + k0, mask=k_mask & n_mask[None, :], other=0.0))
        if DUAL:
            acc2 += tl.dot(xt, tl.load(w2_ptrs + k0, mask=k_mask & n_mask[None, :], other=0.0))
    return acc1, acc2


@triton.jit
def gemm_loop_tma(in_ptrs, row_ok, K, w_desc, e, n1, n2, DUAL: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """gemm_loop with W's tiles loaded by the copy engine through w_desc [E, N, K] (tiles [1, BLOCK_N, BLOCK_K]):
    rows n1.. (and n2.. when DUAL) of expert e. The input rows, gathered, by pointers."""
    offs_k = tl.arange(0, BLOCK_K)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xt = tl.load(in_ptrs + k0, mask=row_ok[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
        acc1 += tl.dot(xt, tl.reshape(w_desc.load([e, n1, k0]), (BLOCK_N, BLOCK_K)).T)
        if DUAL:
            acc2 += tl.dot(xt, tl.reshape(w_desc.load([e, n2, k0]), (BLOCK_N, BLOCK_K)).T)
    return acc1, acc2


@triton.constexpr_function
def loads_a_round(n: int, tile_elements: int) -> int:
    """How many of n partials of tile_elements each sum_loads_in_order loads a round: SUM_ROUND_ELEMENTS' worth,
    at least one, no more than n."""
    return max(1, min(n, SUM_ROUND_ELEMENTS // tile_elements))


@triton.jit
def sum_loads_in_order(ptrs, stride, mask, n, ROUND: tl.constexpr, CACHE: tl.constexpr = ""):
    """0 + load(ptrs) + load(ptrs + stride) + ... + load(ptrs + (n - 1) * stride) in fp32, added in that order (an
    order no tiling can change, so every kernel that sums the same partials gets the same bits); masked elements
    are 0. A round's ROUND loads all go out before its first add waits for one: written as a load then an add per
    partial, the PTX alternates the two and ptxas keeps about four loads in flight, a round trip to L2 every four.
    CACHE ".cg": partials that other programs of the launch wrote, read from L2 (never a stale L1 line)."""
    acc = tl.zeros(ptrs.shape, dtype=tl.float32)
    index = tl.zeros(ptrs.shape, dtype=tl.int32)  # of the partial, as a tensor: the interpreter masks with tensors
    for i0 in range(0, n, ROUND):
        loaded = ()
        for i in tl.static_range(ROUND):
            loaded = loaded + (tl.load(ptrs + (i0 + i) * stride, mask=mask & (index + i0 + i < n), other=0.0,
                                       cache_modifier=CACHE),)
        for i in tl.static_range(ROUND):
            acc += loaded[i]
    return acc


@triton.jit
def arrive(counter_ptrs, mask=None):
    """Count this program in at counter_ptrs (atomic, acq_rel, gpu scope) and return the counts before it:
    the program that sees the last count may then read what the others wrote. The barriers put the whole
    CTA's stores before the release and its loads after the acquire (each atomic is one thread's); read
    the others' data with cache_modifier=".cg", from L2, never a stale L1 line."""
    tl.debug_barrier()
    before = tl.atomic_add(counter_ptrs, 1, mask=mask, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    return before


@triton.jit
def wait_arrivals(counter_ptr, arrivals, num_readers):
    """Wait until `arrivals` programs have counted in at counter_ptr with `arrive`. The counting programs must
    have lower program ids than every waiting one: the hardware dispatches them first and they never wait, so
    they finish whatever the waiting programs do. Then each of the num_readers waiting programs counts itself
    in (acquire: read what the arrivals wrote after it, with cache_modifier=".cg"; the barrier puts every
    thread's loads after it); the last one, after which no program of the launch touches the counter, puts it
    back to 0 for the next launch (no memset launch). The wait polls with plain loads, which do not queue with
    the arrivals' atomics on the counter's address as polling atomics do. Each warp polls on its own, and one
    thread counts the program in: the barrier behind the poll keeps it from counting in while a warp of its
    program still polls (one that came late from a load before the wait), which could then read the 0 that the
    last reader puts back, and wait forever."""
    while tl.load(counter_ptr, volatile=True) < arrivals:
        pass
    tl.debug_barrier()
    if tl.atomic_add(counter_ptr, 1, sem="acquire", scope="gpu") == arrivals + num_readers - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    tl.debug_barrier()
