"""The job's store as torch.distributed sees it (docs/store.md).

One key-value store for the whole job, kept by the controller: a key one worker
sets is one every other worker gets, through recoveries (the controller outlives
workers) and through a controller takeover (the store is journaled). It is the
default group's store, so torch code that meets through a store (a library's
rendezvous, a counter, a flag, ``dist.distributed_c10d._get_default_store()``)
works under nonstop; ``nonstop.torch.store()`` returns it.

One exception: torch's start-up barrier (``_store_based_barrier``), which counts
each rank's arrival in the store under ``store_based_barrier_key``, is answered
here, in this process: nonstop forms a group from the controller's plan, once
all its members are in, and forms the default group again after each recovery
(a count kept across generations would never equal the world again).
"""

from __future__ import annotations

import datetime
import re
from typing import Any, Dict, List, Optional

import torch.distributed as dist

# torch's default store timeout (TCPStore's): how long get and wait wait for a key.
DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)
_PREFIX = getattr(dist.distributed_c10d, "STORE_BASED_BARRIER_PREFIX", "store_based_barrier_key")
# The barrier's keys as torch names them (under a group's prefix): "<prefix>:<n>", and torch >= 2's
# "<prefix>:<n>:last_worker".
_BARRIER_KEY = re.compile(r"(^|/)" + re.escape(_PREFIX) + r":\d+(:last_worker)?$")


def _key(key: Any) -> str:
    """torch's stores take str keys (and bytes): the job's store keeps UTF-8 text."""
    if isinstance(key, (bytes, bytearray)):
        try:
            return bytes(key).decode()
        except UnicodeDecodeError:
            raise ValueError(f"a key of the job's store is UTF-8 text: {bytes(key)!r} is not") from None
    return key


def _barrier(key: str) -> bool:
    return _BARRIER_KEY.search(key) is not None


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)  # bytes, bytearray, or the list of ints torch's C++ side passes


def _seconds(timeout: Any) -> float:
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    if seconds < 0:
        raise ValueError(f"a store timeout of {seconds} s: give 0 (for ever) or more")
    return seconds


class JobStore(dist.Store):
    """torch's Store interface over the session's store (nonstop._core.Store).
    Every call waits at most the store's timeout (``set_timeout``; 300 s by
    default; 0 waits for ever) and raises RuntimeError saying what went wrong
    (a timeout says "Socket Timeout", as torch's TCPStore), ValueError for a
    key that is not text; ``get`` and ``wait`` wait for their keys, and raise
    nonstop.Aborted when a member fails meanwhile (the step runs again)."""

    def __init__(self, native: Any, world_size: int) -> None:
        super().__init__()
        self._native = native
        self._world = world_size
        self._barrier: Dict[str, bytes] = {}  # the start-up barrier's keys (the module's doc)
        self._timeout: Optional[datetime.timedelta] = None

    def _limit(self) -> float:
        # set_timeout through a PrefixStore sets the C++ side's timeout, which `timeout` reads.
        timeout = self._timeout
        if timeout is None:
            timeout = getattr(self, "timeout", None)
        return _seconds(DEFAULT_TIMEOUT if timeout is None else timeout)

    def set_world(self, world_size: int) -> None:
        self._world = world_size

    def set_timeout(self, timeout: Any) -> None:
        self._timeout = timeout if isinstance(timeout, datetime.timedelta) else \
            datetime.timedelta(seconds=float(timeout))

    def set(self, key: str, value: Any) -> None:
        key = _key(key)
        if _barrier(key):
            self._barrier[key] = _bytes(value)
            return
        self._native.set(key, _bytes(value), self._limit())

    def get(self, key: str) -> bytes:
        key = _key(key)
        if _barrier(key):
            return self._barrier.get(key, str(self._world).encode())
        return self._native.get(key, self._limit())

    def add(self, key: str, amount: int) -> int:
        key = _key(key)
        if _barrier(key):
            self._barrier[key] = str(self._world).encode()
            return self._world
        return int(self._native.add(key, int(amount), self._limit()))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        key = _key(key)
        return self._native.compare_set(key, _bytes(expected), _bytes(desired), self._limit())

    def append(self, key: str, value: Any) -> None:
        key = _key(key)
        self._native.append(key, _bytes(value), self._limit())

    def wait(self, keys: List[str], timeout: Any = None) -> None:
        keys = [_key(k) for k in keys]
        keys = [k for k in keys if not _barrier(k)]
        self._native.wait(keys, self._limit() if timeout is None else _seconds(timeout))

    def check(self, keys: List[str]) -> bool:
        keys = [_key(k) for k in keys]
        return self._native.check([k for k in keys if not _barrier(k)], self._limit()) and \
            all(k in self._barrier for k in keys if _barrier(k))

    def num_keys(self) -> int:
        return int(self._native.num_keys(self._limit()))

    def delete_key(self, key: str) -> bool:
        key = _key(key)
        if _barrier(key):
            return self._barrier.pop(key, None) is not None
        return bool(self._native.delete_key(key, self._limit()))

    def multi_get(self, keys: List[str]) -> List[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: List[str], values: List[Any]) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    # torch 1.13's C++ side calls the Python methods by its own names on some paths (a
    # PrefixStore over this one).
    getNumKeys = num_keys
    deleteKey = delete_key
