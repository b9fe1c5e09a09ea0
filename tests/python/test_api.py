"""The Python API's checks and errors, without a job: wrong tensors and misuse
raise TypeError/ValueError/RuntimeError with a message that says what to do,
and nothing crashes the interpreter."""

import os

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


def test_registration_keeps_parameters_and_makes_them_views_of_one_buffer(env):
    session = nonstop.join()
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    with pytest.raises(ConnectionError):
        session.register(model, optimizer)  # joins nothing, but the state is laid out first
    flat = session._params
    assert flat.numel() == sum(p.numel() for p in model.parameters())
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b), "registration (and the state it creates) leaves the parameters as they were"
        assert p.data_ptr() >= flat.data_ptr() and p.data_ptr() < flat.data_ptr() + flat.numel() * 4
    # AdamW's lazily created state exists now, zeroed: the first real step is the same as without nonstop.
    for p in model.parameters():
        state = optimizer.state[p]
        assert set(state) >= {"exp_avg", "exp_avg_sq", "step"}
        assert all(float(v.abs().sum()) == 0 for v in state.values())


def test_the_optimizer_state_made_up_front_gives_the_same_first_steps():
    torch.manual_seed(0)
    a = torch.nn.Linear(6, 3)
    b = torch.nn.Linear(6, 3)
    b.load_state_dict(a.state_dict())
    oa = torch.optim.AdamW(a.parameters(), lr=0.1, weight_decay=0.1)
    ob = torch.optim.AdamW(b.parameters(), lr=0.1, weight_decay=0.1)
    nonstop._materialize_state(ob, list(b.parameters()))
    x = torch.randn(4, 6)
    for _ in range(3):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


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
