"""Counters of the engine's steps: how its batches form and where a step's host time goes, to compare a
server's steps with the offline engine's on the same work (a server's /metrics exposes them;
benchmarks/bench_server.py prints them for both). Always on: a few clock reads and additions per step.

Host time per step, by phase (time.perf_counter, the engine's thread):
  schedule     planning the step and allocating its KV slots
  launch       building the batch's inputs and queueing the forward and sampling (on a CPU the forward itself;
               on a GPU the kernel launches of an eager step, a graph replay for a decode step)
  wait         waiting for the device's sampled tokens (the host is idle: the device works)
  postprocess  appending the tokens to their requests, finishing and releasing them

Beside them, the process's pauses so far (engine/pauses.py: garbage collections, Triton compiles), which stall
a step from whichever thread they come.

With MOELORA_STEP_TRACE=<file> in the environment, the engine also appends one JSON line per Engine.step call
to the file (StepTrace): off by default; for looking at a run's steps one by one.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, fields

from moelora.engine import pauses

PHASES = ("schedule", "launch", "wait", "postprocess")


@dataclass
class StepStats:
    prefill_steps: int = 0         # steps of prompt pieces only
    decode_steps: int = 0          # steps of decode rows only
    mixed_steps: int = 0           # decode rows and prompt pieces (enable_mixed_chunk)
    decode_rows: int = 0           # decode rows summed over the steps that carry them
    prompt_pieces: int = 0         # prompt pieces (new prompts, a long prompt's chunks, recomputations), summed
    prompt_tokens: int = 0         # their tokens
    stalled_rows: int = 0          # running requests a step left out (a prompt step of its own leaves out all), summed
    admitted: int = 0              # requests that started (their first prompt piece ran)
    admission_wait_seconds: float = 0.0  # from each one's arrival (add_request's arrival_time) to that step, summed
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))  # host time per phase

    def __post_init__(self) -> None:
        self._pauses = pauses.install()

    @property
    def steps(self) -> int:
        return self.prefill_steps + self.decode_steps + self.mixed_steps

    def count_step(self, num_decode: int, extend_lens: list[int], num_stalled: int) -> None:
        """One scheduled step: its first num_decode rows decode, the rest are prompt pieces of extend_lens[i] tokens."""
        num_pieces = len(extend_lens) - num_decode
        if num_pieces == 0:
            self.decode_steps += 1
        elif num_decode == 0:
            self.prefill_steps += 1
        else:
            self.mixed_steps += 1
        self.decode_rows += num_decode
        self.prompt_pieces += num_pieces
        self.prompt_tokens += sum(extend_lens) - num_decode
        self.stalled_rows += num_stalled

    def count_admission(self, wait_s: float) -> None:
        self.admitted += 1
        self.admission_wait_seconds += wait_s

    def as_dict(self) -> dict[str, float]:
        """Every counter by name (the phases' seconds as `<phase>_seconds`) and the process's pauses: what a server
        exports, a report diffs."""
        counters = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "seconds"}
        return counters | {f"{phase}_seconds": s for phase, s in self.seconds.items()} | self._pauses.as_dict()


class StepTrace:
    """One JSON line per step call: when it started and how long it took (ms since the trace opened), the
    counters it moved (what kind of step it launched, its rows, the phases' seconds), its outputs, and the
    waiting and running requests after it."""

    def __init__(self, path: str):
        """`path`: $MOELORA_STEP_TRACE's value."""
        try:
            self._file = open(path, "a", buffering=1)  # line-buffered: the lines are there even if the process dies
        except OSError as e:
            raise ValueError(f"$MOELORA_STEP_TRACE: cannot write the step trace to {path!r}: {e.strerror}") from None
        self._opened = time.perf_counter()

    def write(self, started: float, before: dict[str, float], after: dict[str, float], outputs: int, waiting: int,
              running: int) -> None:
        moved = {name: round(value - before[name], 6) for name, value in after.items() if value != before[name]}
        self._file.write(json.dumps({"t_ms": round(1e3 * (started - self._opened), 3),
                                     "ms": round(1e3 * (time.perf_counter() - started), 3), **moved,
                                     "outputs": outputs, "waiting": waiting, "running": running}) + "\n")

    def close(self) -> None:
        self._file.close()
