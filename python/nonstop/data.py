"""nonstop.data: memory-mapped token shards and the deterministic sampler.

The samples of step s depend only on (the dataset, the seed, s, the global
batch), never on the world size or on faults: micro-batch i of step s is a
fixed set of samples, and the micro-batches of a step are dealt to the ranks
in contiguous blocks. So a run that recovers, shrinks or grows reads exactly
the data of the fault-free run. Shards are memory-mapped: a worker that
replaces a lost one finds them in the page cache already.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from . import _core

__all__ = ["Dataset", "Sampler", "prepare"]


def prepare(inputs: Sequence[str], output_dir: str, *, strip_fortune_separators: bool = False) -> bool:
    """Turns text files into byte-level token shards in `output_dir` unless it
    holds a complete set already (safe when several workers call it at once).
    Returns True when this call prepared them."""
    return _core.prepare_if_missing(list(inputs), output_dir, strip_fortune_separators)


class Dataset:
    """Token shards (a directory of *.bin, or one file) cut into samples of
    `seq_len` + 1 tokens (inputs, and the targets shifted by one)."""

    def __init__(self, shards: str, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        self._ds = _core.Dataset.open(shards, seq_len)

    @property
    def num_samples(self) -> int:
        return self._ds.num_samples

    @property
    def seq_len(self) -> int:
        return self._ds.seq_len

    @property
    def max_token(self) -> int:
        return self._ds.max_token

    def batch(self, samples: Sequence[int]) -> Any:
        """A torch.int64 tensor [len(samples), seq_len + 1] of the samples' tokens."""
        import torch

        out = torch.empty((len(samples), self.seq_len + 1), dtype=torch.int64)
        self._ds.fill([int(s) for s in samples], out.data_ptr())
        return out


class Sampler:
    """Which samples make each step's global batch, and which micro-batches
    each rank computes."""

    def __init__(self, num_samples: int, global_batch: int, micro_batch: int, seed: int = 0) -> None:
        self._s = _core.Sampler(num_samples, seed, global_batch, micro_batch)
        self.global_batch = global_batch
        self.micro_batch = micro_batch

    @property
    def micro_batches_per_step(self) -> int:
        return self._s.micro_batches_per_step

    def micro_batches(self, rank: int, world_size: int) -> range:
        """The micro-batch indices of a step that `rank` of `world_size` computes."""
        begin, end = self._s.micro_batches_for(rank, world_size)
        return range(begin, end)

    def samples(self, step: int, micro: int) -> List[int]:
        """The sample indices of micro-batch `micro` of step `step`."""
        if not 0 <= micro < self.micro_batches_per_step:
            raise ValueError(f"micro-batch {micro} of a step with {self.micro_batches_per_step}")
        if step < 0:
            raise ValueError(f"step {step} is negative")
        return self._s.micro_batch_samples(step, micro)
