"""run_ranks: a function on every rank of a gloo world of CPU processes, their results back in rank order."""
from __future__ import annotations

import pickle
import queue
from collections.abc import Callable
from typing import Any

import torch

from moelora.distributed.launch import LocalRanks, rendezvous_store
from moelora.distributed.state import destroy_parallel, init_parallel, parallel_state


def _rank_main(rank: int, world: int, addr: str, results: Any, fn: Callable[..., Any], args: tuple,
               options: dict[str, Any], cuda: bool) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's few cores
    state = init_parallel(world, rank=rank, init_method=f"tcp://{addr}", timeout=60,
                          device=f"cuda:{rank}" if cuda else "cpu", **options)
    try:
        with parallel_state(state):
            # pickled here: a queue would share tensors' memory with the parent, gone once this process ends
            results.put((rank, pickle.dumps(fn(*args))))
    finally:
        destroy_parallel()


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 300, cuda: bool = False,
              **options: Any) -> list[Any]:
    """fn(*args) on each of `world` processes that joined one world with init_parallel(world, **options)
    (ep_size, moe_dispatch): CPU processes over gloo, or with cuda rank r on cuda:r over NCCL; fn, its arguments
    and its result must pickle (fn at the top level of a module; tensors on the CPU)."""
    import multiprocessing as mp
    results = mp.get_context("spawn").Queue()
    store, addr = rendezvous_store(None, 60)
    ranks = LocalRanks(_rank_main, range(world), (world, addr, results, fn, args, options, cuda))
    got: dict[int, Any] = {}
    try:
        while len(got) < world:
            try:
                rank, value = results.get(timeout=1.0)
                got[rank] = pickle.loads(value)
            except queue.Empty:
                if ranks.dead() and any(code != 0 for code in ranks.dead().values()):
                    raise AssertionError(ranks.describe()) from None
                timeout -= 1.0
                if timeout <= 0:
                    raise AssertionError(f"the ranks did not finish in time: {ranks.describe()}") from None
    finally:
        ranks.stop()
        del store  # listening until the ranks are done
    return [got[r] for r in range(world)]
