"""The block-row helpers of the fused MoE's LoRA epilogues, on their own (the kernels' results test them too,
but a run visited twice or skipped only shows there as a wrong delta in some rows)."""
import pytest
import torch
import triton
import triton.language as tl

from moelora.kernels.fused_moe.tiles import adapter_slots, next_run_slot, previous_row_slots, slot_runs
from moelora.kernels.moe_align import moe_align_reference


@triton.jit
def _runs_kernel(sorted_ids_ptr, block_expert_ptr, token_slots_ptr, ranks_ptr, out_ptr, num_pairs, top_k,
                 num_slots, num_experts, BLOCK_M: tl.constexpr, MAX_RUNS: tl.constexpr):
    """out[block] = [number of runs, the runs' slots in order, then what next_run_slot gives past the last]."""
    pid_m = tl.program_id(0)
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    slot = adapter_slots(tl.load(token_slots_ptr + pair // top_k, mask=pair < num_pairs, other=-1), num_slots)
    prev = previous_row_slots(sorted_ids_ptr, token_slots_ptr, pid_m, num_pairs, top_k, num_slots, BLOCK_M,
                              BLOCK_M, False)
    e = tl.load(block_expert_ptr + pid_m)
    rank = tl.load(ranks_ptr + slot * num_experts + e, mask=slot >= 0, other=0)
    start, s, num = slot_runs(slot, prev, rank, num_slots)
    out = out_ptr + pid_m * (MAX_RUNS + 2)
    tl.store(out, num)
    for i in tl.static_range(1, MAX_RUNS + 2):
        tl.store(out + i, s)
        s = next_run_slot(slot, start, s, num_slots)


@pytest.mark.parametrize("block_m", [16, 64])
def test_runs_are_the_covered_slots_of_a_block_in_order(block_m, device):
    """Blocks of moe_align's order (per expert: base rows first, then the slots' rows in order, padding last):
    the runs are the slots present in the block whose rank on its expert is above 0, each once, in order; past
    the last run the slot is num_slots. Out-of-range token slots count as no adapter."""
    gen = torch.Generator().manual_seed(block_m)
    num_experts, num_slots, top_k = 4, 8, 2
    for _ in range(10):
        tokens = int(torch.randint(1, 160, (1,), generator=gen))
        ids = torch.randint(0, num_experts, (tokens, top_k), generator=gen, dtype=torch.int32)
        token_slots = torch.randint(-1, num_slots + 2, (tokens,), generator=gen, dtype=torch.int32)
        ranks = torch.randint(0, 3, (num_slots, num_experts), generator=gen, dtype=torch.int32) * 16
        blocks = moe_align_reference(ids, token_slots, num_experts, num_slots, block_m)
        num_blocks = int(blocks.num_rows) // block_m
        out = torch.full((num_blocks, num_slots + 2), -7, dtype=torch.int32, device=device)
        _runs_kernel[(num_blocks,)](blocks.sorted_ids.to(device), blocks.block_expert.to(device),
                                    token_slots.to(device), ranks.to(device), out, tokens * top_k, top_k, num_slots,
                                    num_experts, BLOCK_M=block_m, MAX_RUNS=num_slots)
        for b, got in enumerate(out.cpu().tolist()):
            pairs = blocks.sorted_ids[b * block_m:(b + 1) * block_m].long()
            e = int(blocks.block_expert[b])
            slots = token_slots[pairs[pairs < tokens * top_k] // top_k].tolist()
            expected = sorted({s for s in slots if 0 <= s < num_slots and ranks[s, e] > 0})
            assert got[0] == len(expected), (b, slots, ranks[:, e].tolist())
            assert got[1:len(expected) + 1] == expected, (b, slots, ranks[:, e].tolist())
            assert got[len(expected) + 1] == num_slots
