"""CUDA tensors on nonstop's host data plane (issue 30, docs/gpu.md "Python"). Private.

nonstop's collectives read and write host memory. A tensor on a GPU goes
through a pinned host twin, as torch's Gloo backend stages CUDA tensors:
torch's current stream on the tensor's device is synchronized first (the
kernels that wrote the tensor are done), the tensor is copied down, the
collective runs on the twin, and the result is copied back up. Registered
state on a GPU is not staged here: it is registered as device memory
(``device_index``), which the native half reads and writes through CUDA;
but a sharded model's registered state is a host copy of its GPU parameters
(``host_copy``, ``copy``: nonstop/sharded.py), as sharded state lives in host
memory.

``_stage_cpu_tensors`` (tests only) stages CPU tensors too, through a host
twin of their own, so the staging runs on a machine without a GPU.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import torch

_stage_cpu_tensors = False
twins: Dict[str, int] = {}  # how many twins this process made, by call site (for the tests)


def device_index(t: Any, what: str) -> int:
    """-1 for a CPU tensor, N for one on cuda:N; ValueError naming other devices."""
    kind = t.device.type
    if kind == "cpu":
        return -1
    if kind == "cuda":
        return 0 if t.device.index is None else int(t.device.index)
    raise ValueError(f"{what} is on {t.device}: nonstop takes CPU and CUDA tensors; move it with .cpu() or .cuda()")


def staged(t: Any) -> bool:
    """Whether a collective on `t` runs on a host twin."""
    return t.device.type != "cpu" or _stage_cpu_tensors


class Twin:
    """`t`'s pinned host copy for one collective at call site `site` ("bucket",
    "loan", "tree.add"...): ``host`` holds `t`'s bytes once made, ``up()``
    writes the result back into `t`. For a CPU tensor that is not staged,
    ``host`` is `t` and ``up()`` does nothing."""

    def __init__(self, t: Any, site: str) -> None:
        self.tensor = t
        if not staged(t):
            self.host = t
            return
        self.host = host_copy(t, site)

    def up(self) -> None:
        if self.host is not self.tensor:
            self.tensor.copy_(self.host)


def host_copy(t: Any, site: str) -> Any:
    """A host buffer of `t`'s shape and dtype (pinned for a CUDA tensor) holding `t`'s bytes,
    copied as ``copy`` copies."""
    if t.device.type == "cuda":
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    else:
        host = torch.empty_like(t)
    copy(host, t, site)
    return host


def copy(dst: Any, src: Any, site: str) -> None:
    """``dst.copy_(src)`` between a tensor and its host copy (`site` counts it, as a twin),
    once the kernels that wrote a CUDA `src` are done (they run on torch's current stream:
    wait for them); it returns when the copy is."""
    twins[site] = twins.get(site, 0) + 1
    if src.device.type == "cuda":
        torch.cuda.current_stream(src.device).synchronize()
    dst.copy_(src)
    if dst.device.type == "cuda":
        torch.cuda.current_stream(dst.device).synchronize()


def on_host(t: Any, site: str, run: Callable[[Any], Any], write_back: bool = True) -> Any:
    """``run(host)`` on `t`'s host twin; the twin's bytes copied back into `t`
    when `write_back` (and `run` returned without raising). Returns run's result."""
    twin = Twin(t, site)
    result = run(twin.host)
    if write_back:
        twin.up()
    return result


def completion(twin: Twin, done: Callable[[bool, str], None],
               failed: Callable[[str], None]) -> Callable[[bool, str], None]:
    """A reduction's completion callback (on the communication thread) that first
    copies a reduced twin back up. A copy that fails is told to `failed`, naming
    why, and `done` still runs: the sum itself completed."""

    def finish(ok: bool, message: str) -> None:
        if ok:
            try:
                twin.up()
            except Exception as e:
                failed(f"copying a reduced gradient bucket back to {twin.tensor.device} failed: {e}")
        done(ok, message)

    return finish
