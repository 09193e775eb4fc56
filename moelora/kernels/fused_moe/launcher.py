"""fused_moe_triton: picks the path (pair blocks, or aligned blocks with the shrink per pair or per segment) and
launches the kernels of one MoE block."""
from __future__ import annotations

import torch
import triton

from moelora.core import ExpertLoRASlots, TopKOutput
from moelora.kernels.fused_moe.config import (DOWN_SHRINK_PART, SHRINK_SPLIT_K, SUM_PARTS, MoEKernelConfig,
                                              default_config, down_sum_parts, for_rank_tile, serial_shrink)
from moelora.kernels.fused_moe.gemm import down_kernel, gate_up_kernel
from moelora.kernels.fused_moe.reduction import moe_sum_kernel, reduce_partials
from moelora.kernels.fused_moe.shrink import down_shrink_kernel, pair_shrink_kernel, shrink_kernel
from moelora.kernels.gemm_tiles import tma_descriptor, zeroed_counters
from moelora.kernels.lora_tiles import LORA_RANK_CHUNK, rank_tile, rank_tile_count
from moelora.kernels.moe_align import AlignedBlocks, CHUNK, align_num_warps, alloc_aligned, key_tile, moe_align
from moelora.kernels.pdl import pdl_launch

# Pair blocks with LoRA: a ready counter per pair (the gate/up shrink done), in a per-device buffer zeroed once
# and put back to 0 by each launch's last reader of each counter; default configs use at most 2 * top_k.
READY_COUNTERS = 4096
_ready: dict[torch.device, torch.Tensor] = {}


def rows_start_on_16_bytes(*weights: torch.Tensor) -> bool:
    """Whether every row (along the last dimension) of each weight starts on 16 bytes (the shrink's A_ALIGNED)."""
    return all(w.data_ptr() % 16 == 0 and all(stride * w.element_size() % 16 == 0 for stride in w.stride()[:-1])
               for w in weights)


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk: TopKOutput,
    lora: ExpertLoRASlots | None = None,
    token_slots: torch.Tensor | None = None,
    config: MoEKernelConfig | None = None,
) -> torch.Tensor:
    num_tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    top_k = topk.ids.shape[1]
    num_pairs = num_tokens * top_k
    cfg = config or default_config(num_tokens, top_k, num_experts, x.dtype, lora=lora is not None)
    if lora is not None:
        block_r = rank_tile(lora.max_rank_in_use or lora.a_gate.shape[2])
        cfg = for_rank_tile(cfg, block_r)
    if lora is not None and cfg.block_n_gate_up not in (DOWN_SHRINK_PART, 2 * DOWN_SHRINK_PART):
        raise ValueError(f"with LoRA the gate_up n tile must be {DOWN_SHRINK_PART} or {2 * DOWN_SHRINK_PART} "
                         f"columns (one or two down-shrink parts), got {cfg.block_n_gate_up}")
    if num_tokens == 0:  # a rank that receives no pairs (expert parallelism): nothing to launch, and the
        return torch.empty_like(x)  # launches' sizes below divide by the number of pairs and programs
    num_slots = lora.num_slots if lora is not None else 0
    num_n_gate_up = triton.cdiv(inter, cfg.block_n_gate_up)
    num_hd_parts = triton.cdiv(inter, DOWN_SHRINK_PART)
    num_n_down = triton.cdiv(hidden, cfg.block_n_down)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    y = torch.empty_like(x)
    # with pair blocks the down kernel sums the top-k itself: arrival counters, zeroed by gate_up
    counters = torch.empty(num_tokens * num_n_down if cfg.pair_blocks else 1, dtype=torch.int32, device=x.device)
    pdl = pdl_launch(x.device)
    common = dict(HAS_LORA=lora is not None, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                  PARTS=SUM_PARTS, PAIR_BLOCKS=cfg.pair_blocks, HALF_TILES=cfg.half_tiles,
                  SLOT_STAGES=cfg.slot_stages,
                  TOP_K_P=triton.next_power_of_2(top_k), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl)
    if cfg.pair_blocks:  # block p = pair p: its expert is topk.ids[p]; no sorted ids or row count to read
        blocks = AlignedBlocks(topk.ids, topk.ids.view(-1), topk.ids, cfg.block_m)
    num_shrink, ready = 0, topk.ids  # gate/up shrink programs in the gate_up launch (then it reads `ready`)
    down_shrink_launch = False  # the down shrink in a launch of its own (needs the segments), else in gate_up
    if lora is None:  # HAS_LORA=False never reads these
        if not cfg.pair_blocks:
            blocks = moe_align(topk.ids, None, num_experts, 0, cfg.block_m)
        slots = ranks = topk.ids
        xa = hd = ag = au = bg = bu = ad = bd = w13
        num_splits, block_r, rank_tiles, a_aligned = 1, LORA_RANK_CHUNK, 1, False
        a_strides = b_strides = ad_strides = bd_strides = (0, 0)
    else:
        slots, ranks = token_slots, lora.ranks
        ag, au, bg, bu, ad, bd = lora.a_gate, lora.a_up, lora.b_gate, lora.b_up, lora.a_down, lora.b_down
        # each block's LoRA runs on the smallest of the rank tiles 16, 32, ..., block_r that holds its ranks
        rank_tiles = rank_tile_count(block_r)
        a_strides, b_strides = ag.stride()[1:3], bg.stride()[1:3]
        a_aligned = rows_start_on_16_bytes(ag, au)
        ad_strides, bd_strides = ad.stride()[1:3], bd.stride()[1:3]
        num_splits = triton.cdiv(hidden, SHRINK_SPLIT_K)
        serial_splits = serial_shrink(cfg, num_pairs, block_r)  # the segment shrink adds its K splits up itself
        if serial_splits:
            num_splits = 1
        xa = torch.empty(num_pairs, 2, num_splits, block_r, dtype=torch.float32, device=x.device)
        if cfg.pair_blocks:  # the shrink runs in the gate_up launch, its GEMM programs wait on a counter per pair
            if num_pairs > READY_COUNTERS:
                raise ValueError(f"pair blocks with LoRA on {num_pairs} pairs: more than the {READY_COUNTERS} counters")
            ready = zeroed_counters(_ready, READY_COUNTERS, x.device, "fused_moe pair blocks with LoRA")
            num_shrink = num_pairs * num_splits
        elif num_pairs <= cfg.pair_shrink_max_pairs:  # one launch: the alignment and a shrink per pair
            blocks, cursor = alloc_aligned(num_pairs, num_experts, num_slots, cfg.block_m, x.device)
            e_p, s1_p = key_tile(num_experts, num_slots)
            pair_shrink_kernel[(1 + num_pairs * num_splits,)](
                topk.ids, slots, blocks.sorted_ids, blocks.block_expert, blocks.num_rows, cursor,
                x, xa, ranks, ag, au,
                num_pairs, top_k, hidden, num_slots, num_experts, blocks.sorted_ids.numel(), num_splits,
                x.stride(0), *a_strides,
                BLOCK_M=cfg.block_m, E_P=e_p, S1_P=s1_p, CHUNK=CHUNK, SHRINK_ROWS=cfg.shrink_rows,
                BLOCK_K=cfg.block_k, BLOCK_R=block_r, SPLIT_K=SHRINK_SPLIT_K, RANK_TILES=rank_tiles,
                A_ALIGNED=a_aligned,
                num_warps=align_num_warps(num_experts, num_slots), **pdl,
            )
        else:
            down_shrink_launch = cfg.down_shrink_launch
            blocks = moe_align(topk.ids, token_slots, num_experts, num_slots, cfg.block_m, cfg.segment_rows)
            max_segs = blocks.segments.shape[1]
            # a launch per rank tile, each compiled for its tile alone (shrink_kernel's TILE; -1: all tiles)
            for tile in range(rank_tiles) if cfg.shrink_per_rank_tile else (-1,):
                shrink_kernel[(max_segs, num_splits)](
                    x, xa, blocks.sorted_ids, blocks.segments, blocks.num_segments, ranks, ag, au,
                    num_pairs, top_k, hidden, num_slots, num_experts, num_splits, max_segs, x.stride(0), *a_strides,
                    SHRINK_ROWS=cfg.shrink_rows, BLOCK_K=cfg.block_k, BLOCK_R=block_r, SPLIT_K=SHRINK_SPLIT_K,
                    RANK_TILES=rank_tiles, A_ALIGNED=a_aligned, TILE=tile, SERIAL=serial_splits,
                    num_warps=cfg.shrink_num_warps,
                    num_stages=cfg.shrink_num_stages, **pdl,
                )
        if not cfg.pair_blocks:  # (with pair blocks xa is written in the gate_up launch that reads it)
            xa, num_splits = reduce_partials(xa.view(num_pairs * 2, num_splits, block_r), topk.ids, slots, ranks, 0,
                                             num_pairs >= cfg.reduce_partials_min_pairs)
        if down_shrink_launch:  # its sum over the parts, as reduce_partials leaves it
            num_hd_parts = 1
        hd = torch.empty(num_pairs, num_hd_parts, block_r, dtype=torch.float32, device=x.device)
    # aligned blocks whose LoRA partials are one part run each run's LoRA in steps of 16 ranks (the kernels' CHUNKS),
    # the others each block's on one rank tile; the register cap is for the larger rank tiles' epilogues
    chunks_gate_up = lora is not None and not cfg.pair_blocks and num_splits == 1
    chunks_down = lora is not None and not cfg.pair_blocks and num_hd_parts == 1
    regs = {} if cfg.max_registers is None or rank_tiles == 1 else {"maxnreg": cfg.max_registers}
    num_m = blocks.block_expert.numel()
    grid_gate_up = num_m * num_n_gate_up
    # W through the copy engine where it can (cfg.tma): its descriptor goes where the pointer would
    w13_desc = tma_descriptor(w13, (1, cfg.block_n_gate_up, cfg.block_k)) if cfg.tma else None
    w2_desc = tma_descriptor(w2, (1, cfg.block_n_down, cfg.block_k)) if cfg.tma else None
    gate_up_kernel[(num_shrink + grid_gate_up,)](
        x, w13 if w13_desc is None else w13_desc, h, blocks.sorted_ids, blocks.block_expert, blocks.num_rows, slots,
        ranks, xa, ag, au, bg, bu, ad, hd, ready, topk.ids, counters, y,
        num_pairs, num_tokens, top_k, hidden, inter, num_slots, num_experts, num_splits, num_n_down,
        triton.cdiv(num_tokens, grid_gate_up),
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0), *a_strides, *b_strides, *ad_strides, y.stride(0),
        BLOCK_N=cfg.block_n_gate_up, BLOCK_R=block_r, SPLIT_K=SHRINK_SPLIT_K, PART_N=DOWN_SHRINK_PART,
        RANK_TILES=rank_tiles, CHUNKS=chunks_gate_up, A_ALIGNED=a_aligned, SHRINK_ROWS=cfg.shrink_rows,
        DOWN_SHRINK=not down_shrink_launch, TMA=w13_desc is not None, **common, **({} if chunks_gate_up else regs),
    )
    if down_shrink_launch:
        down_shrink_kernel[(max_segs,)](
            h, hd, blocks.sorted_ids, blocks.segments, blocks.num_segments, ranks, ad,
            num_pairs, inter, num_slots, num_experts, max_segs, h.stride(0), *ad_strides,
            SHRINK_ROWS=cfg.shrink_rows, PART_N=DOWN_SHRINK_PART, BLOCK_R=block_r, RANK_TILES=rank_tiles,
            num_warps=cfg.shrink_num_warps, num_stages=cfg.shrink_num_stages, **pdl,
        )
    elif lora is not None:
        hd, num_hd_parts = reduce_partials(hd, topk.ids, slots, ranks, 2, num_pairs >= cfg.reduce_partials_min_pairs)
    down_kernel[(num_m * num_n_down,)](
        h, w2 if w2_desc is None else w2_desc, out, topk.weights, blocks.sorted_ids, blocks.block_expert,
        blocks.num_rows, slots, ranks, hd, bd, topk.ids, counters, y,
        num_pairs, top_k, hidden, inter, num_slots, num_experts, num_hd_parts,
        h.stride(0), w2.stride(0), w2.stride(1), out.stride(0), *bd_strides, y.stride(0),
        BLOCK_N=cfg.block_n_down, BLOCK_R=block_r, RANK_TILES=rank_tiles, CHUNKS=chunks_down, TMA=w2_desc is not None,
        **(common | {"PARTS": down_sum_parts(cfg.block_m, num_hd_parts)}), **({} if chunks_down else regs),
    )
    if not cfg.pair_blocks:
        block_h = min(1024, triton.next_power_of_2(hidden))
        moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
            out, topk.ids, y, hidden, top_k, num_experts, out.stride(0), y.stride(0),
            TOP_K_P=triton.next_power_of_2(top_k), BLOCK_H=block_h, **pdl,
        )
    return y
