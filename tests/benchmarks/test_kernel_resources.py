"""The kernel-resources tool runs end to end on a machine without a GPU (Triton compiles for sm_90a, cuobjdump reads
the cubin), and its occupancy arithmetic is CUDA's (and agrees with what Nsight Compute read on an H200)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from kernel_resources import Resources  # noqa: E402


def test_programs_an_sm_holds():
    # the block shrink at T = 512 (benchmarks/RESULTS.md, session 30): 96 registers a thread, 4 warps; ncu read
    # "Block Limit Registers 5" and "Block Limit Warps 16"
    held = Resources(registers=96, spilled=0, shared=16384, warps=4).programs_per_sm()
    assert held["registers"] == 5 and held["warps"] == 16
    # 16 KiB and the driver's 1 KiB of 228 KiB; 100 bytes more take a 128-byte unit more
    assert held["shared"] == 233472 // 17408 == 13
    assert Resources(96, 0, 16384 + 100, 4).programs_per_sm()["shared"] == 233472 // 17536
    # registers go to a warp in units of 256: 97 a thread take 3328 a warp, as 104 would
    assert Resources(97, 0, 0, 4).programs_per_sm()["registers"] == Resources(104, 0, 0, 4).programs_per_sm()["registers"] == 4
    # and a warp's registers sit in one of the SM's four quarters: 136 a thread (4352 a warp) fit 3 warps a
    # quarter, 12 in all, 6 programs of 2 warps (not 65536 // (2 x 4352) = 7)
    assert Resources(136, 0, 0, 2).programs_per_sm()["registers"] == 6


def test_resources_of_each_kernel_at_a_prefill_batch():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for the target, not interpret
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run([sys.executable, "benchmarks/kernel_resources.py", "--tokens", "512", "--maxnreg", "168",
                          "--rank-tiles", "16,64"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in run.stdout.splitlines()
            if line.startswith("| 512")]
    # without LoRA the two GEMMs; with it the GEMMs and the segment shrink, on the rank-16 tile and on tiles to 64
    # (a shrink launch per tile)
    assert [(r[1], r[2], r[3]) for r in rows] == [
        ("off", "gate_up_kernel", ""), ("off", "down_kernel", ""),
        ("on", "gate_up_kernel", "1"), ("on", "down_kernel", "1"), ("on", "shrink_kernel (tile 16)", "1"),
        ("on", "gate_up_kernel", "3"), ("on", "down_kernel", "3"),
        *[("on", f"shrink_kernel (tile {tile})", "3") for tile in (16, 32, 64)]]
    assert all(0 < int(r[4]) <= 255 and int(r[5]) >= 0 and float(r[6]) > 0 for r in rows)
    capped = [int(r[4]) for r in rows if r[1] == "on" and r[3] == "3" and not r[2].startswith("shrink_kernel")]
    assert capped and all(regs <= 168 for regs in capped)  # the cap reaches the GEMMs with more than one rank tile
    # each shrink launch holds the registers of its own tile: the rank-16 launch among tiles to 64 as many as alone
    shrink16 = {r[3]: int(r[4]) for r in rows if r[2] == "shrink_kernel (tile 16)"}
    assert shrink16["3"] == shrink16["1"], shrink16
