"""The parallel layout, the collectives (identity at one rank; sums, gathers and exchanges over gloo ranks)
and what rank 0 learns of a rank that failed."""
import os
import signal
import socket
import time

import pytest
import torch

from moelora.distributed import comm
from moelora.distributed import launch
from moelora.distributed.launch import LocalRanks, free_port, rendezvous_store
from moelora.distributed.sharding import even_shard, kv_head_shard
from moelora.distributed.state import ParallelState, get_parallel, init_parallel, parallel_state
from tests.distributed.ranks import run_ranks


def test_one_rank_collectives_are_the_identity():
    assert get_parallel() == ParallelState()
    x = torch.randn(3, 4)
    one = get_parallel()
    assert comm.all_reduce(one, x) is x and comm.all_gather(one, x) is x
    assert comm.min_over_ranks(one, [7, 2], timeout=1) == [7, 2]
    assert comm.gather_over_ranks(one, [7, 2], timeout=1) == [[7, 2]]
    comm.control_barrier(one, timeout=1)


def test_layout():
    layout = [ParallelState(r, 4, 2) for r in range(4)]
    assert [(s.ep_rank, s.moe_tp_rank, s.moe_tp_size) for s in layout] == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    assert [ParallelState(r, 4, 4).ep_rank for r in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"ep_size \(3\) must divide tp_size \(4\)"):
        ParallelState(0, 4, 3)
    with pytest.raises(ValueError, match="moe_dispatch must be one of"):
        ParallelState(0, 2, 2, "deepep")
    with parallel_state(ParallelState(1, 2)):
        assert get_parallel().rank == 1
    assert get_parallel().rank == 0


def test_shards():
    assert even_shard(12, 4, 1, "heads") == slice(3, 6)
    with pytest.raises(ValueError, match=r"intermediate size \(10\) does not split evenly over 4 ranks"):
        even_shard(10, 4, 0, "intermediate size")
    assert [kv_head_shard(2, 4, r) for r in range(4)] == [slice(0, 1), slice(0, 1), slice(1, 2), slice(1, 2)]
    assert kv_head_shard(4, 2, 1) == slice(2, 4)


def _collectives() -> dict:
    state = get_parallel()
    rank = state.rank
    x = torch.full((2, 3), float(rank + 1))
    # rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends none to rank 0 and 1 to itself
    send = [1, 2] if rank == 0 else [0, 1]
    rows = torch.arange(sum(send), dtype=torch.float32)[:, None] + 10 * rank
    recv = comm.exchange_counts(state, torch.tensor(send))
    comm.control_barrier(state, timeout=60)
    return dict(sum=comm.all_reduce(state, x.clone()), gathered=comm.all_gather(state, torch.tensor([rank, rank])),
                recv_counts=recv.tolist(), received=comm.all_to_all(state, rows, send, recv.tolist()).flatten().tolist(),
                obj=comm.broadcast_object(state, {"from": rank} if rank == 0 else None),
                least=comm.min_over_ranks(state, [5 + rank, 9 - rank], timeout=60),
                each=comm.gather_over_ranks(state, [5 + rank, -2**63 + rank], timeout=60),
                # the control-group works' handles outlive their calls: no gloo thread frees their tensors (a
                # process that ends right after them would abort if one did while the interpreter finalizes)
                held=len(comm._recent_works))


def test_two_ranks_collectives():
    r0, r1 = run_ranks(2, _collectives)
    for r in (r0, r1):
        assert torch.equal(r["sum"], torch.full((2, 3), 3.0))
        assert r["gathered"].tolist() == [0, 0, 1, 1]
        assert r["obj"] == {"from": 0} and r["least"] == [5, 8] and r["each"] == [[5, -2**63], [6, -2**63 + 1]]
        assert r["held"] == 5  # control_barrier, 2 broadcasts, min, gather
    assert (r0["recv_counts"], r0["received"]) == ([1, 0], [0.0])
    assert (r1["recv_counts"], r1["received"]) == ([2, 1], [1.0, 2.0, 10.0])


def _late_control_barrier(timeout: float) -> tuple[float, str]:
    """Rank 1 comes to the control barrier 5 s after rank 0's gave up: rank 0's raises after `timeout` seconds
    (the control group's own timeout is a year), and rank 1's late arrival completes it."""
    state = get_parallel()
    start, error = time.time(), ""
    if state.rank == 1:
        time.sleep(timeout + 5)
        comm.control_barrier(state, timeout=60)
    else:
        try:
            comm.control_barrier(state, timeout)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    return time.time() - start, error


def test_the_rendezvous_store_listens_from_its_start_to_its_drop():
    """At the address asked for, or on a port the system picks; listening as soon as it returns, so that no rank
    ever calls a port nothing listens on, and no longer once dropped."""
    port = free_port()
    store, addr = rendezvous_store(f"127.0.0.1:{port}", 5)
    assert addr == f"127.0.0.1:{port}" and store.port == port
    store, addr = rendezvous_store(None, 5)
    host, _, port = addr.rpartition(":")
    assert host == "127.0.0.1" and int(port) == store.port
    socket.create_connection((host, int(port)), timeout=5).close()
    del store
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=5)


def test_a_rendezvous_address_this_machine_cannot_listen_at_is_one_error():
    """A port in use, a host that does not resolve or is another machine's: a ValueError naming the flag at once (the
    store's own errors were a traceback, or retries for the whole timeout)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for addr, reason in [(f"127.0.0.1:{port}", "Address already in use"), ("nohost.invalid:31997", ""),
                             ("192.0.2.1:31997", "Cannot assign requested address")]:  # TEST-NET-1, nobody's
            start = time.monotonic()
            with pytest.raises(ValueError, match=f"cannot listen on {addr} \\(--dist-init-addr\\): .*{reason}"):
                rendezvous_store(addr, 5)
            assert reason == "" or time.monotonic() - start < 4  # a name lookup takes what the resolver takes


def test_a_rank_at_an_address_that_takes_connections_but_is_no_store_fails_in_its_timeout():
    """Another program's port (here one that never answers): TCPStore's first exchange waited for good."""
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        addr = f"127.0.0.1:{mute.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(ValueError, match=f"{addr} does not answer as the rendezvous store of rank 0 "
                                             "\\(--dist-init-addr\\) within 2 s"):
            init_parallel(2, rank=1, init_method=f"tcp://{addr}", timeout=2)
        assert time.monotonic() - start < 30


def test_a_rendezvous_at_a_bracketed_ipv6_address():
    """dist_init_addr "[::1]:port", as in a URL: the store listens there and a rank reaches it."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            port = s.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback here")
    store, addr = rendezvous_store(f"[::1]:{port}", 5)
    assert addr == f"[::1]:{port}"
    client = launch._store(addr, 5)
    client.set("key", "value")
    assert store.get("key") == b"value"


@pytest.mark.skipif(not os.path.exists("/proc/sys/net/ipv4/ip_local_port_range"), reason="Linux only")
def test_free_ports_lie_below_the_ephemeral_ones():
    """So that no client calling a server before it listens is handed the server's port as its own local one."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(1024 <= p < low for p in ports) or low <= 8192 + 1024, ports


def test_the_control_barrier_gives_up_after_its_timeout():
    (waited, error), (_, late) = run_ranks(2, _late_control_barrier, 2.0)
    assert 2.0 <= waited < 2.0 + 4 and "timed out" in error.lower(), (waited, error)
    assert late == ""


class _Ends:
    """A CUDA event whose work ends after `polls` queries (never, for None), recorded or not."""
    def __init__(self, polls: int | None):
        self.polls = polls

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls < 0


class _DeviceCounts:
    """A device tensor whose read waits for the device: read only once the device's work is done."""
    is_cuda, device = True, "cuda:1"

    def __init__(self, done: _Ends):
        self.done = done

    def tolist(self) -> list[int]:
        assert self.done.query(), "the host read the device without waiting for its work with a deadline"
        return [3, 1]


def test_a_host_read_of_the_device_waits_at_most_the_timeout(monkeypatch):
    """The counted all-to-all reads its counts on the host mid-step: where a peer died or hangs (NCCL), the collectives
    before the read never end; the read raises after the world's timeout instead of waiting for good."""
    state = ParallelState(timeout=0.2)
    streams = []  # the stream each event is recorded on: x's device's
    monkeypatch.setattr(comm.torch.cuda, "current_stream", lambda device=None: streams.append(device))
    never = _Ends(None)
    monkeypatch.setattr(comm.torch.cuda, "Event", lambda: never)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not end within dist_timeout \(0.2 s\)"):
        comm.host_values(state, _DeviceCounts(never))
    assert 0.2 <= time.monotonic() - start < 0.2 + 1
    soon = _Ends(50)
    monkeypatch.setattr(comm.torch.cuda, "Event", lambda: soon)
    assert comm.host_values(state, _DeviceCounts(soon)) == [3, 1]
    assert streams == ["cuda:1", "cuda:1"]
    assert comm.host_values(state, torch.tensor([2, 0])) == [2, 0]  # on a CPU: at once


def test_a_wait_for_the_device_gives_up_once_told_why():
    """wait_event asks `give_up` now and then while the work runs: the first reason it names ends the wait (a peer
    known dead), long before the timeout; work that ends first is waited for."""
    asked = []

    def give_up() -> str | None:
        asked.append(time.monotonic())
        return "rank 1 failed" if len(asked) == 3 else None
    start = time.monotonic()
    with pytest.raises(comm.PeerFailed, match="rank 1 failed"):
        comm.wait_event(_Ends(None), 60, give_up)
    assert len(asked) == 3 and time.monotonic() - start < 5
    assert all(b - a >= comm.GIVE_UP_POLL_SECONDS for a, b in zip([start, *asked], asked))
    comm.wait_event(_Ends(50), 60, lambda: None)


def test_a_host_read_of_the_device_gives_up_once_a_peer_is_known_to_have_failed(monkeypatch):
    """Rank 0's model reads the all-to-all's counts mid-step: where its state knows a peer failed (Workers'
    peers_failed), the read raises at once rather than after the world's timeout."""
    never = _Ends(None)
    monkeypatch.setattr(comm.torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(comm.torch.cuda, "Event", lambda: never)
    state = ParallelState(timeout=60, peers_failed=lambda: "rank 1 failed")
    start = time.monotonic()
    with pytest.raises(comm.PeerFailed, match="rank 1 failed"):
        comm.host_values(state, _DeviceCounts(never))
    assert time.monotonic() - start < 5


def _fail(rank: int) -> None:
    if rank == 1:
        raise RuntimeError("rank one gives up")
    time.sleep(60)


def test_a_failed_rank_is_described():
    ranks = LocalRanks(_fail, range(1, 3), ())
    try:
        deadline = time.time() + 60
        while 1 not in ranks.dead() and time.time() < deadline:
            time.sleep(0.1)
        os.kill(ranks.procs[2].pid, signal.SIGKILL)
        text = ranks.describe()
        assert "rank 1 failed" in text and "RuntimeError: rank one gives up" in text
        assert "rank 2 exited with code -9 (signal 9)" in text
    finally:
        ranks.stop(timeout=1)
