"""Host-side bookkeeping of the KV cache: free token slots and free rows of req_to_token.

Slots are handed out from a free list, so a request's cache need not be contiguous; slot 0 is
never handed out (padded rows of CUDA-graph batches write there). Everything here is host state,
so admission and retraction decisions never wait on the device.
"""
from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_slots: int, num_rows: int):
        self.num_slots, self.num_rows = num_slots, num_rows
        self._free_slots = torch.arange(1, num_slots, dtype=torch.int64)
        self._free_rows = list(range(num_rows - 1, -1, -1))  # popped from the end: row 0 first

    @property
    def free_slots(self) -> int:
        return self._free_slots.numel()

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_slots(self, n: int) -> torch.Tensor:
        """n free slots (int64, host); the caller checks free_slots first."""
        if n > self.free_slots:
            raise RuntimeError(f"KV cache out of slots: {n} asked, {self.free_slots} free")
        slots, self._free_slots = self._free_slots[:n], self._free_slots[n:]
        return slots

    def free(self, slots: torch.Tensor) -> None:
        self._free_slots = torch.cat([self._free_slots, slots])

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError(f"all {self.num_rows} request rows are in use")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)
