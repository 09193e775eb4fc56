"""Programmatic dependent launch (PDL, Hopper and later): each Triton kernel of a step may be launched while the
kernel before it in the stream is still finishing, so its programs are resident and waiting when that kernel's last
writes land, instead of the launch starting only then. A decode step is hundreds of kernels of a few microseconds,
each of which otherwise pays that launch gap (benchmarks/RESULTS.md has the measured difference).

The contract every kernel keeps: `wait_for_previous_kernel(PDL)` is its first statement, before any load or store,
so nothing it reads or overwrites can still be in use by the kernel before it (the wait carries a memory clobber:
without one the compiler moved a kernel's loads above it, and fused_moe read a row count the alignment kernel had not
yet written and looped on a poisoned value); and as every kernel waits for the
full completion of the one before it, each also waits for everything earlier (a kernel that does not read its
predecessor's output still cannot pass it). Right after the wait it lets the next kernel launch: that kernel's
programs can only take SM resources once every program of this launch is running, so waits between programs of
one launch (arrival counters) are not starved. Launches of torch, cuBLAS or NCCL kernels carry no PDL attribute
and wait as usual; a PDL launch after one of them starts once it has completed.
fused_moe's GEMMs that hold the epilogues of more than one LoRA rank tile let the next kernel launch only at the end
of their programs (`launch_next_kernel`): launched right after their wait, its waiting programs crowded theirs, and a
Mixtral-8x7B layer's LoRA cost 4-7x as much at one token on an H200 (benchmarks/RESULTS.md, sessions 32 and 33).

`pdl_launch(device)` gives the launch keywords: PDL on CUDA devices of compute capability 9 or more, unless the
environment sets MOELORA_PDL=0 (read once per process: CUDA graphs bake the launches in); off in the Triton
interpreter and on the CPU."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

PDL_ENV = "MOELORA_PDL"


@functools.cache
def _enabled(device_type: str, index: int | None) -> bool:
    if device_type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get(PDL_ENV, "1") not in ("0", "1"):
        raise ValueError(f"{PDL_ENV} must be 0 or 1, got {os.environ[PDL_ENV]!r}")
    return os.environ.get(PDL_ENV, "1") == "1" and torch.cuda.get_device_capability(index)[0] >= 9


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """The keywords a launch on `device` passes: the kernel's PDL constexpr and Triton's launch_pdl option."""
    on = _enabled(device.type, device.index)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr, LAUNCH_NEXT: tl.constexpr = True):
    """First statement of every kernel: with PDL, wait until the kernel before this launch has completed and its
    writes are visible, then (LAUNCH_NEXT) let the next launch start. A kernel whose programs the next launch's
    would crowd waits with LAUNCH_NEXT=False and calls launch_next_kernel itself when its work is done."""
    if PDL:  # not tl.extra.cuda.gdc_wait: in Triton 3.6 it has no memory clobber, so loads could move above it
        tl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r,~{memory}", [], dtype=tl.int32,
                                  is_pure=False, pack=1)
        if LAUNCH_NEXT:
            launch_next_kernel(PDL)


@triton.jit
def launch_next_kernel(PDL: tl.constexpr):
    """With PDL, let the next launch start once every program of this one has come here (or ended)."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)
