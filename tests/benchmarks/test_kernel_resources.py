"""The kernel-resources tool runs end to end on a machine without a GPU (Triton compiles for sm_90a, cuobjdump reads
the cubin), and its occupancy arithmetic agrees with what Nsight Compute read on an H200."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from kernel_resources import Resources  # noqa: E402


def test_programs_an_sm_holds_match_nsight_compute():
    # the block shrink at T = 512 (benchmarks/RESULTS.md, session 30): 96 registers a thread, 4 warps, 16.4 KiB of
    # dynamic shared memory; ncu: "Block Limit Registers 5", "Block Limit Warps 16"
    held = Resources(registers=96, spilled=0, shared=16384, warps=4).programs_per_sm()
    assert held["registers"] == 5 and held["warps"] == 16 and held["shared"] == 13
    # registers go to a warp in units of 256: 97 a thread take 3328 a warp, as 104 would
    assert Resources(97, 0, 0, 4).programs_per_sm()["registers"] == Resources(104, 0, 0, 4).programs_per_sm()["registers"] == 4


def test_resources_of_each_kernel_at_a_prefill_batch():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for the target, not interpret
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run([sys.executable, "benchmarks/kernel_resources.py", "--tokens", "512", "--maxnreg", "168"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in run.stdout.splitlines()
            if line.startswith("| 512")]
    # without LoRA the two GEMMs; with it the GEMMs and the block shrink, on the rank-16 tile and on tiles to 64
    assert [(r[1], r[2], r[3]) for r in rows] == [
        ("off", "gate_up_kernel", ""), ("off", "down_kernel", ""),
        *[("on", kernel, tiles) for tiles in ("1", "3") for kernel in ("gate_up_kernel", "down_kernel", "shrink_kernel")]]
    assert all(0 < int(r[4]) <= 255 and int(r[5]) >= 0 and float(r[6]) > 0 for r in rows)
    capped = [int(r[4]) for r in rows if r[1] == "on" and r[3] == "3" and r[2] != "shrink_kernel"]
    assert capped and all(regs <= 168 for regs in capped)  # the cap reaches the GEMMs with more than one rank tile
