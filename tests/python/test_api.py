"""The Python API's checks and errors, without a job: wrong tensors and misuse
raise TypeError/ValueError/RuntimeError with a message that says what to do,
and nothing crashes the interpreter."""

import fcntl
import os
import subprocess
import sys
import types

import pytest
import torch

import nonstop
import nonstop.data
import nonstop.torch


@pytest.fixture
def env(monkeypatch):
    # A job's variables, pointing at a port nothing listens on: register()
    # fails only when it tries to join, after every check of its arguments.
    monkeypatch.setenv("NONSTOP_CONTROLLER", "127.0.0.1:1")
    monkeypatch.setenv("NONSTOP_JOB_TOKEN", "t")
    monkeypatch.setenv("NONSTOP_WORKER_ID", "0")
    monkeypatch.setenv("NONSTOP_CONNECT_TIMEOUT_MS", "200")


def test_join_outside_a_job_says_to_use_nonstop_run(monkeypatch):
    for v in ("NONSTOP_CONTROLLER", "NONSTOP_JOB_TOKEN", "NONSTOP_WORKER_ID"):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(RuntimeError, match="nonstop run"):
        nonstop.join()


def test_the_job_token_leaves_the_environment_of_the_script_and_its_children():
    # What a launcher passes (docs/security.md): a sealed memfd named by NONSTOP_JOB_TOKEN_FD.
    fd = os.memfd_create("nonstop-job-token", os.MFD_ALLOW_SEALING)
    os.write(fd, b"s3cret-token")
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
    script = ("import os, subprocess\n"
              "names = lambda: sorted(k for k in os.environ if k.startswith('NONSTOP_JOB_TOKEN'))\n"
              "print(names())\n"
              "import nonstop\n"
              "print(names())\n"
              "subprocess.run(['sh', '-c', 'env | grep -c s3cret-token; ls -l /proc/$$/fd/ | grep -c nonstop-job-token'],"
              " close_fds=False)\n")
    env = dict(os.environ, NONSTOP_JOB_TOKEN_FD=str(fd), NONSTOP_JOB_TOKEN="by-hand")
    out = subprocess.run([sys.executable, "-c", script], env=env, pass_fds=(fd,), capture_output=True, text=True,
                         timeout=60)
    os.close(fd)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "['NONSTOP_JOB_TOKEN', 'NONSTOP_JOB_TOKEN_FD']\n[]\n0\n0\n", out.stdout + out.stderr


def test_rank_before_register_says_to_register_first(env):
    session = nonstop.join()
    with pytest.raises(RuntimeError, match="register"):
        session.rank


def test_wrong_parameters_are_refused_before_joining(env):
    session = nonstop.join()
    model = torch.nn.Linear(4, 4).double()
    with pytest.raises(TypeError, match="float32"):
        session.register(model)
    meta = torch.nn.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match="meta.*CPU"):
        session.register(meta)



def test_tensors_on_two_devices_are_refused_naming_both():
    with pytest.raises(ValueError, match="cpu, meta.*one device"):
        nonstop._one_device([torch.zeros(1), torch.zeros(1, device="meta")], "the model's parameters")


def test_a_staged_tensor_is_copied_down_and_the_result_back_up(monkeypatch):
    # nonstop/_device.py, the path of a GPU tensor, here forced for a CPU one.
    from nonstop import _device

    t = torch.arange(4, dtype=torch.float32)
    monkeypatch.setattr(_device, "twins", {})
    assert _device.Twin(t, "test").host is t and _device.twins == {}, "a CPU tensor is used in place"
    monkeypatch.setattr(_device, "_stage_cpu_tensors", True)
    twin = _device.Twin(t, "test")
    assert _device.twins == {"test": 1}
    assert twin.host is not t and twin.host.data_ptr() != t.data_ptr() and torch.equal(twin.host, t)
    twin.host.add_(10)
    assert t.tolist() == [0, 1, 2, 3], "the collective works on the twin"
    twin.up()
    assert t.tolist() == [10, 11, 12, 13]
    assert _device.on_host(t, "test", lambda host: host.mul_(2).sum().item()) == 92 and t.tolist() == [20, 22, 24, 26]
    _device.on_host(t, "test", lambda host: host.zero_(), write_back=False)
    assert t.tolist() == [20, 22, 24, 26], "no write-back: the tensor keeps its values"

    calls, failures = [], []
    twin = _device.Twin(t, "test")
    twin.host.fill_(1)
    _device.completion(twin, lambda ok, message: calls.append((ok, message, t.tolist())), failures.append)(True, "")
    assert calls == [(True, "", [1, 1, 1, 1])] and not failures, "copied back before the bucket's future completes"
    broken = _device.Twin(t, "test")
    broken.host = torch.zeros(3)  # a copy back that cannot succeed is told, naming why; the bucket still completes
    _device.completion(broken, lambda ok, message: calls.append((ok, message)), failures.append)(True, "")
    assert calls[-1] == (True, "") and len(failures) == 1, failures
    assert "copying a reduced gradient bucket back to cpu failed" in failures[0]
    twin.host.fill_(5)
    _device.completion(twin, lambda ok, message: calls.append((ok, message)), failures.append)(False, "aborted")
    assert calls[-1] == (False, "aborted") and t.tolist() == [1, 1, 1, 1], "a failed sum is not copied back"


def test_a_region_on_a_gpu_that_is_not_there_is_refused_naming_it():
    # The native half registers a cuda:N region through CUDA; without such a device (or without
    # CUDA in this build) it says which device it could not use.
    if nonstop._core.cuda_devices() > 0:
        pytest.skip("this machine has a CUDA device: a CPU address passed as cuda:0 memory proves nothing")
    t = torch.zeros(4)
    with pytest.raises((RuntimeError, ValueError), match="cuda:0"):
        nonstop._core.Session.join([("params", t.data_ptr(), 16, "F32", [4], 0)])


def test_a_gpu_the_program_computes_on_that_is_not_there_is_refused_naming_it():
    # A sharded model's GPU holds no registered state (its registered parameters are a host copy),
    # yet the join health-checks it: a worker, a spare above all, whose GPU cannot be used does not
    # join. Without such a device (or CUDA in this build) the native half names the device.
    if nonstop._core.cuda_devices() > 0:
        pytest.skip("this machine has a CUDA device: it would pass the check")
    with pytest.raises((RuntimeError, ValueError), match="cuda:0"):
        nonstop._core.Session.join([], cuda_devices=[0])


def test_the_join_is_told_the_gpu_a_sharded_model_computes_on(fake_join, monkeypatch):
    # A sharded model on a GPU registers a host copy of its parameters, so the join is told the GPU
    # to health-check it (SessionOptions::checked_devices). No GPU here: a CPU model's join is told
    # none, and the device of the model's buffer is then faked to see which one is named.
    told = []

    def join(regions, **kwargs):
        told.append(kwargs.get("cuda_devices"))
        return FakeCore(regions)

    monkeypatch.setattr(FakeCore, "join", staticmethod(join))
    model = torch.nn.Linear(4, 4)
    session = nonstop.join().register(model, nonstop.torch.ShardedOptimizer(model, torch.optim.AdamW, 1))
    assert told == [[]]
    session._device_flat = types.SimpleNamespace(device=torch.device("cuda", 1))
    assert session._unregistered_cuda_devices() == [1]


def test_an_optimizer_of_another_model_is_refused(env):
    session = nonstop.join()
    model, other = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="not the model's"):
        session.register(model, torch.optim.AdamW(other.parameters()))


def test_an_optimizer_with_unknown_initial_state_is_refused(env):
    session = nonstop.join()
    model = torch.nn.Linear(4, 4)
    # Rprop's step sizes start at the learning rate, not at zero.
    with pytest.raises(ValueError, match="Rprop.*after one optimizer step"):
        session.register(model, torch.optim.Rprop(model.parameters()))


def test_a_tensor_registered_twice_is_refused(env):
    session = nonstop.join()
    t = torch.zeros(8)
    with pytest.raises(ValueError, match="registered once"):
        session.register(tensors={"a": t, "b": t[2:6]})


def test_extra_keeps_ints_and_floats_only(env):
    session = nonstop.join()
    with pytest.raises(TypeError, match="ints and floats"):
        session.register(extra={"name": "x"})


def test_extra_values_keep_their_type_and_keys():
    extra = nonstop.Extra({"steps": 3, "lr": 0.5})
    extra["steps"] += 1
    extra["lr"] = 2
    assert extra["steps"] == 4 and isinstance(extra["steps"], int)
    assert extra["lr"] == 2.0 and isinstance(extra["lr"], float)
    with pytest.raises(TypeError, match="registered as an int"):
        extra["steps"] = 1.5
    with pytest.raises(KeyError, match="was not registered"):
        extra["other"]


def test_an_unreachable_controller_is_an_error_not_a_hang(env):
    session = nonstop.join()
    with pytest.raises(ConnectionError, match="127.0.0.1:1"):
        session.register(torch.nn.Linear(2, 2))


class FakeCore:
    """Stands in for the native session so that register() runs to the end without a job."""

    resume_step = 0
    rank = 0
    world_size = 1
    generation = 1
    is_aborted = False
    resumed = None  # no checkpoint loaded

    def __init__(self, regions):
        self.regions = regions
        self.reports = []

    @staticmethod
    def join(regions, state_step=-1, resume_from="", shard_group=0, checkpoint=(), required=(), optional=(),
             on_loaded=None, cuda_devices=(), defer_state=False):
        return FakeCore(regions)

    def report_step(self, *args):
        self.reports.append(args)

    def begin_training(self):
        pass  # a worker of the job's first generation: nothing held

    # What DataParallel calls: a world of one, where a sum is the value itself.
    started = None
    failures = None

    abort_after_starts = None  # a peer fails once this many buckets were started

    def start_allreduce(self, tensor, address, count):
        self.started = (self.started or []) + [(address, count)]
        if self.abort_after_starts is not None and len(self.started) >= self.abort_after_starts:
            self.is_aborted = True

    def wait_all(self):
        pass

    def aborted(self):
        return self.is_aborted

    def injected_exception_at(self, step):
        return False

    def report_failure(self, message, step, code):
        self.failures = (self.failures or []) + [message]

    def broadcast(self, address, nbytes, root):
        pass  # a world of one: the root's bytes are everyone's

    def last_change(self):
        return {"generation": self.generation, "old_world": 1, "new_world": 1, "old_rank": 0, "new_rank": 0,
                "resume_step": 0, "reason": "start"}


class FakeRing:
    """nonstop/ring.h's plan in a world of one: the shares a test sets (`share`), and what each
    plan() was offered (`offers`)."""

    share = {}
    offers = []
    kept_micro_batches = 0
    kept_by = 0
    computing = 1

    def __init__(self, core, micro_batches, salvage, lend):
        FakeRing.offers = []

    def plan(self, step, held_step, held):
        FakeRing.offers.append((step, held_step, list(held)))
        return {k: list(v) for k, v in FakeRing.share.items()}


def make_ddp(bucket_cap_mb=0.0005, **kwargs):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1))
    session = nonstop.join().register(model)
    return session, model, nonstop.torch.DataParallel(model, session, bucket_cap_mb=bucket_cap_mb, **kwargs)


@pytest.fixture
def fake_join(env, monkeypatch):
    monkeypatch.setattr(nonstop._core, "Session", FakeCore)


def test_a_failed_join_leaves_nothing_half_registered(env):
    session = nonstop.join()
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ConnectionError):
        session.register(model, torch.optim.AdamW(model.parameters()))
    assert session._params is None and not session._reserved
    with pytest.raises(ConnectionError):  # the same again: no "registered already"
        session.register(model, torch.optim.AdamW(model.parameters()))


def test_registration_keeps_parameters_and_makes_them_views_of_one_buffer(fake_join):
    session = nonstop.join()
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    session.register(model, optimizer, extra={"n": 1})
    names = [r[0] for r in session._core.regions]
    assert names == ["params", "optimizer", "extra.int"], names
    flat = session._params
    assert flat.numel() == sum(p.numel() for p in model.parameters())
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b), "registration (and the state it creates) leaves the parameters as they were"
        assert flat.data_ptr() <= p.data_ptr() < flat.data_ptr() + flat.numel() * 4
    # AdamW's lazily created state exists now, zeroed, and lives in the registered optimizer buffer.
    _, address, nbytes, _, _, device = session._core.regions[1]
    assert device == -1, "host memory"
    for p in model.parameters():
        state = optimizer.state[p]
        assert set(state) >= {"exp_avg", "exp_avg_sq", "step"}
        assert all(float(v.abs().sum()) == 0 for v in state.values())
        assert all(address <= v.data_ptr() < address + nbytes for v in state.values())


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1),
    lambda ps: torch.optim.Adam(ps, lr=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
], ids=["AdamW", "Adam", "SGD-momentum"])
def test_registered_training_takes_the_same_steps_as_plain_pytorch(fake_join, make):
    torch.manual_seed(0)
    a, b = torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)
    b.load_state_dict(a.state_dict())
    oa, ob = make(a.parameters()), make(b.parameters())
    nonstop.join().register(b, ob)  # b's parameters and state now live in flat buffers
    x = torch.randn(4, 6)
    for _ in range(3):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_a_parameter_replaced_after_register_is_caught_at_the_next_report(fake_join):
    session = nonstop.join()
    model = torch.nn.Linear(4, 4)
    session.register(model, torch.optim.AdamW(model.parameters()))
    session.report_step(0, 1.0)
    model.weight.data = torch.zeros(4, 4)  # training would go on in memory no recovery restores
    with pytest.raises(RuntimeError, match="parameter 0 no longer lives in the memory registered"):
        session.report_step(1, 1.0)
    assert len(session._core.reports) == 1, "the step is not reported as held"


def test_an_optimizer_with_state_for_some_parameters_only_is_refused(fake_join):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model[0].weight.grad = torch.ones(2, 2)
    optimizer.step()  # state for model[0].weight only
    with pytest.raises(ValueError, match="some of the optimizer's parameters have state"):
        nonstop.join().register(model, optimizer)


def test_a_subclass_of_a_known_optimizer_is_not_assumed_to_start_at_zero(env):
    class MyAdam(torch.optim.Adam):
        pass

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="MyAdam"):
        nonstop.join().register(model, MyAdam(model.parameters()))


def test_the_sampler_is_deterministic_and_deals_every_micro_batch_once():
    s = nonstop.data.Sampler(num_samples=100, global_batch=12, micro_batch=2, seed=3)
    assert s.micro_batches_per_step == 6
    dealt = [mb for r in range(4) for mb in s.micro_batches(r, 4)]
    assert dealt == list(range(6))
    again = nonstop.data.Sampler(num_samples=100, global_batch=12, micro_batch=2, seed=3)
    assert [s.samples(5, i) for i in range(6)] == [again.samples(5, i) for i in range(6)]
    with pytest.raises(ValueError, match="rank 4 of world size 4"):
        s.micro_batches(4, 4)
    with pytest.raises(ValueError, match="micro-batch 6"):
        s.samples(0, 6)
    with pytest.raises(ValueError):
        nonstop.data.Sampler(num_samples=100, global_batch=12, micro_batch=5)


def test_a_dataset_that_does_not_exist_is_named(tmp_path):
    with pytest.raises(Exception, match="nowhere"):
        nonstop.data.Dataset(str(tmp_path / "nowhere"), 16)


def test_data_is_read_as_tokens(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("hello nonstop " * 200)
    assert nonstop.data.prepare([str(text)], str(tmp_path / "shards"))
    assert not nonstop.data.prepare([str(text)], str(tmp_path / "shards")), "prepared once"
    ds = nonstop.data.Dataset(str(tmp_path / "shards"), 8)
    batch = ds.batch([0, 1])
    assert batch.shape == (2, 9) and batch.dtype == torch.int64
    assert bytes(batch[0].tolist()) == b"hello non"
    with pytest.raises(IndexError, match="past the dataset"):
        ds.batch([ds.num_samples])


def bucket_order(session, ddp):
    """Indices of the started buckets, from their addresses."""
    begins = [b.data_ptr() for b in ddp._buckets]
    return [begins.index(address) for address, _ in (session._core.started or [])]


def test_buckets_start_once_each_in_bucket_order_and_the_gradients_are_plain_pytorchs(fake_join):
    session, model, ddp = make_ddp()
    assert ddp.num_buckets >= 3
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 1))
    reference.load_state_dict(model.state_dict())
    x = torch.randn(5, 8)
    for _ in range(2):
        ddp.zero_grad()
        ddp(x).sum().backward()
    assert bucket_order(session, ddp) == list(range(ddp.num_buckets)) * 2
    reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_no_sync_around_the_forward_or_the_backward_reduces_nothing(fake_join):
    session, model, ddp = make_ddp()
    x = torch.randn(3, 8)
    with ddp.no_sync():
        out = ddp(x)
    out.sum().backward()
    out = ddp(x)
    with ddp.no_sync():
        out.sum().backward()
    assert bucket_order(session, ddp) == []
    ddp(x).sum().backward()  # the third micro-batch reduces all three
    assert bucket_order(session, ddp) == list(range(ddp.num_buckets))


def test_gradients_survive_zero_grad_set_to_none_and_unused_parameters(fake_join):
    session, model, ddp = make_ddp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 8)
    ddp(x).sum().backward()
    optimizer.zero_grad(set_to_none=True)
    # Only the first layer takes part: the others' gradients are zero, and every bucket is still reduced.
    model[0](x).sum().backward()
    for p, view in zip(ddp._params, ddp._views):
        assert p.grad is not None and p.grad.data_ptr() == view.data_ptr(), "every gradient is a view again"
    assert float(model[4].weight.grad.abs().sum()) == 0
    assert float(model[0].weight.grad.abs().sum()) > 0


def make_planned(monkeypatch, share, salvage=True):
    monkeypatch.setattr(nonstop._core, "RingStep", FakeRing)
    FakeRing.share = dict(share)
    return make_ddp(salvage=salvage, micro_batches=4)


def plain_sums(model, xs):
    """The gradients and loss of micro-batches xs summed as plain PyTorch accumulates them."""
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 1))
    reference.load_state_dict(model.state_dict())
    total = torch.zeros(1)
    for x in xs:
        loss = reference(x).pow(2).sum() / 7
        loss.backward()
        total += loss.detach()
    return [p.grad for p in reference.parameters()], total


def test_a_planned_step_has_plain_pytorchs_bits_with_its_tail_lent_and_added_back(fake_join, monkeypatch):
    # A world of one lending to itself: micro-batches 2 and 3 are computed alone, from -0
    # gradients, and added to the sum of 0 and 1 in order, as accumulating them would have.
    session, model, ddp = make_planned(monkeypatch, {"kept": [], "compute": [0, 1], "lent": [2, 3],
                                                     "borrowed": [2, 3], "loans": [(2, 0, 0), (3, 0, 0)]})
    torch.manual_seed(3)
    xs = [torch.randn(3, 8) for _ in range(4)]
    assert ddp.plan(5) == [0, 1, 2, 3]
    for mb in (0, 1, 2, 3):
        ddp.backward(ddp(xs[mb]).pow(2).sum() / 7)
    assert bucket_order(session, ddp) == [], "with loans, the buckets start once they are added"
    local = ddp.reduce()
    assert bucket_order(session, ddp) == list(range(ddp.num_buckets))
    grads, total = plain_sums(model, xs)
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g), "bitwise the accumulated gradient"
    assert torch.equal(local, total), "the loss, lent micro-batches' included"


def test_a_planned_step_cut_short_offers_what_it_completed_and_its_retry_keeps_it(fake_join, monkeypatch):
    session, model, ddp = make_planned(monkeypatch, {"kept": [], "compute": [0, 1, 2, 3], "lent": [],
                                                     "borrowed": [], "loans": []})
    torch.manual_seed(4)
    xs = [torch.randn(3, 8) for _ in range(4)]
    ddp.plan(9)
    for mb in (0, 1):
        ddp.backward(ddp(xs[mb]).pow(2).sum() / 7)
    assert bucket_order(session, ddp) == [], "only the last micro-batch's backward reduces"
    out = ddp(xs[2])
    session._core.is_aborted = True  # a peer failed in the third micro-batch's backward
    with pytest.raises(nonstop.Aborted):
        ddp.backward(out.pow(2).sum() / 7)
    session._core.is_aborted = False
    session._core.generation = 2
    FakeRing.share = {"kept": [0, 1], "compute": [2, 3], "lent": [], "borrowed": [], "loans": []}
    assert ddp.plan(9) == [2, 3]
    assert FakeRing.offers[-1] == (9, 9, [0, 1]), "it offered the two micro-batches it completed, not the third"
    for mb in (2, 3):
        ddp.backward(ddp(xs[mb]).pow(2).sum() / 7)
    assert bucket_order(session, ddp) == list(range(ddp.num_buckets)), "the last backward reduced"
    local = ddp.reduce()
    grads, total = plain_sums(model, xs)
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g), "the kept sum continued: bitwise the fault-free gradient"
    assert torch.equal(local, total)
    FakeRing.share["kept"] = [0, 1]
    with pytest.raises(RuntimeError, match="does not hold a sum of"):
        ddp.plan(10)  # a plan that keeps what this rank holds of another step is refused
    # A fault after reduce() (in the loss's allreduce, say): the retry offers the whole block and
    # computes nothing; reduce() reduces the kept sum.
    session._core.generation = 3
    FakeRing.share = {"kept": [0, 1, 2, 3], "compute": [], "lent": [], "borrowed": [], "loans": []}
    assert ddp.plan(9) == []
    assert FakeRing.offers[-1] == (9, 9, [0, 1, 2, 3])
    ddp.zero_grad()  # the buffer no longer holds the sum: reduce() must put the kept one back
    assert torch.equal(ddp.reduce(), total)
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)


def test_a_fault_inside_the_last_backward_keeps_the_micro_batches_before_it(fake_join, monkeypatch):
    # The last micro-batch's buckets are copied as the ring takes them, into a buffer that takes
    # turns with the kept sum: a step whose last backward stops after its first bucket must keep
    # the sum before it, whole, even after an earlier step's turn.
    every = {"kept": [], "compute": [0, 1, 2, 3], "lent": [], "borrowed": [], "loans": []}
    session, model, ddp = make_planned(monkeypatch, every)
    torch.manual_seed(5)
    first = [torch.randn(3, 8) for _ in range(4)]
    xs = [torch.randn(3, 8) for _ in range(4)]
    ddp.plan(1)
    for x in first:
        ddp.backward(ddp(x).pow(2).sum() / 7)
    ddp.reduce()
    ddp.plan(2)
    for mb in (0, 1, 2):
        ddp.backward(ddp(xs[mb]).pow(2).sum() / 7)
    session._core.started = None
    session._core.abort_after_starts = 1  # the fault comes as the first bucket of the last backward goes
    with pytest.raises(nonstop.Aborted):
        ddp.backward(ddp(xs[3]).pow(2).sum() / 7)
    assert bucket_order(session, ddp) == [0], "stopped after one bucket"
    session._core.abort_after_starts = None
    session._core.is_aborted = False
    session._core.generation = 2
    FakeRing.share = {"kept": [0, 1, 2], "compute": [3], "lent": [], "borrowed": [], "loans": []}
    assert ddp.plan(2) == [3]
    assert FakeRing.offers[-1] == (2, 2, [0, 1, 2])
    ddp.zero_grad()  # between plan() and the first backward: the kept sum is still where it starts
    ddp.backward(ddp(xs[3]).pow(2).sum() / 7)
    local = ddp.reduce()
    grads, total = plain_sums(model, xs)
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g), "the kept sum of three micro-batches, whole"
    assert torch.equal(local, total)


def test_a_planned_step_says_what_is_out_of_order(fake_join, monkeypatch):
    session, model, ddp = make_planned(monkeypatch, {"kept": [], "compute": [0, 1], "lent": [], "borrowed": [],
                                                     "loans": []})
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="call plan"):
        ddp.backward(ddp(x).sum())
    ddp.plan(1)
    with pytest.raises(ValueError, match="one element"):
        ddp.backward(ddp(x))
    ddp.backward(ddp(x).sum())
    with pytest.raises(RuntimeError, match="after 1 of the 2 micro-batches"):
        ddp.reduce()
    with pytest.raises(RuntimeError, match="before reduce"):
        ddp.plan(2)
    ddp.backward(ddp(x).sum())
    with pytest.raises(RuntimeError, match="after all 2 micro-batches"):
        ddp.backward(ddp(x).sum())
    ddp.reduce()
    ddp.plan(3)
    session._core.generation = 2  # a recovery since: the plan is void
    with pytest.raises(RuntimeError, match="call plan\\(3\\) again"):
        ddp.backward(ddp(x).sum())
    with pytest.raises(RuntimeError, match="call plan\\(3\\) again"):
        ddp.reduce()
    _, _, unplanned = make_ddp()
    with pytest.raises(RuntimeError, match="micro_batches=M"):
        unplanned.plan(0)


def test_a_rank_without_micro_batches_still_takes_part_in_every_bucket(fake_join):
    session, model, ddp = make_ddp()
    ddp.reduce_without_backward()
    assert bucket_order(session, ddp) == list(range(ddp.num_buckets))
    assert all(float(p.grad.abs().sum()) == 0 for p in model.parameters())


def test_a_backward_interrupted_after_buckets_started_ends_this_worker(fake_join):
    session, model, ddp = make_ddp()
    x = torch.randn(3, 8, requires_grad=True)
    h = model[0](x)
    h.register_hook(lambda g: (_ for _ in ()).throw(MemoryError("out of memory, say")))
    out = model[4](model[3](model[2](model[1](h))))
    ddp._sync_at_forward = True
    with pytest.raises(MemoryError):
        out.sum().backward()  # the later layers' buckets were started, the first layer's never will be
    assert bucket_order(session, ddp), "some buckets had started"
    with pytest.raises(RuntimeError, match="no longer line up"):
        ddp(x)
    assert session._core.failures, "the controller is told, so that it replaces this worker"


def test_an_abort_stops_the_step_at_the_next_layer_and_the_next_generation_starts_clean(fake_join):
    session, model, ddp = make_ddp()
    x = torch.randn(3, 8)
    out = ddp(x)
    session._core.is_aborted = True  # a peer failed while this worker computes
    with pytest.raises(nonstop.Aborted):
        out.sum().backward()  # stopped at the first gradient, not at the end of the step
    with pytest.raises(nonstop.Aborted):
        model(x)  # any layer of a forward stops too
    # recover(): a new generation; the buckets of the stopped backward are void.
    session._core.is_aborted = False
    session._core.generation = 2
    session._core.started = None
    ddp.zero_grad()
    ddp(x).sum().backward()
    assert bucket_order(session, ddp) == list(range(ddp.num_buckets))


def test_a_recovery_made_inside_a_reduction_is_returned_once_and_only_while_current(fake_join):
    # DataParallel's salvage recovers in place, then (its share changed) raises Aborted: the
    # script's recover() returns that recovery instead of recovering twice, once; a recovery
    # another generation or abort overtook is not returned: recover() takes part in the new one.
    session, _, _ = make_ddp()
    core = session._core
    calls = []
    core.recover = lambda: calls.append(core.generation) or 40 + core.generation
    core.last_change = lambda: {"generation": core.generation, "old_world": 1, "new_world": 1, "old_rank": 0,
                                "new_rank": 0, "resume_step": 0, "reason": "recovery"}
    session._hold_recovery(7)
    assert session.recover() == 7 and calls == []
    assert session.recover() == 41 and calls == [1], "held once"
    session._hold_recovery(7)
    core.generation = 2
    assert session.recover() == 42 and calls == [1, 2], "another generation since: recovered again"
    session._hold_recovery(9)
    core.is_aborted = True
    assert session.recover() == 42 and calls == [1, 2, 2], "aborted since: recovered again"
    core.is_aborted = False
    session._held_recovery = (None, nonstop.Released("released inside the reduction"))
    with pytest.raises(nonstop.Released):
        session.recover()


def test_torchs_init_process_group_arguments_join_first_or_are_refused_naming_why():
    import nonstop.torch

    # torch's arguments alone join first (outside `nonstop run` there is no job to join)
    for call in (lambda: nonstop.torch.init_process_group(backend="gloo"),
                 lambda: nonstop.torch.init_process_group("gloo", timeout=None)):
        with pytest.raises(RuntimeError, match=r"not set: start this script under `nonstop run`"):
            call()
    with pytest.raises(TypeError, match=r"unexpected arguments \['bakend'\]"):
        nonstop.torch.init_process_group(bakend="gloo")
    with pytest.raises(TypeError, match=r"takes torch's arguments alone"):
        nonstop.torch.init_process_group(backend="gloo", world_invariant=True)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"takes no torch arguments \(backend=\)"):
        nonstop.torch.init_process_group(model, backend="gloo")
