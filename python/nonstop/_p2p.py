"""torch.distributed's point-to-point calls over a nonstop session: send, recv,
isend, irecv and batch_isend_irecv.

Each peer and direction has a thread of its own that runs its calls in the
order they were made (Session.send/recv: a connection a direction, so a send
and a receive between two ranks run at once and an exchange in which both
sides send first cannot deadlock). A blocking call is the same call waited
for. A fault makes the call raise nonstop.Aborted from wait(), and every
call still running is waited for before a recovery (the session's
communicator is replaced there).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Any, Callable, Dict, Set, Tuple

import torch
from torch._C._distributed_c10d import Work as _TorchWork

from . import _device


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
        return self._source

    def _source_rank(self) -> int:
        return self._source

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


_lanes: Dict[Tuple[int, str], _Lane] = {}
_pending: Set[concurrent.futures.Future] = set()  # calls not yet done (each leaves when done)


def start(session: Any, peer: int, tensor: Any, sending: bool) -> Work:
    """Queues a send of `tensor` to, or a receive into it from, world rank `peer`."""
    _device.device_index(tensor, "a point-to-point tensor")
    if not tensor.is_contiguous():
        raise ValueError("a point-to-point tensor must be contiguous: pass .contiguous()")
    if peer == session.rank:
        raise ValueError(f"rank {peer} {'sends to' if sending else 'receives from'} itself")
    size = tensor.numel() * tensor.element_size()
    move = session._core.send if sending else session._core.recv

    def call() -> None:
        _device.on_host(tensor, "send" if sending else "recv", lambda host: move(peer, host.data_ptr(), size),
                        write_back=not sending)

    key = (peer, "send" if sending else "recv")
    if key not in _lanes:
        _lanes[key] = _Lane()
    return Work(_lanes[key].submit(call), tensor, peer)


def wait_all() -> None:
    """Before a recovery: every call still running ends (a fault has aborted them) before the
    session's communicator is replaced. Their failures are the step's, already raised."""
    for future in list(_pending):
        try:
            future.result()
        except Exception:
            pass
