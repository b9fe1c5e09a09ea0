"""torch.distributed's point-to-point calls over a nonstop session: send, recv,
isend, irecv and batch_isend_irecv.

Each peer and direction has a thread of its own that runs its calls in the
order they were made (Session.send/recv: a connection a direction, so a send
and a receive between two ranks run at once and an exchange in which both
sides send first cannot deadlock). A blocking call is the same call waited
for. The script's messages carry their tag (a header before each: tag and
size): a receive takes the first message of its tag from its peer, and one of
another tag that comes first is read ahead and kept for the receive of that
tag, as Gloo matches tags. A fault makes the call raise nonstop.Aborted from wait(), and every
call still running is waited for before a recovery (the session's
communicator is replaced there).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import queue
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch._C._distributed_c10d import Work as _TorchWork

from . import _device
from ._collectives import check_bytes, nbytes


class _Lane:
    """One peer and direction's calls, in order, on a daemon thread (a receive that never
    completes must not hold the interpreter's exit)."""

    def __init__(self) -> None:
        self._calls: "queue.SimpleQueue[Tuple[concurrent.futures.Future, Callable[[], Any]]]" = queue.SimpleQueue()
        threading.Thread(target=self._run, name="nonstop-p2p", daemon=True).start()

    def submit(self, call: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, call))
        return future

    def _run(self) -> None:
        while True:
            future, call = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as e:  # handed to wait(), on the caller's thread
                future.set_exception(e)


class Work(_TorchWork):
    """A point-to-point call's handle: wait() raises what the call raised (nonstop.Aborted)."""

    def __init__(self, future: concurrent.futures.Future, tensor: Any, source: int) -> None:
        super().__init__()
        self._call, self._tensor, self._source = future, tensor, source
        _pending.add(future)
        future.add_done_callback(_pending.discard)

    def wait(self, timeout: Any = None) -> bool:
        self._call.result()
        return True

    def is_completed(self) -> bool:
        return self._call.done()

    def is_success(self) -> bool:
        return self._call.done() and self._call.exception() is None

    def source_rank(self) -> int:
        if self._source < 0:  # a receive from any source: its sender, once it came
            return int(self._call.result())
        return self._source

    _source_rank = source_rank  # torch 1.13's name

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()

        def done(call: concurrent.futures.Future) -> None:
            error = call.exception()
            if error is None:
                future.set_result([self._tensor])
            else:
                future.set_exception(error)

        self._call.add_done_callback(done)
        return future


_lanes: Dict[Tuple[int, str, int], _Lane] = {}  # (peer, "send" or "recv", channel)
_pending: Set[concurrent.futures.Future] = set()  # calls not yet done (each leaves when done)


# Why point-to-point is in error until the next recovery (a monitored_barrier that failed leaves
# receives pending, which would take the next messages of their peers); None: it is not.
_broken: Optional[str] = None
_any: Optional[concurrent.futures.Future] = None  # the last receive from any source queued
_HEADER = struct.Struct("<qq")  # before each of the script's messages: its tag and its bytes
_MAX_MESSAGE = 1 << 40  # a header saying more is no header: the connection is out of step
# Messages read ahead of their receive (another tag came first), by peer, in the order they came.
_early: Dict[int, List[Tuple[int, torch.Tensor]]] = {}
_early_lock = threading.Lock()
_receiving: Dict[concurrent.futures.Future, int] = {}  # receives from a given rank not yet done: its rank


def start(session: Any, peer: int, tensor: Any, sending: bool, channel: int = 0, tag: int = 0) -> Work:
    """Queues a send of `tensor` to, or a receive into it from, world rank `peer`: on channel 0,
    the script's own messages (with their `tag`), or 1, those of collectives made of
    point-to-point calls (all_to_all, monitored_barrier), which a receive of the script's never
    takes."""
    _check(tensor)
    if peer == session.rank:
        raise ValueError(f"rank {peer} {'sends to' if sending else 'receives from'} itself")
    size = nbytes(tensor)
    move = session._core.send if sending else session._core.recv

    def call() -> None:
        if sending and channel == 0:
            header = torch.frombuffer(bytearray(_HEADER.pack(int(tag), size)), dtype=torch.uint8)
            session._core.send(peer, header.data_ptr(), _HEADER.size, 0)
        _device.on_host(tensor, "send" if sending else "recv",
                        lambda host: move(peer, host.data_ptr(), size, channel), write_back=not sending)

    if sending:
        return Work(_lane((peer, "send", channel)).submit(call), tensor, peer)
    if channel:
        return Work(_lane((peer, "recv", channel)).submit(call), tensor, peer)

    def receive() -> None:
        early = _take_early([peer], tag)
        while early is None:
            got_tag, got_size = _read_header(session, peer)
            if got_tag == tag and got_size == size:
                return call()
            early = _read_ahead(session, peer, got_tag, got_size, tag)
        _fill(tensor, early[1], peer, tag)

    future = _lane((peer, "recv", 0)).submit(_after_any(receive))
    _receiving[future] = peer
    future.add_done_callback(lambda f: _receiving.pop(f, None))
    return Work(future, tensor, peer)


def start_any(session: Any, tensor: Any, tag: int = 0) -> Work:
    """Queues a receive into `tensor` of the first message of `tag` from whichever rank of the
    world sends one, of those without a receive queued before it still to come (their next
    message is that one's); the receives queued after it wait for it (Session.recv_any reads
    those peers' connections)."""
    global _any
    _check(tensor)
    # Not from a peer whose receive queued before it is still to come: that message is its.
    busy = set(_receiving.copy().values())
    ranks = [r for r in range(session.world_size) if r != session.rank and r not in busy]
    if not ranks:
        raise RuntimeError("a receive from any source while every other rank has a receive of its own pending: "
                           "wait for those first")
    size = nbytes(tensor)

    def call() -> int:
        early = _take_early(ranks, tag)
        while early is None:
            header = torch.empty(_HEADER.size, dtype=torch.uint8)
            peer = session._core.recv_any(ranks, header.data_ptr(), _HEADER.size)
            got_tag, got_size = _HEADER.unpack(header.numpy().tobytes())
            if got_tag == tag and got_size == size:
                _device.on_host(tensor, "recv", lambda host: session._core.recv(peer, host.data_ptr(), size, 0))
                return peer
            early = _read_ahead(session, peer, got_tag, got_size, tag)
        _fill(tensor, early[1], early[0], tag)
        return early[0]

    _any = _lane((-1, "recv", 0)).submit(call)
    return Work(_any, tensor, -1)


def _read_header(session: Any, peer: int) -> Tuple[int, int]:
    header = torch.empty(_HEADER.size, dtype=torch.uint8)
    session._core.recv(peer, header.data_ptr(), _HEADER.size, 0)
    return _HEADER.unpack(header.numpy().tobytes())


def _read_ahead(session: Any, peer: int, got_tag: int, got_size: int, tag: int) -> Optional[Tuple[int, torch.Tensor]]:
    """Reads the payload of a message whose header came: (peer, its bytes) if it is of `tag` (of
    another size than the receive's), else kept for the receive of its tag, and None."""
    global _broken
    if got_size < 0 or got_size > _MAX_MESSAGE:
        _broken = f"rank {peer} sent a message header of {got_size} bytes: its connection is out of step"
        raise RuntimeError(_broken)
    payload = torch.empty(got_size, dtype=torch.uint8)
    session._core.recv(peer, payload.data_ptr(), got_size, 0)  # a 0-byte message is a frame too
    if got_tag == tag:
        return peer, payload
    with _early_lock:
        _early.setdefault(peer, []).append((got_tag, payload))
    return None


def _take_early(peers: List[int], tag: int) -> Optional[Tuple[int, torch.Tensor]]:
    """The first message of `tag` read ahead from one of `peers`: (peer, its bytes)."""
    with _early_lock:
        for peer in peers:
            kept = _early.get(peer, [])
            for i, (got_tag, payload) in enumerate(kept):
                if got_tag == tag:
                    del kept[i]
                    return peer, payload
    return None


def _fill(tensor: Any, payload: torch.Tensor, peer: int, tag: int) -> None:
    size = nbytes(tensor)
    if payload.numel() != size:
        raise RuntimeError(f"rank {peer} sent a message of tag {tag} of {payload.numel()} bytes to a receive of "
                           f"{size} bytes: send and receive tensors of the same size")
    _device.on_host(tensor, "recv", lambda host: ctypes.memmove(host.data_ptr(), payload.data_ptr(), size),
                    write_back=True)


def _check(tensor: Any) -> None:
    if _broken is not None:
        raise RuntimeError(f"point-to-point calls are in error until the next recovery: {_broken}")
    check_bytes(tensor, "a point-to-point tensor")


def _after_any(call: Callable[[], Any]) -> Callable[[], Any]:
    """A receive queued after a receive from any source waits for that one first."""
    before = _any

    def after() -> Any:
        if before is not None:
            concurrent.futures.wait([before])
        return call()

    return after


def _lane(key: Tuple[int, str, int]) -> _Lane:
    if key not in _lanes:
        _lanes[key] = _Lane()
    return _lanes[key]


def monitored_barrier(session: Any, comm: Any, timeout: Any, wait_all_ranks: bool) -> None:
    """torch's monitored_barrier, as Gloo runs it: every rank of `comm` but its first sends that
    rank a token and waits for its answer; the first waits for each in rank order until `timeout`
    and names the first rank that did not arrive (every one, with `wait_all_ranks`). A failure
    leaves receives pending: point-to-point calls are in error until the next recovery."""
    global _broken
    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    ms = int(seconds * 1000)
    deadline = time.monotonic() + seconds
    if comm.rank == 0:
        if seconds <= 0:
            raise RuntimeError(f"Rank 0 timed out in monitoredBarrier after {ms} ms")
        arrivals = [(r, start(session, comm.world_rank(r), torch.zeros(1), sending=False, channel=1))
                    for r in range(1, comm.world_size)]
        missing = []
        for r, work in arrivals:
            try:
                work._call.result(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                missing.append(r)
                if not wait_all_ranks:
                    break
        if missing:
            _broken = f"a monitored_barrier waits for rank {missing[0]}, which did not arrive"
            if wait_all_ranks:
                raise RuntimeError(f"Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier in "
                                   f"{ms} ms")
            raise RuntimeError(f"Rank {missing[0]} failed to pass monitoredBarrier in {ms} ms")
        for work in [start(session, comm.world_rank(r), torch.zeros(1), sending=True, channel=1)
                     for r in range(1, comm.world_size)]:
            work.wait()
        return
    start(session, comm.world_rank(0), torch.zeros(1), sending=True, channel=1)
    answer = start(session, comm.world_rank(0), torch.zeros(1), sending=False, channel=1)
    try:
        answer._call.result(timeout=max(0.0, deadline - time.monotonic()))
    except concurrent.futures.TimeoutError:
        _broken = "a monitored_barrier waits for rank 0's answer, which did not come"
        raise RuntimeError(f"Rank {comm.rank} successfully reached monitoredBarrier, but received errors while "
                           f"waiting for send/recv from rank 0 (no answer in {ms} ms)") from None


def wait_all() -> None:
    """Before a recovery: every call still running ends (a fault has aborted them) before the
    session's communicator is replaced. Their failures are the step's, already raised."""
    global _broken
    _broken = None
    for future in list(_pending):
        try:
            future.result()
        except Exception:
            pass
    with _early_lock:  # the next generation's connections carry none of them
        _early.clear()
