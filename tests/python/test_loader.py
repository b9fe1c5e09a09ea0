"""nonstop.data.DataLoader and nonstop.torch.step without a job: a session
stand-in holds the registered position, so each rule of the loader (a step
per update, a peek not counted (before set_epoch too), each loop an epoch without set_epoch, shares dealt anew when the
world changes) and of the step decorator (run again on the re-dealt batch, or
not at all when the step was already updated on) is checked directly."""

import pytest
import torch

import nonstop
import nonstop.distributed as nd
from nonstop.data import DataLoader, DistributedSampler


class Items(torch.utils.data.Dataset):
    def __len__(self):
        return 50

    def __getitem__(self, i):
        return torch.tensor(i), torch.full((2,), float(i))


class FakeSession:
    """What the loader and the decorator use of a nonstop.Session."""

    def __init__(self, loader, world=4, rank=0):
        self.extra = nonstop.Extra(loader._registered_defaults())
        self.world_size, self.rank, self.generation, self.resume_step = world, rank, 1, 0
        self.reported = []
        self.recoveries = []
        self._core = object()
        self.aborted = False

    def report_step(self, step):
        self.reported.append(step)

    def recover(self):
        self.aborted = False
        return self.recoveries.pop(0)


def bound(world=4, rank=0, batch_size=2, shuffle=True):
    loader = DataLoader(Items(), batch_size=batch_size, sampler=DistributedSampler(Items(), shuffle=shuffle))
    session = FakeSession(loader, world, rank)
    loader._bind(session)
    return loader, session


def test_each_update_completes_one_step_and_every_sample_of_the_epoch_is_dealt_once():
    seen = []
    for rank in range(4):
        loader, session = bound(rank=rank)
        loader.sampler.set_epoch(0)
        for ids, _ in loader:
            seen += ids.tolist()
            loader._updated()
        assert session.reported == list(range(len(loader))) == list(range(6)), "50 // 8: the last batch takes 10"
    assert sorted(seen) == list(range(50))


def test_a_peeked_batch_is_not_counted_and_comes_again():
    loader, session = bound()
    loader.sampler.set_epoch(0)
    peek = next(iter(loader))[0].tolist()
    first = next(iter(loader))[0].tolist()
    assert peek == first and session.reported == []


def test_the_next_batch_before_the_update_raises_and_an_update_without_a_batch_too():
    loader, _ = bound()
    loader.sampler.set_epoch(0)
    it = iter(loader)
    next(it)
    with pytest.raises(RuntimeError, match="before the optimizer's update"):
        next(it)
    fresh, _ = bound()
    with pytest.raises(RuntimeError, match="no batch of the loader"):
        fresh._updated()


def test_a_peek_before_set_epoch_gives_the_epochs_first_batch_and_moves_nothing():
    # PyTorch's DDP tutorial peeks at a batch (`len(next(iter(loader))[0])`) at the top of each
    # epoch, before it calls set_epoch: the batch torch would give, the position untouched.
    loader, session = bound()
    peek = next(iter(loader))[0].tolist()  # never set: epoch 0's order, as torch's sampler
    loader.sampler.set_epoch(0)
    first = next(iter(loader))[0].tolist()
    assert peek == first and session.reported == []
    for _ in loader:
        loader._updated()
    assert session.reported == list(range(6))
    again = next(iter(loader))[0].tolist()  # epoch 0 done, epoch 1 not set yet
    assert again == first and session.reported == list(range(6)), "a peek completes no step"
    loader.sampler.set_epoch(1)
    for _ in loader:
        loader._updated()
    assert session.reported == list(range(12)), "epoch 1 whole after the peek"


def test_a_spare_replaying_the_tutorials_loop_peeks_skips_the_finished_epochs_and_resumes():
    # The job is at step 8 (epoch 1, its third global batch); a spare runs the loop from epoch 0.
    loader, session = bound()
    session.extra["nonstop.data.epoch"], session.extra["nonstop.data.batch"] = 1, 2
    session.extra["nonstop.data.offset"], session.extra["nonstop.data.steps"] = 16, 8
    got = []
    for epoch in range(3):
        assert len(next(iter(loader))[0]) == 2, f"the peek of epoch {epoch}"
        loader.sampler.set_epoch(epoch)
        for ids, _ in loader:
            got.append(ids.tolist())
            loader._updated()
    assert session.reported == list(range(8, 8 + 4 + 6)), "epoch 1 from its third batch, then epoch 2"
    assert len(got) == 10


def test_a_joiner_at_an_epochs_end_restores_the_peers_position_before_the_loop_moves_it():
    # A spare copied the position at the end of epoch 0; its first step begins (on_batch:
    # nonstop.torch writes the copied state back) before the loop moves to epoch 1.
    loader, session = bound()
    extra = session.extra
    extra["nonstop.data.batch"], extra["nonstop.data.offset"], extra["nonstop.data.steps"] = 6, 50, 6
    copied = dict(extra.as_dict())
    restores = []

    def begin_training():
        if not restores:
            for key, value in copied.items():
                extra[key] = value
        restores.append(True)

    loader.on_batch = begin_training
    loader.sampler.set_epoch(1)
    for _ in loader:
        loader._updated()
    assert session.reported == list(range(6, 12)), "epoch 1 whole, from step 6"
    assert extra["nonstop.data.epoch"] == 1


def test_without_set_epoch_each_loop_is_an_epoch_in_epoch_0s_order():
    # torch's sampler without set_epoch: epoch 0's order every epoch. A peek is no loop; a spare
    # replaying the loop skips the epochs the job finished by counting its loops.
    loader, session = bound(world=1)
    peeked = next(iter(loader))[0].tolist()
    loops = []
    for _ in range(2):
        ids = []
        for batch, _ in loader:
            ids += batch.tolist()
            loader._updated()
        loops.append(ids)
    assert loops[0] == loops[1] and sorted(loops[0]) == list(range(50)), loops
    assert loops[0] != list(range(50)), "shuffled"
    assert peeked == loops[0][:2], "the peek gave the first batch and moved nothing"
    assert session.reported == list(range(50)), "25 steps of 2 samples a loop"
    spare, spare_session = bound(world=1)
    # the position copied from the peers: epoch 1, 3 batches in
    for key, value in session.extra.as_dict().items():
        spare_session.extra[key] = value
    spare_session.extra["nonstop.data.epoch"], spare_session.extra["nonstop.data.offset"] = 1, 6
    replayed = [spare.replayed_peek() for _ in spare]  # what nonstop.torch.step asks before a step
    assert replayed == [True], "its first loop replays epoch 0, which the job finished: one batch, no step"
    rest = []
    for b, _ in spare:
        assert not spare.replayed_peek()
        rest.append(b.tolist())
        spare._updated()
    assert sum(rest, []) == loops[1][6:], "its second loop goes on from the copied position"


def test_a_finished_epoch_yields_nothing_and_set_epoch_takes_ints():
    loader, session = bound()
    loader.sampler.set_epoch(1)
    for _ in loader:
        loader._updated()
    assert not loader.replayed, "that loop trained"
    loader.sampler.set_epoch(0)
    began = []
    loader.on_batch = lambda: began.append(True)
    assert list(loader) == [], "epoch 0 is behind the registered epoch 1 (a spare replaying the loop)"
    assert not began, "no step begins in a finished epoch: a spare's collectives stay local there"
    assert loader.replayed, "what the script does after that epoch (a snapshot save) it may skip"
    with pytest.raises(TypeError):
        loader.sampler.set_epoch(1.5)


def test_a_world_change_deals_the_rest_of_the_epoch_anew():
    loader, session = bound(shuffle=False)
    loader.sampler.set_epoch(0)
    got = []
    for ids, _ in loader:
        got.append(ids.tolist())
        loader._updated()
        if len(got) == 2:
            session.world_size, session.generation = 2, 2  # a shrink between steps
    assert got[:2] == [[0, 1], [8, 9]], "global batches of 8, rank 0's quarter"
    assert got[2:] == [[16, 17, 18, 19], [24, 25, 26, 27], [32, 33, 34, 35], [40, 41, 42, 43, 44]], \
        "the last global batch takes the 2 samples left over: 10, dealt 5/5"
    assert loader._share() == 1 / 2


def step_with(loader, session, monkeypatch):
    monkeypatch.setattr(nd, "_session", session)
    monkeypatch.setattr(nd, "_loader", loader)
    monkeypatch.setattr(nd, "_model", None)
    calls = []

    @nd.step
    def train(ids, x):
        calls.append(ids.tolist())
        if len(calls) == 1:
            session.aborted = True
            session.world_size, session.generation = 2, 2
            raise nonstop.Aborted("a member failed")
        loader._updated()
        return "done"

    return train, calls


def test_the_step_runs_again_on_its_batch_dealt_over_the_new_world(monkeypatch):
    loader, session = bound(shuffle=False)
    train, calls = step_with(loader, session, monkeypatch)
    session.recoveries = [0]
    loader.sampler.set_epoch(0)
    ids, x = next(iter(loader))
    assert train(ids, x) == "done"
    assert calls == [[0, 1], [0, 1, 2, 3]], "rank 0 of 2 takes half of the 8"
    assert session.reported == [0]


def test_a_step_whose_state_was_copied_from_peers_that_completed_it_is_not_run_again(monkeypatch):
    loader, session = bound(shuffle=False)
    train, calls = step_with(loader, session, monkeypatch)
    session.recoveries = [1]  # resumes one step later: this member was behind
    loader.sampler.set_epoch(0)
    ids, x = next(iter(loader))
    assert train(ids, x) is None
    assert calls == [[0, 1]] and loader._outstanding() is None


def test_a_step_whose_arguments_are_not_the_batch_cannot_be_dealt_anew(monkeypatch):
    loader, session = bound(shuffle=False)
    train, _ = step_with(loader, session, monkeypatch)
    session.recoveries = [0]
    loader.sampler.set_epoch(0)
    ids, x = next(iter(loader))
    with pytest.raises(RuntimeError, match="none of the decorated step's arguments"):
        train(ids.clone(), x.clone())


def test_scale_with_world_follows_the_world_and_warms_the_learning_rate_up():
    made = []
    for rank in range(4):
        loader = DataLoader(Items(), batch_size=2, sampler=DistributedSampler(Items(), shuffle=False),
                            batch_policy="scale-with-world", lr_scaling="linear", lr_warmup_steps=2)
        session = FakeSession(loader, 4, rank)
        loader._bind(session)
        loader.sampler.set_epoch(0)
        made.append((loader, session, iter(loader)))
    seen, factors = [], []
    for step in range(20):
        if step == 2:  # ranks 2 and 3 leave between steps: the world is 2
            made = made[:2]
            for _, session, _ in made:
                session.world_size, session.generation = 2, 2
        try:
            batches = [next(it) for _, _, it in made]
        except StopIteration:
            break
        for (loader, _, _), (ids, _) in zip(made, batches):
            seen += ids.tolist()
        factors.append(made[0][0].lr_factor())
        for loader, _, _ in made:
            loader._updated()
    assert sorted(seen) == list(range(50)), "every sample once across the change"
    assert factors[:4] == [1.0, 1.0, 0.75, 0.5], "linear: 4 -> 2 ranks halves it, warmed over 2 steps"
    assert made[0][1].reported[:3] == [0, 1, 2]
    assert made[0][0].global_batch == 4


def test_an_unknown_batch_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="scale-with-world"):
        DataLoader(Items(), batch_size=2, batch_policy="grow")
    with pytest.raises(ValueError, match="sqrt"):
        DataLoader(Items(), batch_size=2, lr_scaling="cubic")


def test_world_invariant_dealing_gives_each_rank_a_power_of_two_of_whole_micro_batches(capsys):
    # 50 samples, batch_size 2 at world 4: global batches of 8, micro-batches of 2 (4 a batch).
    for world, counts in [(4, [1, 1, 1, 1]), (3, [2, 1, 1]), (2, [2, 2]), (1, [4])]:
        seen = []
        for rank in range(world):
            loader, session = bound(shuffle=False)
            loader.micro_batch = 2
            session.world_size, session.rank = world, rank
            loader.sampler.set_epoch(0)
            for batch, (ids, _) in enumerate(loader):
                micro = loader.micro
                if batch == 0:
                    assert (micro.micro_batches, micro.counts) == (4, counts), f"world {world}"
                    assert micro.first == sum(counts[:rank]) and micro.sizes == [2] * counts[rank]
                    assert ids.tolist() == list(range(2 * micro.first, 2 * (micro.first + counts[rank])))
                seen += ids.tolist()
                loader._updated()
        assert sorted(seen) == list(range(50)), f"world {world}: every sample once"
    # World 1's last batch, 5 micro-batches (4 + 1), cannot be one power of two: rank 0 says so.
    assert "5 micro-batches cannot be dealt over 1 ranks in powers of two" in capsys.readouterr().err
    # The last batch takes the 2 left over: 10 samples, 5 micro-batches; 5 = 4 + 1 over 2 ranks.
    loader, session = bound(shuffle=False)
    loader.micro_batch = 2
    session.world_size = 2
    assert loader._deal(0, 40, 0, 2)[2].counts == [4, 1]
    assert loader._deal(0, 40, 0, 4)[2].counts == [2, 1, 1, 1]
    assert capsys.readouterr().err == ""


def test_world_invariant_dealing_says_when_a_step_cannot_be_bitwise_and_refuses_ranks_without_a_micro_batch(capsys):
    loader, session = bound(shuffle=False)  # global batches of 8
    loader.micro_batch = 3  # 8 = 3 + 3 + 2: the short one makes no world's step bitwise
    assert loader._deal(0, 0, 0, 2)[2].sizes == [3, 3]
    assert "the batch's 8 samples are not a whole number of micro-batches of 3" in capsys.readouterr().err
    loader.micro_batch = 4  # 2 micro-batches: a world of 3 would leave a rank with none
    with pytest.raises(RuntimeError, match="2 micro-batches of 4 samples, fewer than the world has ranks \\(3\\).*"
                                           "smaller micro_batch"):
        loader._deal(0, 0, 0, 3)
    assert capsys.readouterr().err == ""


def test_the_world_invariant_variable_is_a_flag_and_anything_else_is_refused(monkeypatch):
    for value, want in [("", False), ("0", False), ("off", False), ("1", True), ("yes", True), ("TRUE", True)]:
        monkeypatch.setenv("NONSTOP_WORLD_INVARIANT", value)
        assert nd._env_flag("NONSTOP_WORLD_INVARIANT") is want, value
    monkeypatch.setenv("NONSTOP_WORLD_INVARIANT", "2")
    with pytest.raises(ValueError, match="NONSTOP_WORLD_INVARIANT='2': use 1 or 0"):
        nd._env_flag("NONSTOP_WORLD_INVARIANT")


def test_an_evaluation_loader_deals_its_set_over_the_live_world_as_torchs_sampler(monkeypatch):
    # Every loader but the registered one evaluates: the epoch's order padded to a multiple of the
    # world, every world-th sample from the rank on (torch's DistributedSampler), no position.
    _, session = bound(world=4, rank=1)
    monkeypatch.setattr(nd, "_before_first_step", False)
    ev = DataLoader(Items(), batch_size=2, sampler=DistributedSampler(Items(), shuffle=False))
    assert [i for ids, _ in ev for i in ids.tolist()] == list(range(1, 50, 4)) and len(ev) == 7
    dropped = DataLoader(Items(), batch_size=2, shuffle=False, drop_last=True)
    assert [i for ids, _ in dropped for i in ids.tolist()] == list(range(1, 48, 4)) and len(dropped) == 6
    session.world_size, session.rank = 3, 2  # the live world, read as each loop starts
    assert [i for ids, _ in ev for i in ids.tolist()] == list(range(2, 50, 3)) + [0] and len(ev) == 9
    # A spare replaying the loop before its first step: nothing (its peers evaluate nothing then),
    # while len() stays its batches.
    monkeypatch.setattr(nd, "_before_first_step", True)
    assert list(ev) == [] and len(ev) == 9
