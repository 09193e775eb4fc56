"""Pauses of the whole process, which every thread waits through: the cyclic garbage collector's collections
(they hold the GIL) and Triton compiling a kernel variant this process has not launched yet (the launching
thread waits; milliseconds from a warm on-disk cache, seconds from a cold one). Counted from `install` on,
process-wide: StepStats reports them beside the steps' counters, so a step trace shows the step a pause
delayed and a server's /metrics their totals. Triton older than 3.5 has no compile hooks: its compiles stay
uncounted."""
from __future__ import annotations

import functools
import gc
import sys
import threading
import time
from dataclasses import asdict, dataclass


@dataclass
class Pauses:
    gc_collections: int = 0
    gc_seconds: float = 0.0
    kernel_compiles: int = 0       # kernel variants this process compiled or loaded from Triton's disk cache
    compile_seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


PAUSES = Pauses()
_lock = threading.Lock()
_installed = False
_gc_started = 0.0
_compile_started: dict[int, float] = {}  # by thread: a compile runs on the thread that launches the kernel


def install() -> Pauses:
    """Start counting (once per process; later calls return the same counters)."""
    global _installed
    with _lock:
        if not _installed:
            gc.callbacks.append(_on_gc)
            sys.unraisablehook = _redeliver_interrupts(sys.unraisablehook)
            _hook_triton()
            _installed = True
    return PAUSES


def _on_gc(phase: str, info: dict) -> None:
    global _gc_started
    if phase == "start":
        _gc_started = time.perf_counter()
    else:
        PAUSES.gc_collections += 1
        PAUSES.gc_seconds += time.perf_counter() - _gc_started


def _redeliver_interrupts(previous):
    """sys.unraisablehook that raises again what a signal handler raised in _on_gc. Python runs signal handlers
    between bytecodes, so a SIGINT that arrives during a collection raises KeyboardInterrupt as _on_gc starts (as
    would a SIGTERM handler's SystemExit), and Python discards what a gc callback raises: a process busy collecting
    (a large model's load) ignored Ctrl-C. _on_gc itself raises nothing. Other reports go on to the previous hook."""
    def hook(unraisable) -> None:
        if unraisable.object is _on_gc and sys.getprofile() is None:  # (a profiler keeps its place)
            sys.setprofile(functools.partial(_raise_outside_callbacks, unraisable.exc_value))
        else:
            previous(unraisable)
    _callback_code.add(hook.__code__)
    return hook


_callback_code = {_on_gc.__code__}  # and the hook's: where the exception would be lost again


def _raise_outside_callbacks(exception: BaseException, frame, event: str, arg) -> None:
    """Profile function (of the main thread: signal handlers run there) that raises `exception` at the first call
    or return in the thread's own code, not in a gc callback (this module's or another's) or the hook. Raised by a
    profile function, it goes to the code being run, and Python removes the profile function."""
    callbacks = _callback_code | {cb.__code__ for cb in gc.callbacks if hasattr(cb, "__code__")}
    while frame is not None:
        if frame.f_code in callbacks:
            return
        frame = frame.f_back
    raise exception


def _hook_triton() -> None:
    try:
        from triton import knobs
    except ImportError:
        return
    runtime = knobs.runtime
    before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook  # chained: another tool's hooks still run

    def started(**kwargs):
        _compile_started[threading.get_ident()] = time.perf_counter()
        return before(**kwargs) if before is not None else None

    def compiled(**kwargs):
        start = _compile_started.pop(threading.get_ident(), None)
        if start is not None:
            PAUSES.kernel_compiles += 1
            PAUSES.compile_seconds += time.perf_counter() - start
        return after(**kwargs) if after is not None else None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = started, compiled
