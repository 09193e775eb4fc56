"""Compile every Triton kernel for Hopper (sm_90) on the CPU machine, with Triton's bundled ptxas.

The interpreter runs kernels as numpy and misses what only the compiler sees (types in branches
that a constexpr should remove, illegal dot shapes, shared memory over the limit, loops that do not
software-pipeline). Arguments are annotated as 16-divisible, as Triton specialises them at launch
for the real model shapes. The compiler runs in a subprocess: the test session itself has Triton in
interpreter mode.
"""
import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moelora.kernels import attention as at
from moelora.kernels.fused_moe import config as fm_config
from moelora.kernels.fused_moe import gemm as fm_gemm
from moelora.kernels.fused_moe import reduction as fm_reduction
from moelora.kernels.fused_moe import shrink as fm_shrink
from moelora.kernels.gemm_tiles import gemm_block_k
from moelora.kernels.lora_tiles import LORA_RANK_CHUNK
from moelora.kernels import kv_store as kv
from moelora.kernels import linear as li
from moelora.kernels import lora_linear as ll
from moelora.kernels import moe_align as ma
from moelora.kernels import rms_norm as rn
from moelora.kernels import rope_kv_store as rk
from moelora.kernels import rotary as ro
from moelora.kernels import sum_in_order as so
from moelora.kernels import topk as tk

HOPPER = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 227 * 1024
INT_PTRS = {"sorted_ids_ptr", "block_expert_ptr", "block_slot_ptr", "num_rows_ptr", "ranks_ptr", "topk_ids_ptr",
            "token_slots_ptr", "cursor_ptr", "counter_ptr", "ready_ptr", "req_to_token_ptr", "req_pool_ptr", "seq_lens_ptr",
            "extend_lens_ptr", "extend_starts_ptr", "blocks_ptr", "ids_ptr", "lora_ranks_ptr", "slots_ptr",
            "segments_ptr", "num_segments_ptr"}
FP32_PTRS = {"topk_weights_ptr", "xa_ptr", "hd_ptr", "mid_o_ptr", "mid_lse_ptr", "inv_freq_ptr", "bias_ptr",
             "weights_ptr"}
FP32_SCALARS = {"qk_scale", "scale", "routed_scaling_factor", "eps", "q_eps", "k_eps"}
NOT_DIVISIBLE = {"num_pairs", "top_k", "num_slots", "num_experts", "max_rows", "group", "num_q_heads", "max_splits",
                 "qk_scale", "num_tokens", "num_splits", "num_hd_parts", "num_k_heads", "stride_lt", "scale",
                 "rows_per_token", "num_parts", "num_n_down", "tokens_per_program", "routed_scaling_factor", "num_heads", "eps", "M",
                 "num_kv_heads", "q_eps", "k_eps", "max_segs"}
# Mixtral-8x7B's I = 14336 in parts of the down shrink: the down epilogue's most parts a round (config.down_sum_parts)
MOST_DOWN_SHRINK_PARTS = 14336 // fm_config.DOWN_SHRINK_PART
ATTENTION_HEADS = ((128, 128, 8), (192, 128, 1), (64, 64, 4))  # Dk, Dv, q heads per kv head: Qwen3, MLA, small
LORA_LINEARS = ((2048, (4096, 512, 512), 16), (2048, (4096, 512, 512), 64), (4096, (2048,), 16))  # Qwen3-30B-A3B
#                 qkv and o: in features, out sizes, rank tile
# q heads, k heads, rotary dims, interleaved: Qwen3-30B-A3B, DeepSeek-V3
ROTARY_HEADS = ((32, 4, 128, False), (128, 1, 64, True))
# experts, k, sigmoid, correction bias, groups, topk_group: Qwen3-30B-A3B, DeepSeek-V2-Lite grouped, -V2, -V3
ROUTERS = ((128, 8, False, False, 1, 1), (64, 6, False, False, 8, 3), (160, 6, False, False, 8, 3),
           (256, 8, True, True, 8, 4))
RMS_NORMS = (2048, 4096, 7168, 128, 512)  # D (the config depends on nothing else): hidden of Qwen3-30B-A3B,
#           Mixtral, DeepSeek-V3 (the largest block); Qwen3's per-head q and k; the MLA kv latent
# head_dim, per-head q/k norm, interleaved: Qwen3-30B-A3B; Mixtral, Qwen2-MoE, OLMoE; a small interleaved one
ROPE_KV_STORES = ((128, True, False), (128, False, False), (64, True, True))
# M, N, K: the dense GEMM's default tiles: decode (16 x 16, 16 x 32), medium (64 x 64), prefill on 4 warps
# (64 x 128, o_proj's N = 2048) and on 8 (128 x 256); Qwen3-30B-A3B's o_proj (2 K splits: in parallel at
# decode, one after the other at prefill), qkv (1) and router (16, in parallel at decode, serial at prefill)
LINEARS = ((1, 2048, 4096), (1, 5120, 2048), (100, 5120, 2048), (512, 2048, 4096), (4096, 5120, 2048),
           (1, 128, 2048), (4096, 128, 2048))
# M, N, K, out parts of the GEMM with the LoRA epilogue: Qwen3-30B-A3B's qkv and o_proj at decode (o_proj also at 32
# rows: its slots loaded before the K loop) and prefill
LORA_EPILOGUES = ((1, 5120, 2048, (4096, 512, 512)), (4096, 5120, 2048, (4096, 512, 512)), (1, 2048, 4096, (2048,)),
                  (32, 2048, 4096, (2048,)), (4096, 2048, 4096, (2048,)))
KV_STORES = ((4, 128, 128), (1, 192, 128), (16, 192, 128), (128, 192, 128), (2, 80, 80))  # kv heads, Dk, Dv: Qwen3,
#           MLA as one head, DeepSeek-V2-Lite and -V3 (a kv head per query head), non-power-of-two dims


def compile_sm90(kernel, constexprs: dict, dtype: str, num_warps: int, num_stages: int, types: dict | None = None,
                 maxnreg: int | None = None):
    """types: argument types that differ from the defaults below (e.g. an fp32 output); maxnreg: the launch's
    register cap. Every kernel is compiled with programmatic dependent launch on, as on Hopper, and must wait for
    the kernel before it (kernels/pdl.py)."""
    assert "PDL" in kernel.arg_names, f"{kernel.fn.__name__} has no PDL constexpr"
    constexprs = {**constexprs, "PDL": True}
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if types and name in types:
            signature[name] = types[name]
        elif name.endswith("_ptr"):
            signature[name] = "*i32" if name in INT_PTRS else "*fp32" if name in FP32_PTRS else f"*{dtype}"
        else:
            signature[name] = "fp32" if name in FP32_SCALARS else "i32"
        if name not in NOT_DIVISIBLE and not signature[name].startswith("tensordesc"):  # a descriptor: no hint
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=HOPPER,
                              options={"num_warps": num_warps, "num_stages": num_stages,
                                       **({"maxnreg": maxnreg} if maxnreg else {})})
    for instruction in ("griddepcontrol.wait", "griddepcontrol.launch_dependents"):
        assert instruction in compiled.asm["ptx"], f"{kernel.fn.__name__}: no {instruction} in its PTX"
    return compiled


def waits_as_one(ttir: str) -> bool:
    """Each spin-wait of gemm_tiles.wait_arrivals (a volatile poll, then the acquire add that counts the program in)
    has a barrier between its poll and its add: each warp polls on its own, and a program that counts itself in
    while one of its warps still polls lets the last reader put the counter back to 0 under that warp. Read in the
    TTIR, before the backend's passes: Triton 3.9 puts a barrier before a scalar atomic there itself, 3.6 does not."""
    for poll in re.finditer(r"isVolatile = true", ttir):
        add = re.compile(r"tt\.atomic_rmw add, acquire").search(ttir, poll.end())
        if add is None or not re.search(r"\b(?:gpu|ttg)\.barrier\b", ttir[poll.end():add.start()]):
            return False
    return True


def moe_gemm_constexprs(cfg, has_lora: bool, block_n: int, block_r: int = 64, rank_tiles: int = 3,
                        top_k_p: int = 8, chunks: bool | None = None) -> dict:
    """The constexprs of fused_moe's gate_up and down kernels (gate_up's own, SPLIT_K, PART_N, DOWN_SHRINK,
    besides) for a tile row, as the launcher passes them on Hopper (TMA: with `moe_weight_types`). chunks (the
    kernels' CHUNKS) unless given: LoRA on aligned blocks of more than 16 rows, whose batches (more than 16 rows an
    expert) sum their partials once (reduce_partials), as the launcher runs them."""
    if chunks is None:
        chunks = has_lora and not cfg.pair_blocks and cfg.block_m > 16
    return dict(HAS_LORA=has_lora, BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                BLOCK_R=block_r, RANK_TILES=rank_tiles, CHUNKS=chunks, PARTS=fm_config.SUM_PARTS,
                PAIR_BLOCKS=cfg.pair_blocks, HALF_TILES=cfg.half_tiles, TOP_K_P=top_k_p, SLOT_STAGES=cfg.slot_stages,
                TMA=cfg.tma)


def moe_weight_types(cfg, block_n: int, dtype: str) -> dict:
    """The argument types of fused_moe's gate_up and down kernels that differ from compile_sm90's defaults: with TMA
    the weights are the copy engine's descriptor, tiles [1, block_n, BLOCK_K]."""
    return {"w_ptr": f"tensordesc<{dtype}[1, {block_n}, {cfg.block_k}]>"} if cfg.tma else {}


def compile_moe_gemms(cfg, has_lora: bool, dtype: str, rank_tiles: int | None = None) -> list[dict]:
    """fused_moe's gate_up and down kernels of one tile row, compiled; one summary each. rank_tiles: with LoRA 3 unless
    given, else 1, as the launcher passes it; the weights through the copy engine's descriptor where cfg.tma, as on
    Hopper. launches_next_first: the PTX lets the next launch start before its first MMA (right after the PDL wait),
    not only after MMAs (at the end of each of the kernel's paths)."""
    rank_tiles = rank_tiles or (3 if has_lora else 1)
    results = []
    for kernel, block_n, own in ((fm_gemm.gate_up_kernel, cfg.block_n_gate_up,
                                  dict(SPLIT_K=fm_config.SHRINK_SPLIT_K, PART_N=fm_config.DOWN_SHRINK_PART,
                                       A_ALIGNED=has_lora, SHRINK_ROWS=cfg.shrink_rows,
                                       DOWN_SHRINK=not cfg.down_shrink_launch)),
                                 (fm_gemm.down_kernel, cfg.block_n_down,
                                  dict(PARTS=fm_config.down_sum_parts(cfg.block_m, MOST_DOWN_SHRINK_PARTS)))):
        constexprs = moe_gemm_constexprs(cfg, has_lora, block_n, LORA_RANK_CHUNK << (rank_tiles - 1), rank_tiles)
        compiled = compile_sm90(kernel, {**constexprs, **own}, dtype, cfg.num_warps, cfg.num_stages,
                                moe_weight_types(cfg, block_n, dtype))
        ptx = compiled.asm["ptx"]
        mmas = [m.start() for m in re.finditer(r"\b(?:wgmma\.mma_async|mma\.sync)", ptx)]
        results.append(dict(kernel=kernel.fn.__name__, dtype=dtype, lora=has_lora, block_m=cfg.block_m, tma=cfg.tma,
                            bulk_copies="cp.async.bulk.tensor" in ptx,
                            pair_blocks=cfg.pair_blocks, slot_stages=cfg.slot_stages, rank_tiles=rank_tiles,
                            chunks=constexprs["CHUNKS"],
                            shared=compiled.metadata.shared, ttgir=compiled.asm["ttgir"],
                            arrive="atom.global.gpu.acq_rel.add" in ptx, acquire="global.gpu.acquire" in ptx,
                            cg_loads="ld.global.cg" in ptx, waits_as_one=waits_as_one(compiled.asm["ttir"]),
                            launches_next_first=ptx.find("griddepcontrol.launch_dependents") < mmas[0]))
    return results


def compile_all() -> list[dict]:
    """Every kernel in every default config; one summary per compiled kernel."""
    results = []
    # every row of the tile table, with LoRA (pair blocks, blocks of 16, 32, 64 rows, prefill) and without (pair
    # blocks, 16, 64, 128 rows, prefill); and the 32-row LoRA one with its slot loops unpipelined, to compare
    configs = {(fm_config.default_config(tokens, 8, 128, torch.bfloat16, lora=lora), lora)
               for tokens in (1, 32, 512, 1024, 2048, 4096) for lora in (False, True)}
    configs.add((dataclasses.replace(fm_config.default_config(512, 8, 128, torch.bfloat16, lora=True), slot_stages=1),
                 True))
    for cfg, has_lora in sorted(configs, key=lambda c: (c[0].block_m, c[1])):
        for dtype in ("bf16", "fp16"):
            results += compile_moe_gemms(cfg, has_lora, dtype)
    # LoRA on the smallest rank tile alone, the pair blocks' row (the others above hold three rank tiles)
    results += compile_moe_gemms(fm_config.default_config(1, 8, 128, torch.bfloat16, lora=True), True, "bf16", 1)
    # the prefill row with the down shrink in gate_up's epilogue (its shrink per pair, or down_shrink_launch off),
    # and the 64-row row so, as it runs with fewer experts than DOWN_SHRINK_LAUNCH_MIN_EXPERTS
    prefill = fm_config.default_config(8192, 8, 128, torch.bfloat16, lora=True)
    results += compile_moe_gemms(dataclasses.replace(prefill, down_shrink_launch=False), True, "bf16")
    few_experts = fm_config.default_config(1024, 8, 64, torch.bfloat16, lora=True)
    assert few_experts.block_m == 64 and not few_experts.down_shrink_launch
    results += compile_moe_gemms(few_experts, True, "bf16")
    for kernel, constexprs in ((ma._moe_align_kernel, dict(HAS_SLOTS=True, BLOCK_M=16, E_P=256, S1_P=64, CHUNK=256,
                                                          SEGMENT_ROWS=64)),
                               (ma._count_kernel, dict(HAS_SLOTS=True, E_P=256, S1_P=16, CHUNK=256)),
                               (ma._lay_out_kernel, dict(BLOCK_M=64, E_P=256, S1_P=16, CHUNK=256, SEGMENT_ROWS=64,
                                                         MAX_COPIES=ma.max_cursor_copies(256, 15))),
                               (ma._place_kernel, dict(HAS_SLOTS=True, E_P=256, S1_P=16, CHUNK=256)),
                               (fm_shrink.shrink_kernel,
                                dict(SHRINK_ROWS=16, BLOCK_K=64, BLOCK_R=64, RANK_TILES=3, TILE=2,
                                     SPLIT_K=fm_config.SHRINK_SPLIT_K, A_ALIGNED=True, SERIAL=False)),
                               (fm_shrink.pair_shrink_kernel, dict(BLOCK_M=16, E_P=128, S1_P=16, CHUNK=256, BLOCK_K=64,
                                                                   SHRINK_ROWS=16, BLOCK_R=64, RANK_TILES=3,
                                                                   A_ALIGNED=True,
                                                                   SPLIT_K=fm_config.SHRINK_SPLIT_K)),
                               (fm_reduction.reduce_partials_kernel, dict(BLOCK_ROWS=64, BLOCK_R=16, PARTS=32)),
                               (fm_reduction.moe_sum_kernel, dict(TOP_K_P=8, BLOCK_H=1024)),
                               (so._sum_in_order_kernel, dict(PARTS=4, BLOCK=so.BLOCK))):
        compiled = compile_sm90(kernel, constexprs, "bf16", 8, 1)
        results.append(dict(kernel=kernel.fn.__name__, shared=compiled.metadata.shared, ttgir=""))
    # the segment shrink on the 16-row tile row's launch options (the deepest pipeline): with the rank-64 tiles (the
    # most shared memory), and on the rank-16 tile with rows of A known to start on 16 bytes and not; and on the
    # prefill row's tile of 128 rows with the rank-64 tiles, and on the rank-16 tile (its programs adding their K splits
    # up themselves: serial_shrink)
    for tokens, block_r, rank_tiles, aligned in ((128, 64, 3, True), (128, 16, 1, True), (128, 16, 1, False),
                                                 (8192, 64, 3, True), (8192, 16, 1, True)):
        cfg = fm_config.default_config(tokens, 8, 128, torch.bfloat16, lora=True)
        serial = fm_config.serial_shrink(cfg, tokens * 8, block_r)
        constexprs = dict(SHRINK_ROWS=cfg.shrink_rows, BLOCK_K=64, BLOCK_R=block_r, RANK_TILES=rank_tiles,
                          TILE=rank_tiles - 1, SPLIT_K=fm_config.SHRINK_SPLIT_K, A_ALIGNED=aligned, SERIAL=serial)
        compiled = compile_sm90(fm_shrink.shrink_kernel, constexprs, "bf16", cfg.shrink_num_warps,
                                cfg.shrink_num_stages)
        copies = [line for line in compiled.asm["ttgir"].splitlines() if "async_copy_global_to_local" in line]
        results.append(dict(kernel="shrink_kernel", shared=compiled.metadata.shared, block_r=block_r,
                            a_aligned=aligned, serial=serial, ttgir="",
                            x_copies=sum(f"tensor<{cfg.shrink_rows}x64x!tt.ptr" in line for line in copies),
                            a_copies=sum(f"tensor<64x{2 * block_r}x!tt.ptr" in line for line in copies)))
    # the down shrink's launch of the 64-row and the prefill rows, with the rank-64 tiles
    for tokens in (2048, 8192):
        cfg = fm_config.default_config(tokens, 8, 128, torch.bfloat16, lora=True)
        assert cfg.down_shrink_launch
        compiled = compile_sm90(fm_shrink.down_shrink_kernel,
                                dict(SHRINK_ROWS=cfg.shrink_rows, PART_N=fm_config.DOWN_SHRINK_PART, BLOCK_R=64,
                                     RANK_TILES=3), "bf16", cfg.shrink_num_warps, cfg.shrink_num_stages)
        results.append(dict(kernel="down_shrink_kernel", shrink_rows=cfg.shrink_rows,
                            shared=compiled.metadata.shared, ttgir=compiled.asm["ttgir"]))
    results += (compile_attention() + compile_lora_linear() + compile_rotary() + compile_topk() + compile_rms_norm()
                + compile_kv_store() + compile_rope_kv_store() + compile_linear())
    return results


def compile_attention() -> list[dict]:
    results = []
    for k_dim, v_dim, group in ATTENTION_HEADS:
        cfg = at.default_config(k_dim, torch.bfloat16)
        block_d, block_dpe = at._head_blocks(k_dim)
        heads = dict(DK=k_dim, DV=v_dim, BLOCK_D=block_d, BLOCK_DPE=block_dpe, BLOCK_DV=v_dim)
        for kernel, constexprs, warps, stages in (
            (at._extend_kernel, dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n), cfg.num_warps, cfg.num_stages),
            (at._decode_partial_kernel, dict(BLOCK_N=cfg.decode_block_n, BLOCK_H=max(16, group)), cfg.decode_num_warps,
             cfg.decode_num_stages),
        ):
            compiled = compile_sm90(kernel, {**constexprs, **heads}, "bf16", warps, stages)
            results.append(dict(kernel=kernel.fn.__name__, dtype="bf16", k_dim=k_dim,
                                block_m=constexprs.get("BLOCK_M", 0), shared=compiled.metadata.shared,
                                ttgir=compiled.asm["ttgir"]))
    compiled = compile_sm90(at._decode_reduce_kernel, dict(DV=128, BLOCK_N=64, BLOCK_DV=128, ROUND=8), "bf16", 1, 1)
    results.append(dict(kernel="_decode_reduce_kernel", shared=compiled.metadata.shared, ttgir=""))
    return results


def compiled_in_subprocess(function: str) -> list[dict]:
    """What this module's `function` returns, run in a Python without the interpreter mode."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    code = f"import json, tests.kernels.test_compile_sm90 as t; print(json.dumps(t.{function}()))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def compiled():
    return compiled_in_subprocess("compile_all")


def test_the_lora_epilogues_shared_memory_bound_is_the_compilers():
    """linear's LoRA epilogue plan (one dot of every slot, B loaded early or not, or dots of chunks of slots) and tile
    choice rest on a bound on one dot's shared memory: on each row of the tile table, the most stacked rows it lets
    through compile within the limit, and twice as many do not (a bound off the compiler either way fails: session
    48's H100 run, 8 slots of rank 64 on the 64 x 128 tile with the shrink in the launch, asked 320 KiB; with Triton
    3.6, 16 slots of rank 64 on the 16 x 64 decode tile asked 288 KiB), with either Triton (3.6, 3.9); the plan for 8
    slots of rank 64 compiles within it."""
    for r in compiled_in_subprocess("compile_lora_epilogue_bounds"):
        if r["fits"] is not None:
            assert (r["shared"] <= SMEM_LIMIT) == r["fits"], f"{r}: {r['shared']} B of shared memory"


def test_all_kernels_fit_shared_memory(compiled):
    assert len(compiled) == (11 * 2 * 2 + 2 + 2 + 2 + 9 + 5 + 2 + 2 * len(ATTENTION_HEADS) + 1 + 2 * len(LORA_LINEARS)
                             + len(ROTARY_HEADS) + len(ROUTERS) + 2 * len(RMS_NORMS) + 1 + len(KV_STORES) + 1
                             + len(ROPE_KV_STORES) + 1
                             + 2 * len(LINEARS) + 1 + len(LORA_EPILOGUES))
    for r in compiled:
        assert r["shared"] <= SMEM_LIMIT, f"{r}: {r['shared']} B of shared memory"


def test_grouped_gemms_pipeline_on_wgmma(compiled):
    for r in compiled:
        if r["kernel"] in ("gate_up_kernel", "down_kernel"):
            where = f"{r['kernel']} {r['dtype']} block_m={r['block_m']} lora={r['lora']}"
            assert "async_copy_global_to_local" in r["ttgir"], f"{where}: main loop is not software-pipelined"
            # the weights through the copy engine, pipelined beside the gathered rows' copies, but on pair blocks
            assert r["tma"] == (not r["pair_blocks"]) == r["bulk_copies"], where
            assert r["tma"] == ("async_tma_copy_global_to_local" in r["ttgir"]), where
            if r["block_m"] >= 64:  # wgmma works on 64-row tiles; smaller blocks use mma.sync
                assert "warp_group_dot" in r["ttgir"], f"{where}: does not use wgmma"


def test_lora_slot_loops_pipeline(compiled):
    """With slot_stages > 1 the LoRA epilogues' loops over a block's slots (here in 16-rank steps, CHUNKS) load the
    next steps' tiles asynchronously (more async copies than the same kernel without): a load nested in a branch
    of the loop body, or a loop in it, would silently stop that."""
    def copies(kernel, dtype, stages):
        [r] = [r for r in compiled if r["kernel"] == kernel and r["dtype"] == dtype and r["lora"]
               and r["block_m"] == 32 and r["slot_stages"] == stages]
        return r["ttgir"].count("async_copy_global_to_local")
    for kernel in ("gate_up_kernel", "down_kernel"):
        for dtype in ("bf16", "fp16"):
            assert copies(kernel, dtype, 4) > copies(kernel, dtype, 1), f"{kernel} {dtype}: slot loops not pipelined"


def test_shrink_loads_aligned_a_rows_asynchronously(compiled):
    """Gate and up share the shrink's dot, so its A tile picks a pointer per column; told that every row of A starts
    on 16 bytes (A_ALIGNED), the compiler loads it in vectors, as async copies in the pipeline, as many as x's.
    (Without the hint Triton 3.9 loads A through registers; 3.6 sees the alignment through the choice itself.) So
    does the serial shrink's one K loop over its splits."""
    for serial in (True, False):
        [(x_copies, a_copies)] = [(r["x_copies"], r["a_copies"]) for r in compiled if r["kernel"] == "shrink_kernel"
                                  and r.get("block_r") == 16 and r["a_aligned"] and r["serial"] == serial]
        assert x_copies > 0 and a_copies == x_copies, (serial, x_copies, a_copies)
    unaligned = [r for r in compiled if r["kernel"] == "shrink_kernel" and r.get("block_r") == 16
                 and not r["a_aligned"]]
    assert unaligned and unaligned[0]["x_copies"] == x_copies  # the hint changes A's loads only


def test_down_shrink_parts_are_dots_from_zero(compiled):
    """The down shrink's launch sums I's parts as reduce_partials sums the gate_up epilogue's parts: each part a
    dot from a zero accumulator, then added. A dot that took the running sum as its accumulator (the compiler
    fuses `sum + dot` so) would add in another order, other bits."""
    launches = [r for r in compiled if r["kernel"] == "down_shrink_kernel"]
    assert sorted(r["shrink_rows"] for r in launches) == [64, 128]
    for r in launches:
        zeros = set(re.findall(r"(%\S+) = arith.constant dense<0.000000e\+00> : tensor<\d+x\d+xf32", r["ttgir"]))
        accumulators = re.findall(r"ttng.warp_group_dot %\S+, %\S+, (%[^\s,]+)", r["ttgir"])
        assert len(accumulators) == 3, f"{r['shrink_rows']} rows: a dot per rank tile"
        assert set(accumulators) <= zeros, f"{r['shrink_rows']} rows: accumulators {accumulators}, zeros {zeros}"


def longest_load_run(ptx: str, load: str, use: str) -> int:
    """The most `load` instructions (a regex) in a row in ptx with no `use` (the arithmetic that waits on them) between
    them: how many loads a sum has in flight at once."""
    run = longest = 0
    for op in re.findall(rf"\b({load}|{use})\b", ptx):
        run = run + 1 if re.fullmatch(load, op) else 0
        longest = max(longest, run)
    return longest


def compile_down_sum_loads() -> dict:
    """The down kernel on the decode tile with LoRA (Mixtral's 32 tokens: 16-row blocks) and the parts a round of
    Mixtral's 224 down-shrink parts (config.down_sum_parts): the longest run of partial loads in its PTX with no
    add between them."""
    cfg = fm_config.default_config(32, 2, 8, torch.bfloat16, lora=True)
    parts = fm_config.down_sum_parts(cfg.block_m, MOST_DOWN_SHRINK_PARTS)
    constexprs = {**moe_gemm_constexprs(cfg, True, cfg.block_n_down, LORA_RANK_CHUNK, 1, chunks=False), "PARTS": parts}
    constexprs = {k: v for k, v in constexprs.items() if k in fm_gemm.down_kernel.arg_names}
    ptx = compile_sm90(fm_gemm.down_kernel, constexprs, "bf16", cfg.num_warps, cfg.num_stages,
                       moe_weight_types(cfg, cfg.block_n_down, "bf16")).asm["ptx"]
    return dict(parts=parts, longest_load_run=longest_load_run(ptx, r"ld\.global", r"add\.f32"))


def test_the_down_epilogue_issues_a_rounds_partial_loads_before_adding():
    """The down epilogue sums the down-shrink parts in order, a round of `parts` at a time: each round's loads all
    go out before the first add waits for one (sum_partials), so a round costs one trip to L2, not one a few
    parts (written as load-then-add per part, the PTX alternates and ptxas keeps about four in flight)."""
    r = compiled_in_subprocess("compile_down_sum_loads")
    assert r["parts"] == 32 and r["longest_load_run"] >= r["parts"], r


def compile_o_proj_sum_loads() -> dict:
    """o_proj of Qwen3-30B-A3B with its LoRA at one row, as lora_linear launches it (the shrink's K splits in the
    GEMM's first programs): the longest run of L2 loads (.cg: partials other programs wrote) in its PTX with no add
    between them."""
    m, n, k, parts = LORA_EPILOGUES[2]
    splits, _ = li.k_splits(n, k, torch.bfloat16)
    cfg = li.default_config(m, n, splits, li.LoRAEpilogue(8, 16, shrink_tile(m)))
    compiled, constexprs = compile_linear_kernel(m, n, k, "bf16", cfg, False, parts)
    return dict(shrink_splits=constexprs["SHRINK_SPLITS"],
                longest_load_run=longest_load_run(compiled.asm["ptx"], r"ld\.global\.cg", r"add\.f32"))


def test_the_dense_shrink_issues_its_partial_loads_before_adding():
    """o_proj's LoRA shrink at decode sums its 16 K splits' partials in order (gemm_tiles.sum_loads_in_order), in
    the chain that each output tile's epilogue waits for: all 16 loads go out before the first add (written as a
    load then an add per split, the PTX alternated them)."""
    r = compiled_in_subprocess("compile_o_proj_sum_loads")
    assert r["shrink_splits"] == 16 and r["longest_load_run"] >= r["shrink_splits"], r


def compile_decode_attention_loads() -> dict:
    """Decode attention for Qwen3's heads: the partial kernel's loads before its first branch (the early return of a
    split past the sequence), and the reduce's longest run of loads with no exp2 between them."""
    cfg = at.default_config(128, torch.bfloat16)
    partial = compile_sm90(at._decode_partial_kernel, dict(BLOCK_N=cfg.decode_block_n, BLOCK_H=16, DK=128, DV=128,
                                                           BLOCK_D=128, BLOCK_DPE=0, BLOCK_DV=128),
                           "bf16", cfg.decode_num_warps, cfg.decode_num_stages).asm["ptx"]
    ops = re.findall(r"\b(ld\.global|bra)\b", partial)
    reduce_constexprs = dict(DV=128, BLOCK_N=64, BLOCK_DV=128, ROUND=at.REDUCE_SPLITS_A_ROUND)
    reduce = compile_sm90(at._decode_reduce_kernel, reduce_constexprs, "bf16", 1, 1).asm["ptx"]
    return dict(loads_before_branch=ops.index("bra"), reduce_load_run=longest_load_run(reduce, r"ld\.global", r"ex2"),
                round=at.REDUCE_SPLITS_A_ROUND)


def test_decode_attention_loads_go_out_together():
    """A decode step's attention is a chain of round trips to memory: the partial kernel loads the sequence's
    length, first token and page-table row together before it branches on the length, and the reduce loads a round
    of splits (each split's log-sum-exp and output) before combining them."""
    r = compiled_in_subprocess("compile_decode_attention_loads")
    assert r["loads_before_branch"] >= 3 and r["reduce_load_run"] >= 2 * r["round"], r


def test_pair_blocks_shrink_in_gate_up_synchronises(compiled):
    """With pair blocks and LoRA the gate/up shrink runs in the gate_up launch: its programs signal with a
    gpu-scope acq_rel add (gemm_tiles.arrive), the GEMM programs spin on a gpu-scope acquire (a barrier behind
    every warp's poll: waits_as_one) and read xa from L2 (.cg); no other gate_up variant carries any of it."""
    gate_ups = [r for r in compiled if r["kernel"] == "gate_up_kernel"]
    assert any(r["pair_blocks"] and r["lora"] for r in gate_ups)
    for r in gate_ups:
        fused = r["pair_blocks"] and r["lora"]
        where = f"gate_up_kernel {r['dtype']} block_m={r['block_m']} lora={r['lora']} pair_blocks={r['pair_blocks']}"
        assert (r["arrive"], r["acquire"], r["cg_loads"]) == (fused,) * 3, where
        assert r["waits_as_one"], where


def test_gemms_of_several_rank_tiles_let_the_next_launch_start_after_their_work(compiled):
    """With PDL the next kernel's programs, launched early, would crowd these GEMMs' heavy programs on the SMs
    (benchmarks/RESULTS.md, sessions 32 and 33): the GEMMs that hold the epilogues of more than the smallest rank
    tile let it start at the end of their programs, after their MMAs; every other one (among them those whose LoRA
    runs in 16-rank steps, CHUNKS) right after its wait."""
    gemms = [r for r in compiled if r["kernel"] in ("gate_up_kernel", "down_kernel")]
    assert {r["rank_tiles"] for r in gemms} == {1, 3} and {r["chunks"] for r in gemms if r["rank_tiles"] == 3} == {
        True, False}
    for r in gemms:
        where = f"{r['kernel']} {r['dtype']} block_m={r['block_m']} lora={r['lora']} rank_tiles={r['rank_tiles']}"
        assert r["launches_next_first"] == (r["rank_tiles"] == 1 or r["chunks"]), where


def compile_lora_linear() -> list[dict]:
    """The dense LoRA's shrink in a launch of its own (prefill), both kernels as lora_linear launches them: the split
    programs on 16-token blocks, the serial one on 64."""
    results, cfg = [], ll.LoRALinearConfig()
    for in_features, out_sizes, block_r in LORA_LINEARS:
        block_c = min(cfg.prefill_block_c, triton.next_power_of_2(len(out_sizes)) * block_r)
        for kernel, constexprs, stages, types in (
            (ll._split_shrink_kernel, dict(P=len(out_sizes), SPLITS=-(-in_features // cfg.split_k),
                                           SPLIT_K=cfg.split_k, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
                                           BLOCK_R=block_r), cfg.num_stages,
             {"xa_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}),
            (ll._serial_shrink_kernel, dict(P=len(out_sizes), SPLIT_K=cfg.split_k, BLOCK_M=cfg.prefill_block_m,
                                            BLOCK_K=cfg.block_k, BLOCK_R=block_r, BLOCK_C=block_c), cfg.prefill_stages,
             {"xa_ptr": "*bf16"}),
        ):
            compiled = compile_sm90(kernel, constexprs, "bf16", cfg.num_warps, stages, types)
            ptx = compiled.asm["ptx"]
            results.append(dict(kernel=kernel.fn.__name__, dtype="bf16", block_r=block_r,
                                block_m=constexprs["BLOCK_M"], splits=constexprs.get("SPLITS", 1),
                                shared=compiled.metadata.shared, ttgir=compiled.asm["ttgir"],
                                arrive="atom.global.gpu.acq_rel.add" in ptx, cg_loads="ld.global.cg" in ptx))
    return results


def reduce_layouts(ttgir: str) -> list[str]:
    """The layout of each tt.reduce's operand, in the order of the TTGIR."""
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.[^\n]*)$", ttgir, re.M))
    operands = re.findall(r'"tt\.reduce"\(%\w+\) <\{axis = \d : i32\}> \(\{.*?\}\) : \(tensor<[^,]*, (#\w+)>\)', ttgir, re.S)
    return [layouts[name] for name in operands]


def compile_rms_norm() -> list[dict]:
    """bf16 with and without the residual add; and fp32 weight and output on bf16 activations."""
    fp32 = {"w_ptr": "*fp32", "out_ptr": "*fp32"}
    cases = [(dim, r, None) for dim in RMS_NORMS for r in (False, True)] + [(2048, True, fp32)]
    results = []
    for dim, has_residual, types in cases:
        block_h, block_d, num_warps = rn.launch_config(dim)
        constexprs = dict(HAS_RESIDUAL=has_residual, BLOCK_H=block_h, BLOCK_D=block_d)
        compiled = compile_sm90(rn._rms_norm_kernel, constexprs, "bf16", num_warps, 1, types)
        results.append(dict(kernel="_rms_norm_kernel", dtype="bf16", dim=dim, residual=has_residual,
                            fp32_weight=types is not None, shared=compiled.metadata.shared, ttgir=""))
    return results


def compile_rope_kv_store() -> list[dict]:
    """bf16 q, k, v and caches (int64 positions and slots); and fp32 norm weights, so an fp32 rotation
    of bf16 inputs stored into a bf16 cache. With each, the layouts _rms_norm_kernel reduces in for its
    head_dim (bf16, no residual)."""
    common = {"positions_ptr": "*i64", "loc_ptr": "*i64"}
    fp32 = {**common, "q_w_ptr": "*fp32", "k_w_ptr": "*fp32", "q_out_ptr": "*fp32"}
    results = []
    for (dim, norm, interleaved), types in [(case, common) for case in ROPE_KV_STORES] + [(ROPE_KV_STORES[0], fp32)]:
        block_h, block_d, num_warps = rn.launch_config(dim)
        # prefill's loop over 8 head tiles
        constexprs = dict(HALF=dim // 2, HAS_NORM=norm, INTERLEAVED=interleaved, BLOCK_H=block_h, BLOCK_D=block_d,
                          BLOCK_F=triton.next_power_of_2(dim // 2), HEAD_BLOCKS=8)
        compiled = compile_sm90(rk._rope_kv_store_kernel, constexprs, "bf16", num_warps, 1, types)
        rms = compile_sm90(rn._rms_norm_kernel, dict(HAS_RESIDUAL=False, BLOCK_H=block_h, BLOCK_D=block_d), "bf16",
                           num_warps, 1, None if types is common else {"w_ptr": "*fp32", "out_ptr": "*fp32"})
        ptx = compiled.asm["ptx"]
        results.append(dict(kernel="_rope_kv_store_kernel", dim=dim, norm=norm, shared=compiled.metadata.shared,
                            ttgir="", reduces=reduce_layouts(compiled.asm["ttgir"]),
                            rms_norm_reduces=reduce_layouts(rms.asm["ttgir"]),
                            approx_trig="sin.approx" in ptx or "cos.approx" in ptx))
    return results


def test_rope_kv_store_sums_squares_as_rms_norm(compiled):
    """The fused q/k norm gets rms_norm's bits only if it sums each head's squares in the same order: its
    two reductions (q's heads, k's) must run on _rms_norm_kernel's layout for that head_dim, which the same
    tile shape, warps and load give them."""
    fused = [r for r in compiled if r["kernel"] == "_rope_kv_store_kernel"]
    assert any(r["norm"] for r in fused)
    for r in fused:
        assert len(r["rms_norm_reduces"]) == 1, r
        assert r["reduces"] == (2 * r["rms_norm_reduces"] if r["norm"] else []), r


def test_attention_pipelines_key_loads(compiled):
    for r in compiled:
        if r["kernel"] in ("_extend_kernel", "_decode_partial_kernel"):
            where = f"{r['kernel']} k_dim={r['k_dim']}"
            assert "async_copy_global_to_local" in r["ttgir"], f"{where}: key/value loads are not software-pipelined"
            if r["block_m"] >= 64:
                assert "warp_group_dot" in r["ttgir"], f"{where}: does not use wgmma"


def test_lora_linear_main_loops_pipeline(compiled):
    """Both shrink launches pipeline their loads, the serial one on 64-token blocks with wgmma; in the split
    programs the last K split to arrive sums the partials (a gpu-scope acq_rel count, the partials read from L2)."""
    shrinks = [r for r in compiled if r["kernel"] in ("_split_shrink_kernel", "_serial_shrink_kernel")]
    assert {r["kernel"] for r in shrinks} == {"_split_shrink_kernel", "_serial_shrink_kernel"}
    for r in shrinks:
        where = f"{r['kernel']} block_r={r['block_r']}"
        assert "async_copy_global_to_local" in r["ttgir"], f"{where}: loads not pipelined"
        if r["kernel"] == "_serial_shrink_kernel":
            assert "warp_group_dot" in r["ttgir"], f"{where}: does not use wgmma"
        else:
            assert r["splits"] > 1 and r["arrive"] and r["cg_loads"], where


def compile_rotary() -> list[dict]:
    results = []
    for q_heads, k_heads, dim, interleaved in ROTARY_HEADS:
        constexprs = dict(HALF=dim // 2, BLOCK_F=dim // 2, BLOCK_HQ=q_heads, BLOCK_HK=k_heads, INTERLEAVED=interleaved)
        compiled = compile_sm90(ro._rotary_kernel, constexprs, "bf16", 4, 1, {"positions_ptr": "*i64"})
        ptx = compiled.asm["ptx"]
        results.append(dict(kernel="_rotary_kernel", shared=compiled.metadata.shared, ttgir="",
                            approx_trig="sin.approx" in ptx or "cos.approx" in ptx))
    return results


def compile_topk() -> list[dict]:
    results = []
    for experts, top_k, sigmoid, bias, groups, topk_group in ROUTERS:
        constexprs = dict(TOP_K=top_k, SIGMOID=sigmoid, HAS_BIAS=bias, RENORMALIZE=True, GROUP_SIZE=experts // groups,
                          NUM_GROUPS=groups, TOPK_GROUP=topk_group, E_P=triton.next_power_of_2(experts),
                          G_P=groups, K_P=triton.next_power_of_2(top_k), stride_le=1)
        compiled = compile_sm90(tk._topk_kernel, constexprs, "bf16", 1, 1)
        results.append(dict(kernel="_topk_kernel", shared=compiled.metadata.shared, ttgir=""))
    return results


def compile_kv_store() -> list[dict]:
    """bf16 into a bf16 cache at int64 slots (out_cache_loc); and fp32 keys and values into it."""
    int64_loc, fp32_kv = {"loc_ptr": "*i64"}, {"loc_ptr": "*i64", "k_ptr": "*fp32", "v_ptr": "*fp32"}
    results = []
    for (heads, k_dim, v_dim), types in [(shape, int64_loc) for shape in KV_STORES] + [(KV_STORES[0], fp32_kv)]:
        block_h, block_dk, block_dv, num_warps = kv.launch_config(heads, k_dim, v_dim)
        constexprs = dict(DK=k_dim, DV=v_dim, BLOCK_H=block_h, BLOCK_DK=block_dk, BLOCK_DV=block_dv)
        compiled = compile_sm90(kv._store_kv_kernel, constexprs, "bf16", num_warps, 1, types)
        results.append(dict(kernel="_store_kv_kernel", heads=heads, k_dim=k_dim, v_dim=v_dim,
                            shared=compiled.metadata.shared, ttgir=""))
    return results


def compile_linear_kernel(m: int, n: int, k: int, dtype: str, cfg, has_bias: bool = False, parts=None,
                          block_s: int = 8, block_r: int = 16, plan: tuple[int, bool] | None = None):
    """_linear_kernel of M x N x K on tile `cfg`, as linear_triton launches it: with `parts` (out sizes), the LoRA
    epilogue of block_s slots of rank tile block_r, the shrink in the launch where lora_linear runs it there, in
    dots of `plan` (CHUNK_S, B_EARLY; default: linear's plan for the tile)."""
    splits, _ = li.k_splits(n, k, torch.bfloat16)  # fp16's too
    shrink = parts is not None and lora_shrink_in_gemm(m)
    if parts is None:
        lora = dict(HAS_LORA=False, PART_BOUNDS=(0, n), BLOCK_R=16, BLOCK_S=1, CHUNK_S=1, B_EARLY=False)
    else:
        if plan is None:
            cfg, *plan = li.lora_launch_config(cfg, li.LoRAEpilogue(block_s, block_r, shrink_tile(m)))
        chunk_s, b_early = plan
        lora = dict(HAS_LORA=True, PART_BOUNDS=tuple(sum(parts[:p]) for p in range(len(parts) + 1)), BLOCK_R=block_r,
                    BLOCK_S=block_s, CHUNK_S=chunk_s, B_EARLY=b_early)
    shrink_cfg = ll.LoRALinearConfig()
    parallel, block_k = cfg.parallel_splits and splits > 1, gemm_block_k(torch.bfloat16)
    tma = cfg.tma and not parallel  # the K loop through the copy engine's descriptors, as on Hopper
    descriptors = {"x_desc": f"tensordesc<{dtype}[{cfg.block_m}, {block_k}]>",
                   "w_desc": f"tensordesc<{dtype}[{cfg.block_n}, {block_k}]>"} if tma else {}
    constexprs = dict(HAS_BIAS=has_bias, SPLITS=splits, PARALLEL=parallel,
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
                      GROUP_M=cfg.group_m, HAS_SHRINK=shrink,
                      SHRINK_SPLITS=-(-k // shrink_cfg.split_k), SHRINK_SPLIT_K=shrink_cfg.split_k,
                      SHRINK_BLOCK_M=shrink_cfg.block_m, SHRINK_BLOCK_K=shrink_cfg.block_k, TMA=tma, **lora,
                      **({} if tma else {"x_desc": None, "w_desc": None}))
    return compile_sm90(li._linear_kernel, constexprs, dtype, cfg.num_warps, cfg.num_stages,
                        {"part_ptr": "*fp32", "count_ptr": "*i32", "xa_ptr": f"*{dtype}", "xa_part_ptr": "*fp32",
                         "shrink_count_ptr": "*i32", "done_ptr": "*i32", **descriptors}), constexprs


def lora_shrink_in_gemm(m: int) -> bool:
    return m <= ll.FUSED_SHRINK_MAX_TOKENS  # as lora_linear has it


def shrink_tile(m: int) -> tuple[int, int] | None:
    """The shrink's (BLOCK_M, BLOCK_K) where it runs in the GEMM's launch (LoRAEpilogue.shrink)."""
    cfg = ll.LoRALinearConfig()
    return (cfg.block_m, cfg.block_k) if lora_shrink_in_gemm(m) else None


def compile_linear() -> list[dict]:
    """Each default config in bf16 and fp16 without bias; o_proj at decode (bias after parallel K splits) in
    bf16 with one; and bf16 with the LoRA epilogue (8 slots, rank tile 16) at LORA_EPILOGUES."""
    cases = ([(*shape, dtype, False, None) for shape in LINEARS for dtype in ("bf16", "fp16")]
             + [(*LINEARS[0], "bf16", True, None)] + [(*shape, "bf16", False, parts) for *shape, parts in LORA_EPILOGUES])
    results = []
    for m, n, k, dtype, has_bias, parts in cases:
        splits, _ = li.k_splits(n, k, torch.bfloat16)
        cfg = li.default_config(m, n, splits, li.LoRAEpilogue(8, 16, shrink_tile(m)) if parts else None)
        compiled, constexprs = compile_linear_kernel(m, n, k, dtype, cfg, has_bias, parts)
        ptx = compiled.asm["ptx"]
        results.append(dict(kernel="_linear_kernel", dtype=dtype, m=m, n=n, block_m=cfg.block_m, bias=has_bias, lora=bool(parts),
                            shrink=constexprs["HAS_SHRINK"], splits=splits, parallel=constexprs["PARALLEL"],
                            tma=constexprs["TMA"], bulk_copies="cp.async.bulk.tensor" in ptx,
                            shared=compiled.metadata.shared, ttgir=compiled.asm["ttgir"],
                            arrive="atom.global.gpu.acq_rel.add" in ptx, acquire="global.gpu.acquire" in ptx,
                            cg_loads="ld.global.cg" in ptx, waits_as_one=waits_as_one(compiled.asm["ttir"])))
    return results


# a tile of each row of linear's tile table in the launch it runs in (M, N, K, out parts; the shrink in the launch
# up to FUSED_SHRINK_MAX_TOKENS rows): decode and medium tiles on qkv, small ones on o_proj (parallel K splits),
# prefill tiles on qkv without the shrink
EPILOGUE_TILES = ((1, 5120, 2048, (4096, 512, 512), li._DECODE[:1]), (32, 2048, 4096, (2048,), li._SMALL),
                  (200, 5120, 2048, (4096, 512, 512), li._MEDIUM), (4096, 5120, 2048, (4096, 512, 512), li._LARGE[:3]))


def compile_lora_epilogue_bounds() -> list[dict]:
    """Each tile of EPILOGUE_TILES with one dot of the LoRA epilogue (B loaded early where the shrink is in the
    launch) of the most stacked rows (slots x rank tile 64, a power of two) that linear._lora_epilogue_fits lets
    through, and of twice as many; and the first tile of each with linear's launch config for 8 slots of rank 64
    (chunks of slots, or B loaded after the wait), at decode also for one slot of rank tile 256 and 512 (the
    shrink's stages capped): the shared memory of each, and whether it should fit."""
    results = []
    for m, n, k, parts, tiles in EPILOGUE_TILES:
        splits, _ = li.k_splits(n, k, torch.bfloat16)
        stages = {"num_stages": li.ONE_SPLIT_STAGES} if m <= 32 and splits == 1 else {}
        shrink = lora_shrink_in_gemm(m)
        for i, tile in enumerate(tiles):
            cfg = dataclasses.replace(tile, parallel_splits=m <= li.PARALLEL_SPLITS_MAX_M, **stages)
            slots = max(s for s in (1, 2, 4, 8, 16, 32, 64) if li._lora_epilogue_fits(cfg, s * 64, shrink))
            # twice as many rows: over the limit, but with B early on a 16-row tile, which the bound takes as Triton
            # 3.6 lays it out (B twice) and 3.9 holds in half the space (B once): either there
            twice_fits = None if shrink and cfg.block_m == 16 else False
            cases = [(slots, 64, (slots, shrink), True), (2 * slots, 64, (2 * slots, shrink), twice_fits)]
            if i == 0:  # linear's plan for 8 slots of rank 64; at decode, for one slot of rank tile 256 and 512
                cases += [(8, 64, None, True)] + [(1, r, None, True) for r in (256, 512) if m == 1]
            for block_s, block_r, plan, fits in cases:
                compiled, constexprs = compile_linear_kernel(m, n, k, "bf16", cfg, parts=parts, block_s=block_s,
                                                             block_r=block_r, plan=plan)
                results.append(dict(m=m, tile=f"{cfg.block_m}x{cfg.block_n}", rows=block_s * block_r,
                                    chunk=constexprs["CHUNK_S"], b_early=constexprs["B_EARLY"], fits=fits,
                                    shared=compiled.metadata.shared))
    return results


def compile_large_rank_tiles() -> list[dict]:
    """The experts' kernels of the prefill row (the most shared memory) at rank tile 256, the largest, as the
    launcher runs them (fused_moe.config.for_rank_tile): the GEMMs, the segment shrink and the down shrink."""
    cfg = fm_config.for_rank_tile(fm_config.default_config(8192, 8, 128, torch.bfloat16, lora=True), 256)
    results = [dict(kernel=r["kernel"], shared=r["shared"]) for r in compile_moe_gemms(cfg, True, "bf16", 5)]
    for kernel, constexprs in ((fm_shrink.shrink_kernel, dict(SHRINK_ROWS=cfg.shrink_rows, BLOCK_K=64, BLOCK_R=256,
                                                               RANK_TILES=5, TILE=4, SPLIT_K=fm_config.SHRINK_SPLIT_K,
                                                               A_ALIGNED=True, SERIAL=False)),
                               (fm_shrink.down_shrink_kernel, dict(SHRINK_ROWS=cfg.shrink_rows, BLOCK_R=256, RANK_TILES=5,
                                                                   PART_N=fm_config.DOWN_SHRINK_PART))):
        compiled = compile_sm90(kernel, constexprs, "bf16", cfg.shrink_num_warps, cfg.shrink_num_stages)
        results.append(dict(kernel=kernel.fn.__name__, shared=compiled.metadata.shared))
    return results


def test_the_experts_kernels_of_the_largest_rank_tile_fit_shared_memory():
    """Rank tile 256 (adapters of rank 129-256): with 4 slot-loop stages the prefill row's GEMMs asked 294912 B and
    its 3-stage shrink 245760 B (session 48); the launcher's stages for that tile fit."""
    results = compiled_in_subprocess("compile_large_rank_tiles")
    assert {r["kernel"] for r in results} == {"gate_up_kernel", "down_kernel", "shrink_kernel", "down_shrink_kernel"}
    for r in results:
        assert r["shared"] <= SMEM_LIMIT, f"{r}: {r['shared']} B of shared memory"


def test_linear_pipelines_on_wgmma(compiled):
    """Every tile's K loop is software-pipelined, also inside the loop over K splits: on the prefill and medium
    tiles whose splits run in series through the copy engine (TMA), on the others by pointers; from BLOCK_M 64
    (medium and prefill tiles) tl.dot is wgmma. Parallel splits count arrivals with a gpu-scope acq_rel atomic and
    read the partials from L2 (checked in the PTX, as for the fused MoE kernels)."""
    linears = [r for r in compiled if r["kernel"] == "_linear_kernel"]
    assert {r["block_m"] for r in linears} == {16, 32, 64, 128}
    assert {(r["splits"] > 1, r["parallel"]) for r in linears} == {(False, False), (True, False), (True, True)}
    assert {r["tma"] for r in linears} == {True, False}
    for r in linears:
        where = f"_linear_kernel {r['dtype']} M={r['m']} N={r['n']} bias={r['bias']} lora={r['lora']} splits={r['splits']}"
        assert r["tma"] == (r["block_m"] >= 64 and not r["parallel"]) == r["bulk_copies"], where
        copy = "async_tma_copy_global_to_local" if r["tma"] else "async_copy_global_to_local"
        assert copy in r["ttgir"], f"{where}: main loop is not software-pipelined"
        if r["block_m"] >= 64:
            assert "warp_group_dot" in r["ttgir"], f"{where}: does not use wgmma"
        if r["parallel"]:
            assert r["arrive"] and r["cg_loads"], where


def test_rotary_uses_accurate_sin_cos(compiled):
    """Positions run to 10^5 radians and more, where sin.approx/cos.approx lose every digit; libdevice's
    sinf/cosf reduce the argument exactly, as torch's CUDA kernels do."""
    assert all(not r["approx_trig"] for r in compiled if r["kernel"] in ("_rotary_kernel", "_rope_kv_store_kernel"))


def test_linear_shrink_in_gemm_synchronises(compiled):
    """At decode sizes the LoRA shrink runs in the GEMM's first programs: they signal with a gpu-scope acq_rel
    add, the tiles' epilogues spin on a gpu-scope acquire (a barrier behind every warp's poll:
    waits_as_one) and read xa from L2 (.cg); no GEMM without it spins."""
    linears = [r for r in compiled if r["kernel"] == "_linear_kernel"]
    assert {(r["lora"], r["shrink"]) for r in linears} == {(False, False), (True, False), (True, True)}
    for r in linears:
        where = f"_linear_kernel {r['dtype']} M={r['m']} N={r['n']} lora={r['lora']} shrink={r['shrink']}"
        assert r["acquire"] == r["shrink"], where
        if r["shrink"]:
            assert r["arrive"] and r["cg_loads"] and r["waits_as_one"], where
