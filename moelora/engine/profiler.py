"""torch.profiler traces of what the engine runs, on every rank: vLLM's and SGLang's start_profile / stop_profile.

Between start and stop each rank records its host ops and, on a GPU, its kernels (those a CUDA graph replays
included); at stop it writes a Chrome trace (chrome://tracing, https://ui.perfetto.dev) and a summary of where its
time went, device time by kernel (on a CPU: host time by op, self time). Rank 0 names the files and every rank writes
its own, in the directory as seen from its node:

    <dir>/<stem>-rank<r>.trace.json.gz     the trace
    <dir>/<stem>-rank<r>.kernels.json      {"device": "cuda" | "cpu", "kernels": {name: [launches, microseconds]}}
"""
from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def profile_files(directory: str | Path, stem: str, rank: int) -> tuple[Path, Path]:
    """(trace, summary) of rank `rank` for a profile named `stem`."""
    base = Path(directory) / f"{stem}-rank{rank}"
    return base.with_name(base.name + ".trace.json.gz"), base.with_name(base.name + ".kernels.json")


def rank_of(trace: str | Path) -> int:
    """The rank whose trace it is (profile_files' name)."""
    return int(Path(trace).name.removesuffix(".trace.json.gz").rsplit("-rank", 1)[1])


def summary_path(trace: str | Path) -> Path:
    """The summary written beside a trace (profile_files' pair)."""
    trace = Path(trace)
    return trace.with_name(trace.name.removesuffix(".trace.json.gz") + ".kernels.json")


def read_summary(trace: str | Path) -> dict:
    """The summary written beside a trace: {"device": ..., "kernels": {name: [launches, microseconds]}}."""
    return json.loads(summary_path(trace).read_text())


class StepProfiler:
    """One rank's profiler: at most one profile at a time, stopped on the thread that started it (torch's profiler
    state is the thread's: stopped from another thread it crashes the process)."""

    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, device
        self._profile: profile | None = None
        self._target: tuple[Path, str] | None = None
        self._thread: int | None = None

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(self, directory: str | Path, stem: str) -> None:
        if self._profile is not None:
            raise RuntimeError("a profile is running already")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        prof = profile(activities=activities)
        prof.start()
        self._profile, self._target, self._thread = prof, (Path(directory), stem), threading.get_ident()

    def check_thread(self) -> None:
        """ValueError unless this is the thread that started the running profile."""
        if self._profile is not None and self._thread != threading.get_ident():
            raise ValueError("the profile was started on another thread: stop it on that thread (the engine's)")

    def stop(self) -> tuple[Path, Path]:
        """Ends the profile, writes and returns (trace, summary). The caller waits for the device's work first:
        the steps in flight (overlap scheduling) belong to the profile."""
        if self._profile is None:
            raise RuntimeError("no profile is running")
        self.check_thread()
        prof, (directory, stem) = self._profile, self._target
        self._profile = self._target = None
        prof.stop()
        trace, summary = profile_files(directory, stem, self.rank)
        directory.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
        summary.write_text(json.dumps({"device": self.device.type, "kernels": kernel_summary(prof, self.device)}))
        return trace, summary

    def abandon(self) -> None:
        """Stop recording without writing anything (the engine shuts down, or a rank failed). From a thread other
        than the one that started it, the profile is only dropped: that thread's recording ends with it."""
        if self._profile is not None:
            prof, same_thread = self._profile, self._thread == threading.get_ident()
            self._profile = self._target = self._thread = None
            if same_thread:
                prof.stop()


def kernel_summary(prof: profile, device: torch.device) -> dict[str, list[float]]:
    """name -> [launches, microseconds]: device time by kernel on a GPU, host self time by op on a CPU; the
    busiest first."""
    launches, micros = Counter(), Counter()
    for event in prof.events():
        if device.type == "cuda":  # kernels and copies; not the annotations spanning them (their time is the kernels')
            if event.device_type != torch.autograd.DeviceType.CUDA or getattr(event, "is_user_annotation", False):
                continue
            time = event.device_time
        else:
            time = event.self_cpu_time_total
        launches[event.name] += 1
        micros[event.name] += time
    return {name: [launches[name], round(us, 3)] for name, us in micros.most_common()}
