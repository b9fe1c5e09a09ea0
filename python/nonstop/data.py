"""nonstop.data: memory-mapped token shards and the deterministic sampler.

The samples of step s depend only on (the dataset, the seed, s, the global
batch), never on the world size or on faults: micro-batch i of step s is a
fixed set of samples, and the micro-batches of a step are dealt to the ranks
in contiguous blocks. So a run that recovers, shrinks or grows reads exactly
the data of the fault-free run. Shards are memory-mapped: a worker that
replaces a lost one finds them in the page cache already.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from . import _core

__all__ = ["DataLoader", "Dataset", "DistributedSampler", "Sampler", "prepare"]


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


# ---- exact sampling for DataLoader loops ----

# The loader's position, registered with the session's extra (it survives a
# fault with the model): the step count, the epoch, the global batches done
# in it and the samples they took, the global batch and the world when the
# job first formed, and the learning-rate factor's warm-up (from, to, the
# step it started, the world it is for).
_STEPS, _EPOCH, _BATCH, _OFFSET = ("nonstop.data.steps", "nonstop.data.epoch", "nonstop.data.batch",
                                   "nonstop.data.offset")
_GLOBAL, _BASE_WORLD = "nonstop.data.global_batch", "nonstop.data.base_world"
_LR_FROM, _LR_TO, _LR_CHANGE, _LR_WORLD = ("nonstop.data.lr_from", "nonstop.data.lr_to", "nonstop.data.lr_change",
                                           "nonstop.data.lr_world")


class DistributedSampler:
    """torch's DistributedSampler for nonstop (the same constructor and
    ``set_epoch``): each epoch is a permutation of the dataset (seeded with
    ``seed + epoch``, as torch's), cut into global batches of a size fixed for
    the whole job, and each global batch is dealt over the live world in
    contiguous shares. So an epoch's samples are seen exactly once however
    often the world changes. Use it with :class:`DataLoader`, which keeps its
    position in the registered state."""

    def __init__(self, dataset: Any, num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        if num_replicas is not None or rank is not None:
            raise ValueError("nonstop.data.DistributedSampler deals each step over the live world: drop "
                             "num_replicas= and rank= (the world changes while the job runs)")
        self.dataset = dataset
        self.num_samples_total = len(dataset)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch: Optional[int] = None  # as set_epoch left it (None: never called)
        self._fresh = False  # set_epoch was called, and no loop of that epoch has trained or ended since
        self._order: Tuple[int, Optional[List[int]]] = (-1, None)

    def set_epoch(self, epoch: int) -> None:
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            raise TypeError(f"the epoch is an int, got {epoch!r}")
        if epoch < 0:
            raise ValueError(f"epoch {epoch} is negative")
        self.epoch = int(epoch)
        self._fresh = True

    def order(self, epoch: int) -> List[int]:
        """The dataset's indices in epoch `epoch`'s order. A sampler whose set_epoch was never
        called gives every epoch the order of epoch 0, as torch's does."""
        if self._order[0] != epoch:
            if self.shuffle:
                import torch

                g = torch.Generator()
                g.manual_seed(self.seed + (epoch if self.epoch is not None else 0))
                order = torch.randperm(self.num_samples_total, generator=g).tolist()
            else:
                order = list(range(self.num_samples_total))
            self._order = (epoch, order)
        return self._order[1]  # type: ignore[return-value]

    def batches_left(self, offset: int, global_batch: int) -> int:
        """Global batches left in an epoch from sample `offset` on."""
        left = self.num_samples_total - offset
        if left <= 0:
            return 0
        return left // global_batch if self.drop_last else max(1, left // global_batch)

    def batch(self, epoch: int, offset: int, global_batch: int) -> List[int]:
        """The indices of the global batch that starts at sample `offset` of
        `epoch`. Without drop_last, the samples left over after the epoch's
        last whole global batch join it (a partial batch could have fewer
        samples than the world has ranks)."""
        last = self.batches_left(offset, global_batch) == 1 and not self.drop_last
        return self.order(epoch)[offset:None if last else offset + global_batch]

    def share(self, epoch: int, offset: int, global_batch: int, rank: int, world: int) -> Tuple[List[int], int]:
        """(rank's indices of that global batch, the batch's size): contiguous
        shares, as even as possible."""
        whole = self.batch(epoch, offset, global_batch)
        n = len(whole)
        lo, hi = rank * n // world, (rank + 1) * n // world
        return whole[lo:hi], n

    def __iter__(self) -> Iterator[int]:
        raise TypeError("nonstop.data.DistributedSampler is dealt step by step by nonstop.data.DataLoader: "
                        "pass it as DataLoader(dataset, batch_size=..., sampler=sampler)")

    def __len__(self) -> int:
        return self.num_samples_total


# The loaders this process made: the one a DistributedDataParallel registers when the script made
# its process group first (nonstop.torch.init_process_group(backend=...)), the first one made.
_made: "weakref.WeakSet[DataLoader]" = weakref.WeakSet()
_made_count = 0
# The session a loader of this process was registered with: the others evaluate over its live world.
_joined: Any = None
_last_handed_by: Any = None  # the loader that handed out the last batch


_NOT_THE_REGISTERED = ("; this process made several nonstop.data.DataLoaders and the one registered as the "
                       "training loader (the first made, unless the script named it) is not the one this loop "
                       "trains on: make the training loader first, or pass it: "
                       "nonstop.torch.init_process_group(model, optimizer, loader)")


def made_in_order() -> List["DataLoader"]:
    """The loaders of this process still alive, in the order the script made them."""
    return sorted(_made, key=lambda loader: loader._made_at)


class DataLoader:
    """torch.utils.data.DataLoader's constructor, for a loop that survives
    faults and resizes with its data exact. `batch_size` is each rank's batch
    when the job first forms: with `batch_policy="fixed"` (the default) the
    global batch (batch_size x that world) stays fixed after, and each step's
    is dealt over the live world; with "scale-with-world" it follows the world
    (batch_size per rank), and each optimizer update runs with its learning
    rate scaled by the world's ratio to the first one (`lr_scaling`: "linear"
    or "sqrt"), warmed up over `lr_warmup_steps` after each change: the policy
    of nonstop-train (nonstop/elastic.h). Iterating
    yields this rank's share of each remaining global batch of the epoch
    (``sampler.set_epoch(e)`` first, as with torch); asking for the next batch
    tells the controller the last step completed. The position is part of the
    registered state: register the loader with
    ``nonstop.torch.init_process_group(model, optimizer, loader)``.
    Other keyword arguments (num_workers, collate_fn, pin_memory, ...) go to
    torch's DataLoader, which loads the shares."""

    def __init__(self, dataset: Any, batch_size: int = 1, shuffle: Optional[bool] = None,
                 sampler: Optional[DistributedSampler] = None, drop_last: bool = False, *,
                 batch_policy: str = "fixed", lr_scaling: str = "linear", lr_warmup_steps: int = 0,
                 **kwargs: Any) -> None:
        if batch_size is None or int(batch_size) < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        _core.lr_factor(batch_policy, lr_scaling, 1, 1)  # ValueError naming a policy or scaling it does not know
        if lr_warmup_steps < 0:
            raise ValueError(f"lr_warmup_steps must be 0 or more, got {lr_warmup_steps}")
        self.batch_policy, self.lr_scaling, self.lr_warmup_steps = batch_policy, lr_scaling, int(lr_warmup_steps)
        if sampler is None:
            sampler = DistributedSampler(dataset, shuffle=bool(shuffle), drop_last=drop_last)
        elif not isinstance(sampler, DistributedSampler):
            raise TypeError(f"sampler must be a nonstop.data.DistributedSampler, got {type(sampler).__name__}: "
                            "torch's fixes the world when it is made")
        elif shuffle:
            raise ValueError("shuffle=True goes to the DistributedSampler when a sampler is given, as with torch")
        for unsupported in ("batch_sampler", "sampler"):
            if unsupported in kwargs:
                raise ValueError(f"{unsupported}= is nonstop's to set")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.sampler = sampler
        if drop_last:
            sampler.drop_last = True
        self._drop_last_batch = bool(drop_last)  # an evaluation loader drops its partial batch, as torch's
        self._kwargs = kwargs
        self._session: Any = None
        self._yielded: Optional[Tuple[int, Any]] = None  # (step, batch) handed out, not yet completed
        self.indices: List[int] = []  # this rank's samples in the last batch handed out
        self._share_of_batch = (0, 1)
        self.micro_batch = 0  # world-invariant (nonstop.torch.init_process_group): samples per micro-batch
        self.micro: Optional[MicroShare] = None  # world-invariant: this rank's micro-batches of the last batch
        self._uneven_warned: set = set()
        self.on_batch: Any = None  # called as each batch is handed out (nonstop.torch: its first step)
        self._peeked = False  # the last iterator was a peek (before set_epoch): no step to complete
        self._replayed = False  # a step on a batch of the peek was skipped (replayed_peek)
        # The last loop trained no batch: the job had finished its epoch, and this worker (a spare
        # that runs the script from its first line) replayed it. What the script does after an
        # epoch (save a snapshot labelled with its number) it may skip then.
        self.replayed = False
        # Without set_epoch: the loops of this process that trained or ended (each an epoch; a
        # spare's replay of the job's finished epochs counts them too).
        self._loops = 0
        global _made_count
        self._made_at = _made_count
        _made_count += 1
        _made.add(self)

    # ---- registration (nonstop.torch.init_process_group) ----

    def _registered_defaults(self) -> Dict[str, Any]:
        return {_STEPS: 0, _EPOCH: 0, _BATCH: 0, _OFFSET: 0, _GLOBAL: 0, _BASE_WORLD: 0,
                _LR_FROM: 1.0, _LR_TO: 1.0, _LR_CHANGE: 0, _LR_WORLD: 0}

    def _bind(self, session: Any) -> None:
        global _joined
        self._session = _joined = session
        extra = session.extra
        if _STEPS not in extra:
            raise RuntimeError("the loader's position is not registered: pass the loader to "
                               "nonstop.torch.init_process_group(model, optimizer, loader)")
        if extra[_GLOBAL] == 0:  # the job's first generation: every member computes the same
            extra[_GLOBAL] = self.batch_size * session.world_size
            extra[_BASE_WORLD] = extra[_LR_WORLD] = session.world_size
        if extra[_STEPS] != session.resume_step:
            resumed = getattr(session._core, "resumed", None)
            if resumed is not None and resumed["by_name"]:
                raise RuntimeError(f"the checkpoint {resumed['path']} was written by {resumed['writer']}, which keeps "
                                   "no DataLoader position: resume it in a loop that places its data by step "
                                   "(nonstop.data.Sampler, as examples/pytorch/train_llama.py does)")
            raise RuntimeError(f"the loader's registered position is step {extra[_STEPS]}, but the session "
                               f"resumes at step {session.resume_step}: register the loader with the session")

    def _steps_done(self) -> int:
        return self._session.extra[_STEPS]

    @property
    def global_batch(self) -> int:
        """The global batch at the live world."""
        extra = self._session.extra
        return _core.global_batch(self.batch_policy, extra[_GLOBAL], extra[_BASE_WORLD], self._session.world_size)

    def __len__(self) -> int:
        """Global batches (steps) of the epoch: those done and those left at the live world. An
        evaluation loader: this rank's batches of its share (also while a spare's replay yields
        none: a script divides by it)."""
        if self._session is None and _joined is not None:
            return self._evaluation_batches()
        if self._session is None:
            raise RuntimeError("the number of steps per epoch is known once the loader is registered")
        extra = self._session.extra
        return extra[_BATCH] + self.sampler.batches_left(extra[_OFFSET], self.global_batch)

    def lr_factor(self) -> float:
        """The learning-rate multiplier of the step the loader is at (1 with
        the fixed policy); each optimizer update applies it."""
        extra, step = self._session.extra, self._session.extra[_STEPS]
        world = self._session.world_size
        if extra[_LR_WORLD] != world:  # the first update since the world changed: every member alike
            extra[_LR_FROM] = _core.warmed_factor(extra[_LR_FROM], extra[_LR_TO], step, extra[_LR_CHANGE],
                                                  self.lr_warmup_steps)
            extra[_LR_TO] = _core.lr_factor(self.batch_policy, self.lr_scaling, extra[_BASE_WORLD], world)
            extra[_LR_CHANGE], extra[_LR_WORLD] = step, world
        return _core.warmed_factor(extra[_LR_FROM], extra[_LR_TO], step, extra[_LR_CHANGE], self.lr_warmup_steps)

    # ---- iteration ----

    # ---- evaluation: a loader of a process that registered another ----

    @staticmethod
    def _replaying() -> bool:
        """This worker joined a running job and its first step has not begun: it is replaying the
        script's loop from its start (epochs the job finished), where its peers evaluate nothing.
        The same test as its collectives' (nonstop.distributed: answered locally, or refused)."""
        distributed = sys.modules.get(__package__ + ".distributed")
        return bool(distributed is not None and distributed._before_first_step)

    def _evaluation_share(self) -> List[int]:
        """This rank's samples of the epoch, as torch's DistributedSampler deals them, over the
        world live now: every `world`-th of the epoch's order from `rank` on, the order padded
        with its first samples to a multiple of the world (cut to one with the sampler's
        drop_last), so that every rank has as many batches (a collective in each stays matched)."""
        order = self.sampler.order(self.sampler.epoch or 0)
        rank, world = _joined.rank, _joined.world_size
        if self.sampler.drop_last:
            total = len(order) // world * world
        else:
            total = -(-len(order) // world) * world
            while len(order) < total:
                order = order + order[:total - len(order)]
        return order[rank:total:world]

    def _evaluation_batches(self) -> int:
        n = len(self._evaluation_share())
        return n // self.batch_size if self._drop_last_batch else -(-n // self.batch_size)

    def _evaluate(self) -> Iterator[Any]:
        import torch.utils.data

        global _last_handed_by
        if self._replaying():
            return
        share = self._evaluation_share()
        batches = [share[i:i + self.batch_size] for i in range(0, len(share), self.batch_size)]
        if self._drop_last_batch and batches and len(batches[-1]) < self.batch_size:
            batches.pop()  # torch's DataLoader(drop_last=True): each rank's last partial batch
        for batch in torch.utils.data.DataLoader(self.dataset, batch_sampler=batches, **self._kwargs):
            _last_handed_by = self
            yield batch

    def __iter__(self) -> Iterator[Any]:
        global _last_handed_by
        if self._session is None and _joined is not None:
            yield from self._evaluate()
            return
        if self._session is None:
            raise RuntimeError("register the loader first: nonstop.torch.init_process_group(model, optimizer, loader)")
        self._yielded = None  # a batch handed out and never trained on (a peek): it comes again
        self._peeked = False
        self.replayed = True  # until a batch of this loop is trained on (_updated)
        extra = self._session.extra
        epoch = self.sampler.epoch
        implicit = epoch is None  # no set_epoch: each loop that trains (or ends) is the next epoch
        if implicit:
            epoch = self._loops
        finished = epoch < extra[_EPOCH] or (
            epoch == extra[_EPOCH] and self.sampler.batches_left(extra[_OFFSET], self.global_batch) == 0)
        if finished and (implicit or not self.sampler._fresh):
            # A peek (`next(iter(loader))`) before set_epoch of the coming epoch: the batches torch's
            # loader would give, from the start of the epoch last set, with the position untouched.
            # Without set_epoch, a spare's replay of an epoch the job finished too (_peek).
            yield from self._peek(epoch, implicit)
            return
        if epoch < extra[_EPOCH]:
            self.sampler._fresh = False
            self._loops = max(self._loops, epoch + 1)
            return  # an epoch this job finished (a spare replays the loop from its start): no step
        if self.on_batch is not None:
            self.on_batch()  # a joiner's first step begins: the peers' position, before it moves
        if epoch > extra[_EPOCH]:
            extra[_EPOCH], extra[_BATCH], extra[_OFFSET] = epoch, 0, 0
        while self.sampler.batches_left(extra[_OFFSET], self.global_batch) > 0 and extra[_EPOCH] == epoch:
            inner = self._inner(extra[_OFFSET])
            generation = self._session.generation
            for batch in inner:
                self._note(self._my_share())
                if self.on_batch is not None:
                    self.on_batch()
                self._yielded = (extra[_STEPS], batch)
                _last_handed_by = self
                yield batch
                if self._yielded is not None:
                    which = _NOT_THE_REGISTERED if len(_made) > 1 else ""
                    raise RuntimeError("the next batch was asked for before the optimizer's update of the last "
                                       "one: each batch of nonstop.data.DataLoader is one step (accumulate "
                                       f"gradients over micro-batches within a batch, not over batches){which}")
                if self._session.generation != generation:
                    break  # the world changed: the shares are dealt anew from here
        self.sampler._fresh = False  # the epoch's loop ended (an epoch the job finished ends at once)
        self._loops = max(self._loops, epoch + 1)

    def _peek(self, epoch: int, implicit: bool = False) -> Iterator[Any]:
        """The epoch's batches from its start, moving no position. Without set_epoch it may be a
        spare's replay of the loop of an epoch the job finished: nonstop.torch.step skips a step on
        such a batch (replayed_peek) and the loop ends there, counted as that epoch's."""
        self._replayed = False
        for batch in self._inner(0, epoch):
            self._peeked = True
            yield batch
            if self._replayed:
                break
        if implicit:
            self._loops = max(self._loops, epoch + 1)

    def replayed_peek(self) -> bool:
        """A step on a batch of a peek without set_epoch: the loop of an epoch the job finished,
        replayed by a spare. Marks it so that the loop ends; the caller runs no step."""
        if self.sampler.epoch is None and self._peeked and self._yielded is None:
            self._replayed = True
            return True
        return False

    def _updated(self) -> None:
        """The optimizer's update of the batch handed out: its step is done.
        The position moves on before the controller is told."""
        if self._yielded is None:
            if self._peeked:
                raise RuntimeError("optimizer.step() on a batch of an epoch that was not set or is finished: "
                                   "call sampler.set_epoch(epoch) before iterating each epoch (its number says "
                                   "where a spare that replays the loop stands; a peek before it is fine)")
            which = "" if _last_handed_by in (None, self) else _NOT_THE_REGISTERED
            raise RuntimeError("optimizer.step() with no batch of the loader to update on: each batch of "
                               f"nonstop.data.DataLoader is one step, and one update{which}")
        self.sampler._fresh = False
        self.replayed = False
        extra = self._session.extra
        self._loops = max(self._loops, extra[_EPOCH] + 1)  # a loop that trained counts (a peek does not)
        step = self._yielded[0]
        self._yielded = None
        extra[_BATCH] += 1
        extra[_OFFSET] += self._share_of_batch[1]
        extra[_STEPS] = step + 1
        self._session.report_step(step)

    def _outstanding(self) -> Optional[int]:
        """The step of the batch handed out and not yet updated on."""
        return None if self._yielded is None else self._yielded[0]

    def _drop_outstanding(self) -> None:
        self._yielded = None

    def _shares(self, offset: int, epoch: Optional[int] = None) -> Iterator[List[int]]:
        extra = self._session.extra
        epoch = extra[_EPOCH] if epoch is None else epoch
        rank, world, g = self._session.rank, self._session.world_size, self.global_batch
        while self.sampler.batches_left(offset, g) > 0:
            indices, n, _ = self._deal(epoch, offset, rank, world)
            _check_share(indices, n, offset, epoch, rank, world)
            yield indices
            offset += n

    def _inner(self, offset: int, epoch: Optional[int] = None) -> Any:
        import torch.utils.data

        loader = torch.utils.data.DataLoader(self.dataset, batch_sampler=_Shares(self, offset, epoch),
                                             **self._kwargs)
        return iter(loader)

    def _my_share(self) -> Tuple[List[int], int, Optional[MicroShare]]:
        extra = self._session.extra
        return self._deal(extra[_EPOCH], extra[_OFFSET], self._session.rank, self._session.world_size)

    def _deal(self, epoch: int, offset: int, rank: int, world: int) -> Tuple[List[int], int, Optional[MicroShare]]:
        """(rank's indices of the global batch at `offset`, the batch's size,
        its micro-batches when world-invariant). World-invariant, the batch is
        cut into micro-batches of `micro_batch` samples (the last one may be
        shorter) dealt in contiguous blocks whose counts are powers of two
        where the world allows (_core.powers_of_two_split), as even as
        possible otherwise."""
        if not self.micro_batch:
            indices, n = self.sampler.share(epoch, offset, self.global_batch, rank, world)
            return indices, n, None
        whole = self.sampler.batch(epoch, offset, self.global_batch)
        n, s = len(whole), self.micro_batch
        sizes = [min(s, n - b) for b in range(0, n, s)]
        m = len(sizes)
        if m < world:
            raise RuntimeError(f"the global batch at sample {offset} of epoch {epoch} has {m} micro-batches of "
                               f"{s} samples, fewer than the world has ranks ({world}): the world-invariant mode "
                               "gives each rank whole micro-batches; pass a smaller micro_batch to "
                               "nonstop.torch.init_process_group")
        counts = list(_core.powers_of_two_split(m, world))
        why = "" if counts else f"{m} micro-batches cannot be dealt over {world} ranks in powers of two"
        if n % s:
            why = f"the batch's {n} samples are not a whole number of micro-batches of {s}"
        if not counts:
            counts = [(m // world) * (q + 1) + (m % world) * (q + 1) // world
                      - (m // world) * q - (m % world) * q // world for q in range(world)]
        if why and rank == 0 and (n, world) not in self._uneven_warned:
            self._uneven_warned.add((n, world))
            print(f"[nonstop] {why}: this step is within rounding of other worlds', not bitwise "
                  "(docs/python.md, \"World-invariant DDP\")", file=sys.stderr, flush=True)
        first = sum(counts[:rank])
        mine = sizes[first:first + counts[rank]]
        indices = whole[first * s:first * s + sum(mine)]
        return indices, n, MicroShare(m, first, mine, counts)

    def _note(self, share: Tuple[List[int], int, Optional[MicroShare]]) -> None:
        self.indices, n, self.micro = share
        self._share_of_batch = (len(self.indices), n)

    def _share(self) -> float:
        """This rank's share of the step's global batch (the gradient's weight)."""
        mine, whole = self._share_of_batch
        return mine / whole

    def _redeal(self, resumed: int, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """After a recovery: the step's batch as dealt over the new world, put
        in place of the arguments that were the old one (or its elements)."""
        extra = self._session.extra
        if self._yielded is None or resumed != self._yielded[0] or extra[_STEPS] != resumed:
            raise RuntimeError(f"the recovery resumes at step {resumed}, but this loader is at step "
                               f"{extra[_STEPS]}: run the decorated step on the batch the loader yielded")
        old = self._yielded[1]
        share = self._my_share()
        _check_share(share[0], share[1], extra[_OFFSET], extra[_EPOCH], self._session.rank, self._session.world_size)
        if share[0] == self.indices and share[1] == self._share_of_batch[1]:
            self.micro = share[2]  # the same samples; the other ranks' counts may differ
            return args, kwargs  # the same share: the step runs again on the same batch
        self._note(share)
        indices = share[0]
        collate = self._kwargs.get("collate_fn")
        if collate is None:
            from torch.utils.data import default_collate  # type: ignore[attr-defined]

            collate = default_collate
        new = collate([self.dataset[i] for i in indices])
        self._yielded = (resumed, new)

        def parts(batch: Any) -> List[Any]:
            if isinstance(batch, (tuple, list)):
                return list(batch)
            if isinstance(batch, Mapping):
                return list(batch.values())
            return [batch]

        swapped = 0

        def swap(a: Any) -> Any:
            nonlocal swapped
            if a is old:
                swapped += 1
                return new
            for o, n in zip(parts(old), parts(new)):
                if a is o:
                    swapped += 1
                    return n
            return a

        args, kwargs = tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}
        if swapped == 0:
            raise RuntimeError("the world changed, so the step's batch is dealt anew, but none of the decorated "
                               "step's arguments is the batch the loader yielded or one of its elements: pass "
                               "them to it as yielded (transform them inside the step)")
        return args, kwargs


def _check_share(indices: List[int], n: int, offset: int, epoch: int, rank: int, world: int) -> None:
    if not indices:
        raise RuntimeError(f"the global batch at sample {offset} of epoch {epoch} has {n} samples, fewer than the "
                           f"world has ranks ({world}): rank {rank} has none; use a larger batch_size")


class MicroShare(NamedTuple):
    """A rank's part of a world-invariant step: micro-batches `first`,
    `first` + 1, ... of the step's `micro_batches`, of `sizes` samples."""

    micro_batches: int
    first: int
    sizes: List[int]
    counts: List[int]  # every rank's number of micro-batches


class _Shares:
    """The batch sampler of the torch DataLoader that loads the shares (it
    may run ahead of the batch handed out: workers prefetch)."""

    def __init__(self, owner: DataLoader, offset: int, epoch: Optional[int]) -> None:
        self._owner = owner
        self._offset = offset
        self._epoch = epoch  # None: the registered epoch

    def __iter__(self) -> Iterator[List[int]]:
        return self._owner._shares(self._offset, self._epoch)

    def __len__(self) -> int:
        return self._owner.sampler.batches_left(self._offset, self._owner.global_batch)
