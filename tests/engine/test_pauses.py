"""Process pauses (moelora/engine/pauses.py): garbage collections and Triton compiles are counted, and reach
StepStats (a step trace, a server's /metrics)."""
import gc
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from moelora.engine import pauses
from moelora.engine.step_stats import StepStats


def test_collections_are_counted_and_timed():
    counted = pauses.install()
    before = counted.as_dict()
    gc.collect()
    gc.collect()
    assert counted.gc_collections == before["gc_collections"] + 2
    assert counted.gc_seconds > before["gc_seconds"]


def test_install_is_once_per_process():
    callbacks = len(gc.callbacks)
    assert pauses.install() is pauses.install() is pauses.PAUSES
    assert len(gc.callbacks) == callbacks


@pytest.mark.parametrize("signal_name, handler, exit_code", [
    ("SIGINT", "signal.default_int_handler", 3),  # Ctrl-C: KeyboardInterrupt
    ("SIGTERM", "lambda *_: sys.exit(7)", 7),     # a handler's SystemExit
])
def test_what_a_signal_handler_raises_during_a_collection_is_not_lost(signal_name, handler, exit_code):
    # the signal while the process collects a large heap, as during a model's load: Python runs the handler at the
    # next bytecode, _on_gc's first, and discards what a gc callback raises (without the hook: never interrupted)
    script = textwrap.dedent(f"""
        import gc, os, signal, sys, threading, time
        from moelora.engine import pauses
        pauses.install()
        signal.signal(signal.{signal_name}, {handler})
        heap = [[i] for i in range(2_000_000)]  # a full collection walks them all: most time is in the collector
        threading.Timer(0.5, os.kill, (os.getpid(), signal.{signal_name})).start()
        deadline = time.monotonic() + 20
        try:
            while time.monotonic() < deadline:
                gc.collect()
        except KeyboardInterrupt:
            sys.exit(3)
        """)
    run = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == exit_code and "Exception ignored" not in run.stderr, run.stderr[-2000:]


def test_other_unraisable_reports_reach_the_previous_hook():
    reports = []
    hook = pauses._redeliver_interrupts(reports.append)
    elsewhere = types.SimpleNamespace(exc_type=KeyboardInterrupt, exc_value=KeyboardInterrupt(), exc_traceback=None,
                                      err_msg=None, object=print)
    hook(elsewhere)
    assert reports == [elsewhere] and sys.getprofile() is None


def test_step_stats_carry_the_pauses():
    stats = StepStats()
    before = stats.as_dict()
    gc.collect()
    after = stats.as_dict()
    assert after["gc_collections"] == before["gc_collections"] + 1
    assert set(pauses.Pauses().as_dict()) <= set(after)


def test_compile_hooks_count_a_compile_and_chain_to_earlier_hooks(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append("cache"))
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append("post"))
    pauses._hook_triton()
    before = pauses.PAUSES.as_dict()
    assert knobs.runtime.jit_cache_hook(key="k") is None  # None: Triton goes on to compile
    knobs.runtime.jit_post_compile_hook(key="k")
    assert pauses.PAUSES.kernel_compiles == before["kernel_compiles"] + 1
    assert pauses.PAUSES.compile_seconds > before["compile_seconds"]
    assert seen == ["cache", "post"]
    knobs.runtime.jit_post_compile_hook(key="k")  # no start seen on this thread: not a compile of ours
    assert pauses.PAUSES.kernel_compiles == before["kernel_compiles"] + 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton compiles only on a GPU (the CPU interprets)")
def test_a_new_kernel_is_a_counted_compile():
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    counted = pauses.install()
    before = counted.kernel_compiles
    x = torch.zeros(8, device="cuda")
    add_one[(1,)](x, 8, BLOCK=8)
    add_one[(1,)](x, 8, BLOCK=8)  # the same variant: no compile
    assert counted.kernel_compiles == before + 1 and x.tolist() == [2.0] * 8
