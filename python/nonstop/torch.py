"""nonstop.torch: data parallelism for a PyTorch module, as torch DDP does it.

:class:`DataParallel` sums the gradients of every worker while backward still
runs: the gradients live in one flat buffer cut into buckets, in the reverse
order of the parameters (the last layers' gradients are ready first), and a
bucket is handed to the session's communication thread as soon as every
gradient in it is accumulated. The end of backward waits for the last bucket.

Gradients are summed, not averaged: scale the loss by 1 / (the global batch),
as the examples do. That is what keeps the update exact when the world grows
or shrinks and the global batch stays fixed.

Salvage (``salvage=True``; off by default): each bucket is copied before the
ring sums it in place, so a worker whose backward had completed when a member
failed still holds its own sum of the step. Its reducing call then recovers in
place and, when its share of the step is unchanged (a spare took the lost
rank: the same step, rank and world), reduces that sum again with the new
generation instead of raising Aborted. Only for a step whose first collective
is this backward's buckets: the worker resumes there while the others run the
step from its top (docs/python.md "Salvage").

Planned steps (``micro_batches=M``): ``plan(step)`` says which of the step's M
micro-batches this rank computes, ``backward(loss)`` runs each one's backward
(the last one reduces the buckets while it runs, unless the step has loans), and ``reduce()`` ends the
step. With salvage, the sum is kept after each micro-batch, so a step cut short
keeps what every survivor had completed, and its retry computes only the rest,
the lost rank's block lent out over every member as the C++ trainer does
(docs/python.md "Planned steps").
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from . import Aborted, Session, _core, _device
from ._grads import _trainable, adopt_grad, flat_views, grad_buffer, point_grads, raise_if_aborted

__all__ = ["DataParallel", "InvariantDataParallel"]


def _after_accumulation(p: torch.nn.Parameter, fn: Any) -> Any:
    """Calls fn() once each backward has accumulated p's gradient into .grad;
    returns what must be kept alive for the hook to stay."""
    if hasattr(p, "register_post_accumulate_grad_hook"):  # torch >= 2.1
        return p.register_post_accumulate_grad_hook(lambda _p: fn())
    # Older torch: a hook on the parameter's gradient accumulator, which runs
    # after the gradient was added to .grad (torch DDP's way).
    accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
    accumulator.register_hook(lambda *_: fn())
    return accumulator  # kept alive, or its hook goes with it


class _Held:
    """The sum of a planned step's completed micro-batches, in this rank's
    order (salvage): what it offers when the step is retried."""

    def __init__(self, like: torch.Tensor) -> None:
        self.step = -1  # none
        self.micro_batches: List[int] = []
        self.sum = torch.empty_like(like)
        self.loss = torch.zeros(1, dtype=torch.float32, device=like.device)
        self.spare: Optional[torch.Tensor] = None  # the buffer swap_in gave back

    def begin(self, step: int) -> None:
        self.step = step
        self.micro_batches = []
        self.loss = torch.zeros(1, dtype=torch.float32, device=self.sum.device)

    def keep(self, grads: torch.Tensor, mb: int, loss: torch.Tensor) -> None:
        with torch.no_grad():
            self.sum.copy_(grads)
        self.micro_batches.append(mb)
        self.loss = loss.clone()

    def swap_in(self, staged: torch.Tensor, mb: int, loss: torch.Tensor) -> None:
        # The staged copy of every bucket is the sum with `mb`: kept without another copy.
        self.spare, self.sum = self.sum, staged
        self.micro_batches.append(mb)
        self.loss = loss.clone()


class _PlannedStep:
    """One planned step of DataParallel: this rank's share and how far it got."""

    def __init__(self, step: int, generation: int, share: Dict[str, Any], device: torch.device) -> None:
        self.step = step
        self.generation = generation
        self.compute: List[int] = list(share["compute"])
        self.todo: List[int] = self.compute + list(share["borrowed"])  # borrowed: computed alone, for their owners
        self.loans: List[Tuple[int, int, int]] = [tuple(loan) for loan in share["loans"]]
        # With loans the sum is complete only once they are added: the buckets start after them.
        self.overlap = not self.loans
        self.next = 0  # index in todo of the next backward
        self.sync = False  # the backward running now starts the buckets
        self.value = torch.zeros(1, dtype=torch.float32, device=device)  # the loss of the backward running
        self.local_loss = torch.zeros(1, dtype=torch.float32, device=device)
        self.restore: Optional[torch.Tensor] = None  # the kept sum the first backward starts from
        self.begun = False
        self.own: Optional[torch.Tensor] = None  # this rank's sum while it computes borrowed micro-batches
        self.for_owner: Dict[int, torch.Tensor] = {}  # borrowed micro-batch -> its gradient and loss
        self.reduced = False
        self.done = False


class DataParallel(torch.nn.Module):
    """Wraps `module` (already registered with `session`). Call it like the
    module; after ``loss.backward()`` every parameter's ``.grad`` holds the sum
    over all workers, or :class:`nonstop.Aborted` was raised and the step is
    lost (``session.recover()``).

    With ``micro_batches=M`` each step is planned instead (salvage of whole
    micro-batches, docs/python.md "Planned steps")::

        for mb in ddp.plan(step):        # this rank's micro-batches, in order
            ddp.backward(loss_of(mb))     # a sum / the global batch's size
        local = ddp.reduce()              # .grad: the sum over every worker
        optimizer.step()
    """

    def __init__(self, module: torch.nn.Module, session: Session, bucket_cap_mb: float = 4.0,
                 salvage: bool = False, micro_batches: Optional[int] = None, lend: bool = True) -> None:
        super().__init__()
        if not isinstance(session, Session):
            raise TypeError(f"session must be a nonstop.Session, got {type(session).__name__}")
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        core = session._joined()
        self.module = module
        self._session = session
        params = _trainable(module)
        # Reverse order: backward produces the last layers' gradients first.
        self._params = list(reversed(params))
        self._grads = grad_buffer(self._params)
        self._views: List[torch.Tensor] = []
        self._bucket_of: List[int] = []
        self._buckets: List[torch.Tensor] = []
        cap = max(1, int(bucket_cap_mb * (1 << 20) / 4))
        offset = 0
        bucket_begin = 0
        for p in self._params:
            n = p.numel()
            if offset > bucket_begin and offset + n - bucket_begin > cap:
                self._buckets.append(self._grads[bucket_begin:offset])
                bucket_begin = offset
            self._views.append(self._grads[offset:offset + n].view_as(p))
            self._bucket_of.append(len(self._buckets))
            offset += n
        self._buckets.append(self._grads[bucket_begin:offset])
        # Salvage: every bucket's local sum, copied as it is handed to the ring (one model-sized buffer).
        self._kept = torch.empty_like(self._grads) if salvage else None
        # Planned steps: the plan (nonstop/ring.h), and the sum of the micro-batches completed.
        self._ring = None if micro_batches is None else _core.RingStep(core, int(micro_batches), bool(salvage),
                                                                          bool(lend))
        self._micro_batches = 0 if micro_batches is None else int(micro_batches)
        self._held = _Held(self._grads) if self._ring is not None and salvage else None
        self._step: Optional[_PlannedStep] = None
        self._size = [0] * len(self._buckets)
        for b in self._bucket_of:
            self._size[b] += 1
        with torch.no_grad():
            for p, view in zip(self._params, self._views):
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
        self._sync = True
        self._sync_at_forward = True
        self._in_backward = False
        self._pending: List[int] = []
        self._ready: List[bool] = []
        self._next_bucket = 0
        self._backward_generation = 0
        self._hooks = []
        for i, p in enumerate(self._params):
            self._hooks.append(self._hook(i, p))
        # A fault elsewhere stops this worker's step at the next layer, forward
        # or backward, instead of at the end of the step: the recovery waits
        # for every survivor to stop, so this is most of its time.
        for m in module.modules():
            self._hooks.append(m.register_forward_pre_hook(self._stop_if_aborted))

    def _stop_if_aborted(self, *_: Any) -> None:
        raise_if_aborted(self._session)

    def _hook(self, i: int, p: torch.nn.Parameter) -> Any:
        return _after_accumulation(p, lambda: self._on_grad_ready(i))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # A member failed: the step in flight is lost, so do not compute the
        # rest of it (the recovery waits for every survivor to stop).
        if self._in_backward and (self._session._core.aborted() or
                                  self._session.generation != self._backward_generation):
            # A backward stopped by the abort: its generation is over, and with
            # it the buckets it started (recover() waited for them).
            self._in_backward = False
        self._stop_if_aborted()
        self._session.begin_training()  # a joiner: from the peers' state, not its setup's
        if self._in_backward:
            # The last backward never reached its end (an exception inside it,
            # caught): some of its buckets were started, the others never will
            # be, so this worker's next reductions would pair with its peers'
            # other buckets. It cannot continue: the controller replaces it.
            message = ("a backward pass was interrupted after it had started gradient buckets; this worker's "
                       "reductions no longer line up with its peers', so it leaves the job")
            self._session._core.report_failure(message, self._session._step_in_flight, 1)
            raise RuntimeError(message)
        self._sync_at_forward = self._sync
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside only accumulate gradients
        (earlier micro-batches of a step), as with torch DDP; wrapping the
        backward alone works too. The next backward outside reduces them."""
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zeros the gradient buffer (the gradients stay views into it)."""
        self._grads.zero_()
        point_grads(self._params, self._views)

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def _adopt_grad(self, i: int) -> None:
        adopt_grad(self._params[i], self._views[i])

    def _adopt_grads(self) -> None:
        for i in range(len(self._params)):
            self._adopt_grad(i)

    def reduce_without_backward(self) -> None:
        """For a rank that has no micro-batch in a step (more ranks than
        micro-batches): adds its zero gradient to every bucket's sum, so that
        its reductions line up with its peers'. Raises Aborted like backward."""
        if self._ring is not None:
            raise RuntimeError("reduce_without_backward() is for unplanned steps: with micro_batches=M, an empty "
                               "plan() is followed by reduce(), which does this")
        self.zero_grad()
        self._stop_if_aborted()
        self._session._maybe_inject()
        self._in_backward = True
        self._backward_generation = self._session.generation
        self._all_ready()
        self._end_of_backward()

    def _all_ready(self) -> None:
        # As a backward that reached every parameter: every bucket may start, in bucket order.
        self._pending = [0] * len(self._buckets)
        self._ready = [True] * len(self._params)
        self._next_bucket = 0

    def _on_grad_ready(self, i: int) -> None:
        self._stop_if_aborted()
        self._adopt_grad(i)
        if not (self._step.sync if self._step is not None else self._sync and self._sync_at_forward):
            return
        if not self._in_backward:
            self._session._maybe_inject()  # nonstop run --inject exception:...: before anything is started
            self._in_backward = True
            self._backward_generation = self._session.generation
            self._pending = list(self._size)
            self._ready = [False] * len(self._params)
            self._next_bucket = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if self._ready[i]:
            return
        self._ready[i] = True
        self._pending[self._bucket_of[i]] -= 1
        self._start_ready_buckets()

    def _start_ready_buckets(self) -> None:
        # Strictly in bucket order: every rank starts the same buckets in the same order.
        stage = self._kept is not None and (self._step is None or self._step.sync)
        while self._next_bucket < len(self._buckets) and self._pending[self._next_bucket] == 0:
            bucket = self._buckets[self._next_bucket]
            if stage:  # this rank's sum, before the ring sums it in place
                begin = bucket.storage_offset()
                self._kept[begin:begin + bucket.numel()].copy_(bucket)
            self._session._start_allreduce(bucket)
            self._next_bucket += 1

    def _end_of_backward(self) -> None:
        self._in_backward = False
        # Parameters this backward did not reach (unused in forward) contribute zeros.
        for i in range(len(self._params)):
            if not self._ready[i]:
                self._adopt_grad(i)
                self._ready[i] = True
                self._pending[self._bucket_of[i]] -= 1
        self._start_ready_buckets()
        if self._step is not None:  # a planned step's last micro-batch
            if self._held is not None and self._held.step == self._step.step and self._step.sync:
                # its sum, as every bucket was copied before the ring took it
                step = self._step  # (its next is still this micro-batch's: backward() counts it after)
                self._held.swap_in(self._kept, step.todo[step.next], step.local_loss + step.value)
                self._kept = self._held.spare  # the next staging buffer
            self._session._wait_all()  # Aborted: the step is lost, the sum kept for the retry's plan
            self._step.reduced = True
            return
        try:
            self._session._wait_all()
        except Aborted:
            if not self._salvage():
                raise  # the step is lost: recover() (done already if salvage tried) and compute it again

    # ---- planned steps (micro_batches=M) ----

    def plan(self, step: int) -> List[int]:
        """This rank's micro-batches of `step` (indices in [0, micro_batches)),
        in the order to compute them: one ``backward(loss)`` each, then
        ``reduce()``. On the first step of a generation the members first say
        which micro-batches of the step they hold a sum of. Raises Aborted."""
        if self._ring is None:
            raise RuntimeError("plan() is for planned steps: DataParallel(..., micro_batches=M)")
        session = self._session
        last = self._step
        if last is not None and not last.done and last.generation == session.generation and not session.aborted:
            raise RuntimeError(f"plan({step}) before reduce() ended step {last.step}: call reduce() after the "
                               f"backward of every micro-batch plan() returned")
        self._stop_if_aborted()
        step = int(step)
        held = self._held
        held_step, held_mbs = (held.step, held.micro_batches) if held is not None and held.step >= 0 else (-1, [])
        share = self._ring.plan(step, held_step, held_mbs)
        planned = _PlannedStep(step, session.generation, share, self._grads.device)
        if share["kept"]:
            if held is None or held.step != step or sorted(held.micro_batches) != list(share["kept"]):
                raise RuntimeError(f"step {step}: the plan keeps micro-batches {share['kept']} this rank does not "
                                   f"hold a sum of")
            planned.restore = held.sum  # into the buffer at the first backward (a zero_grad() before it is harmless)
            planned.local_loss = held.loss.clone()
        elif held is not None:
            held.begin(step)
        self._step = planned
        if self._ring.kept_micro_batches and session.rank == 0:
            print(f"[nonstop] step {step}: kept the sums of {self._ring.kept_micro_batches} of "
                  f"{self._micro_batches} micro-batches from the step in flight ({self._ring.kept_by} "
                  f"member(s)); the rest computed by {self._ring.computing} member(s), {len(planned.loans)} of "
                  f"them lent by the owner of their block", file=sys.stderr, flush=True)
        return list(planned.todo)

    def backward(self, loss: torch.Tensor) -> None:
        """The backward of the next micro-batch plan() returned; `loss` its
        (scalar) loss. The last one this rank computes sums the buckets over
        every worker while it runs (in a step with loans, reduce() does).
        Raises Aborted."""
        planned = self._current("backward()")
        if planned.next >= len(planned.todo):
            raise RuntimeError(f"backward() after all {len(planned.todo)} micro-batches plan() returned for step "
                               f"{planned.step}: call reduce()")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("backward(loss) takes the micro-batch's loss, a tensor of one element")
        mb = planned.todo[planned.next]
        self._begin_sum()
        planned.value = loss.detach().reshape(1).to(torch.float32)
        if planned.next < len(planned.compute):
            planned.sync = planned.overlap and planned.next + 1 == len(planned.compute)
            try:
                loss.backward()
            finally:
                planned.sync = False
            planned.local_loss += planned.value
            if not planned.overlap or planned.next + 1 < len(planned.compute):
                self._keep(mb)
        else:
            self._backward_alone(loss, mb)
        planned.next += 1

    def _current(self, call: str) -> _PlannedStep:
        # The plan, if it is still this generation's: a recovery since voids it.
        planned = self._step
        if planned is None or planned.done:
            raise RuntimeError(f"{call} needs a plan: call plan(step) first")
        self._stop_if_aborted()
        if planned.generation != self._session.generation:
            raise RuntimeError(f"step {planned.step} was planned in generation {planned.generation}, and a recovery "
                               f"since made generation {self._session.generation}: call plan({planned.step}) again")
        return planned

    def _begin_sum(self) -> None:
        # This rank's sum starts at zero, or at the sum it kept; every gradient a view of it again.
        planned = self._step
        if planned.begun:
            return
        with torch.no_grad():
            if planned.restore is not None:
                self._grads.copy_(planned.restore)  # the next backward adds into it as it would have
            else:
                self._grads.zero_()
        point_grads(self._params, self._views)
        planned.begun = True

    def _backward_alone(self, loss: torch.Tensor, mb: int) -> None:
        # A borrowed micro-batch: computed as its owner would, on the same parameters, but from -0
        # gradients (-0 + g is g for every g), and sent to the owner in reduce().
        planned = self._step
        with torch.no_grad():
            if planned.own is None:
                planned.own = self._grads.clone()
            self._grads.fill_(-0.0)
        point_grads(self._params, self._views)
        loss.backward()
        self._adopt_grads()
        planned.for_owner[mb] = torch.cat([self._grads, planned.value])
        if planned.next + 1 == len(planned.todo):
            with torch.no_grad():
                self._grads.copy_(planned.own)
            planned.own = None

    def _keep(self, mb: int) -> None:
        # The sum of the micro-batches completed so far, for a retry of the step (salvage).
        if self._held is not None and self._held.step == self._step.step:
            self._adopt_grads()
            self._held.keep(self._grads, mb, self._step.local_loss)

    def reduce(self) -> torch.Tensor:
        """Ends a planned step: every parameter's ``.grad`` holds the sum over
        all workers. Returns this rank's loss (the sum of its micro-batches'
        losses, the kept and lent ones included), for the log. Raises Aborted
        (the sum of the micro-batches completed is kept for the retry)."""
        planned = self._current("reduce()")
        if planned.next != len(planned.todo):
            raise RuntimeError(f"reduce() after {planned.next} of the {len(planned.todo)} micro-batches plan() "
                               f"returned for step {planned.step}: run backward(loss) for each first")
        if not planned.reduced:
            self._begin_sum()
            self._session._maybe_inject()
            self._add_loans()
            self._reduce_whole()
        planned.done = True
        # The kept sum stays until another step is planned: a fault in a collective after this one
        # (the loss's) retries the step with every block kept.
        return planned.local_loss.clone()

    def _add_loans(self) -> None:
        # Every loan in micro-batch order: each owner adds its lent micro-batches in its block's order.
        planned = self._step
        rank = self._session.rank
        n = self._grads.numel()
        for mb, owner, borrower in planned.loans:
            piece = (planned.for_owner.pop(mb) if borrower == rank else
                     torch.empty(n + 1, dtype=torch.float32, device=self._grads.device))
            _device.on_host(piece, "loan", lambda host: self._session._core.broadcast(host.data_ptr(),
                                                                                       host.numel() * 4, borrower))
            if owner == rank:
                with torch.no_grad():
                    self._grads.add_(piece[:n])  # as the owner's backward would have accumulated it
                planned.local_loss += piece[n:]
                self._keep(mb)

    def _reduce_whole(self) -> None:
        # Every bucket started in order, as after a backward: the same pieces of the ring, the same bits.
        self._adopt_grads()
        self._all_ready()
        self._start_ready_buckets()
        self._session._wait_all()
        self._step.reduced = True

    def _salvage(self) -> bool:
        # Every bucket of this rank's sum was copied before the ring took it.
        if self._kept is None:
            return False
        session = self._session
        share = (session._step_in_flight, session.rank, session.world_size)
        while True:
            resumed = session._recover_in_place()
            if resumed is None:
                return False
            if (resumed, session.rank, session.world_size) != share:
                session._hold_recovery(resumed)  # the script's recover() returns it
                return False  # another share of the step (or another step): computed again
            self._grads.copy_(self._kept)
            print(f"[nonstop] step {resumed}: rank {session.rank} kept its gradient sum of the step in flight "
                  f"and reduces it again in generation {session.generation}", file=sys.stderr, flush=True)
            for bucket in self._buckets:  # in order, as every member starts them
                session._start_allreduce(bucket)
            try:
                session._wait_all()
                return True
            except Aborted:
                continue  # another fault: the kept sum is still this rank's


class InvariantDataParallel(torch.nn.Module):
    """World-invariant data parallelism (docs/python.md "World-invariant
    steps", docs/determinism.md): the gradient of a step is the sum of its
    `micro_batches` micro-batch gradients along one fixed binary tree, whoever
    computed which, so it has the same bits at every world size, through
    faults, shrinks and grows. A step cut short by a fault keeps the sums its
    members had folded: its retry computes only what no member holds, dealt
    over every member (the spare included).

    One step::

        for mb in ddp.plan(step):        # this rank's micro-batches, in order
            loss = loss_of(ddp(inputs(mb)), targets(mb))  # a sum / the global batch's size
            loss.backward()               # folds micro-batch mb's gradient
        ddp.reduce()                      # .grad: the tree's sum, on every rank
        optimizer.step()

    Needs the same intra-op thread count on every worker
    (``torch.set_num_threads``): a micro-batch's gradient must have the same
    bits wherever it is computed."""

    def __init__(self, module: torch.nn.Module, session: Session, micro_batches: int, salvage: bool = True) -> None:
        super().__init__()
        if not isinstance(session, Session):
            raise TypeError(f"session must be a nonstop.Session, got {type(session).__name__}")
        core = session._joined()
        self.module = module
        self._session = session
        self._params = _trainable(module)
        self._grads = grad_buffer(self._params)
        self._views = flat_views(self._grads, self._params)
        self._micro_batches = int(micro_batches)
        self._tree = _core.TreeStep(core, self._micro_batches, self._grads.numel(), bool(salvage))
        self._planned: List[int] = []
        self._queued = False
        self._cut = False
        self._hooks = [_after_accumulation(p, self._on_grad_ready) for p in self._params]
        for m in module.modules():
            self._hooks.append(m.register_forward_pre_hook(self._stop_if_aborted))
        self.zero_grad()

    def _stop_if_aborted(self, *_: Any) -> None:
        raise_if_aborted(self._session)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zeros the gradient buffer (the gradients stay views into it)."""
        self._grads.zero_()
        point_grads(self._params, self._views)

    def plan(self, step: int) -> List[int]:
        """This rank's micro-batches of `step` (indices in [0, micro_batches)),
        in the order to compute them, one forward and backward each. On the
        first step of a generation the members first say which sums of the
        step they still hold. Raises Aborted."""
        self.zero_grad()
        self._queued = False
        self._cut = False
        self._stop_if_aborted()
        self._planned = list(self._tree.plan(int(step)))
        if self._tree.kept_micro_batches and self._session.rank == 0:
            print(f"[nonstop] step {step}: kept the sums of {self._tree.kept_micro_batches} of "
                  f"{self._micro_batches} micro-batches from the step in flight ({self._tree.kept_by} member(s)); "
                  f"the rest dealt over {self._session.world_size} member(s)", file=sys.stderr, flush=True)
        return list(self._planned)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._stop_if_aborted()
        self._session.begin_training()  # a joiner: from the peers' state, not its setup's
        return self.module(*args, **kwargs)

    def _on_grad_ready(self) -> None:
        if self._session._core.aborted():
            self._cut = True  # this backward is cut short: its gradient is never folded
            self._stop_if_aborted()
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        # Runs only after a backward that completed (autograd runs no final callback after an
        # error), so the gradient is whole even if the abort came since: folded, it is kept.
        self._queued = False
        if self._cut:
            return
        if not self._planned:
            raise RuntimeError("a backward that plan() did not plan: run exactly one per micro-batch it returned")
        for p, view in zip(self._params, self._views):
            adopt_grad(p, view)
        mb = self._planned.pop(0)
        _device.on_host(self._grads, "tree.add", lambda host: self._tree.add(mb, host.data_ptr()), write_back=False)
        self._grads.zero_()

    def reduce(self) -> None:
        """Sums the step's micro-batch gradients over every member along the
        tree: then every parameter's ``.grad`` has the same bits on every
        rank, at any world size. Raises Aborted (the folded sums are kept for
        the step's retry)."""
        self._stop_if_aborted()  # a micro-batch cut short was not folded: Aborted, not a count error
        _device.on_host(self._grads, "tree.reduce", lambda host: self._tree.reduce(host.data_ptr()))


# torch.distributed over nonstop (python/nonstop/distributed.py): the default
# process group, stock DDP over it, and the step that recovers.
from .sharded import ShardedDataParallel, ShardedOptimizer  # noqa: E402

__all__ += ["ShardedDataParallel", "ShardedOptimizer"]

from .distributed import (  # noqa: E402  (after DataParallel, which it does not need)
    DistributedDataParallel,
    destroy_process_group,
    init_process_group,
    step,
    store,
)

__all__ += ["DistributedDataParallel", "destroy_process_group", "init_process_group", "step", "store"]
