"""PyTorch from Python under `nonstop run`: each fault kind ends bitwise equal
to the fault-free run (parameters, AdamW's state and the Python counter), a
spare copies the state of the rank it takes, healthy processes are never
restarted, and the world shrinks and grows live."""

import re

import pytest

from conftest import finish_job, plan_worlds, run_job, shrink_then_grow, staged_env, staged_twins, start_job

STEPS = ["--steps", "30"]
NPROC = ["--nproc", "3"]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clean")
    job = run_job(tmp, "clean", NPROC + ["--spares", "0", "--inject", "none"], STEPS)
    assert job.code == 0, job.output
    finals = job.finals()
    assert len(finals) == 3, job.output
    assert len({f["state"] for f in finals}) == 1, "every rank ends on the same state\n" + job.output
    return job


def test_the_fault_free_run_is_reproducible_and_learns(clean, tmp_path):
    again = run_job(tmp_path, "again", NPROC + ["--spares", "0", "--inject", "none"], STEPS)
    assert again.code == 0, again.output
    assert again.finals()[0]["state"] == clean.finals()[0]["state"]
    assert again.losses() == clean.losses(), "every loss bitwise the same"
    losses = clean.losses()
    assert len(losses) == 30
    assert losses[29] < losses[0], "it learns"
    assert int(clean.finals()[0]["tokens"]) == 30 * 24, "the Python counter counted every step once"


def test_the_bucketed_sums_are_the_global_sums_at_any_world_size(clean, tmp_path):
    # One worker computes the whole global batch itself; three each sum
    # several gradient buckets over the network while backward runs. With SGD
    # the update scales with the gradient, so a bucket lost, doubled or summed
    # out of place would move the loss curve far more than float rounding does.
    buckets = {int(n) for n in re.findall(r"buckets=(\d+) ", clean.output)}
    assert len(buckets) == 1 and buckets.pop() >= 2, "the test model's gradient spans several buckets"
    sgd = STEPS + ["--optimizer", "sgd"]
    one = run_job(tmp_path, "one", ["--nproc", "1", "--spares", "0", "--inject", "none"], sgd)
    three = run_job(tmp_path, "three", NPROC + ["--spares", "0", "--inject", "none"], sgd)
    # Two micro-batches a step for three workers: one of them has none, and adds zeros to each bucket.
    few = ["--steps", "30", "--optimizer", "sgd", "--global-batch", "4", "--micro-batch", "2"]
    one_few = run_job(tmp_path, "one-few", ["--nproc", "1", "--spares", "0", "--inject", "none"], few)
    three_few = run_job(tmp_path, "three-few", NPROC + ["--spares", "0", "--inject", "none"], few)
    for a, b in ((one, three), (one_few, three_few)):
        assert a.code == 0, a.output
        assert b.code == 0, b.output
        assert len(b.losses()) == 30
        for step, loss in b.losses().items():
            assert abs(loss - a.losses()[step]) <= 1e-4 * abs(loss), f"step {step}: {loss} vs {a.losses()[step]}"


SALVAGED = re.compile(r"step 20: rank (\d) kept its gradient sum of the step in flight and reduces it again")


@pytest.mark.parametrize("fault,salvage", [("kill:rank=1,step=20", True), ("hang:rank=1,step=20", True),
                                           ("hang:rank=1,step=20", False), ("exception:rank=1,step=20", True)])
def test_each_fault_kind_ends_bitwise_equal_and_keeps_healthy_processes(clean, tmp_path, fault, salvage):
    # The spare must have joined before step 20 (a Python start under load can take seconds; steps take ms).
    job = run_job(tmp_path, "fault", NPROC + ["--spares", "1", "--heartbeat-timeout-ms", "1000", "--inject", fault],
                  STEPS + ["--wait-for-joins", "4", "--journal", str(tmp_path / "fault.jsonl")] +
                  ([] if salvage else ["--no-salvage"]))
    assert job.code == 0, job.output
    finals = {f["rank"]: f for f in job.finals()}
    assert sorted(finals) == ["0", "1", "2"], job.output
    want = clean.finals()[0]
    for rank, f in finals.items():
        assert f["state"] == want["state"], f"{fault}: rank {rank}'s state (parameters, AdamW, counter)\n{job.output}"
        assert f["params"] == want["params"], job.output
        assert f["tokens"] == want["tokens"], "the counter was restored with the state, not counted twice"
    assert job.losses() == clean.losses(), f"{fault}: every loss bitwise the same"
    assert "recovery report: 1 recovery" in job.output, job.output
    # Salvage: a hang leaves the survivors waiting in the reduction with their backward complete, so
    # (unless one is slower than the hang's detection) they reduce their kept sums again instead of
    # computing step 20 again; the spare computes rank 1's share. Never the lost rank's.
    kept = {m.group(1) for m in SALVAGED.finditer(job.output)}
    assert "1" not in kept, job.output
    if fault.startswith("hang") and salvage:
        assert kept, "the survivors kept their sums\n" + job.output
    if not salvage:
        assert not kept, job.output

    # The spare took rank 1: a process that set up before the fault, whose state came from its peers.
    setups = job.setups()
    assert finals["1"]["worker"] not in {"0", "1", "2"}, "the spare (worker 3) took the lost rank\n" + job.output
    recovered = [e["recovery"] for e in job.events("recovery_end")]
    assert recovered and recovered[0]["bytes_copied"] > 0, "the spare copied the state from its peers"
    assert recovered[0]["lost_steps"] <= 1, recovered
    # Healthy workers: the same process from start to end, set up once.
    for rank in ("0", "2"):
        f = finals[rank]
        mine = [s for s in setups if s["worker"] == f["worker"]]
        assert mine == [{"worker": f["worker"], "pid": f["pid"]}], f"rank {rank} was restarted\n{job.output}"


PLANNED_KEPT = re.compile(r"step 20: kept the sums of (\d+) of 12 micro-batches from the step in flight \((\d+) "
                          r"member\(s\)\); the rest computed by (\d+) member\(s\), (\d+) of them lent")


def test_planned_steps_have_the_bits_of_the_bucketed_ones(clean, tmp_path):
    # plan(step), backward(loss), reduce(): the same sums in the same order, so the same run.
    job = run_job(tmp_path, "planned", NPROC + ["--spares", "0", "--inject", "none"], STEPS + ["--planned"])
    assert job.code == 0, job.output
    assert {f["state"] for f in job.finals()} == {clean.finals()[0]["state"]}, job.output
    assert job.losses() == clean.losses(), "every loss bitwise the same"


@pytest.mark.parametrize("fault,salvage", [("hang:rank=1,step=20", True), ("kill:rank=1,step=20,at=0.5", True),
                                           ("kill:rank=1,step=20,at=0.5", False)])
def test_a_planned_step_cut_short_keeps_the_survivors_micro_batches_and_ends_bitwise(clean, tmp_path, fault,
                                                                                      salvage):
    # 12 micro-batches, 4 a rank. The hang at rank 1's reduction, which pauses 300 ms after each
    # micro-batch of step 20, finds the survivors waiting in theirs with their blocks complete: they keep all
    # 8, and rank 1's 4 are computed again, 2 by the spare and 2 lent out. A kill half-way, with
    # every rank pausing, lands when each survivor has completed 1 to 3 of its 4: it keeps those
    # and computes the rest, the tails lent out.
    # (Rank 1 late on purpose is no hang: the hang detector's floor is raised past its 1.2 s.)
    pause = ["--pause-after-micro-batch-ms", "300"]
    pause += ["--pause-rank", "1", "--pause-step", "20"] if fault.startswith("hang") else []
    late = ["--busy-timeout-ms", "20000"] if fault.startswith("hang") else []
    job = run_job(tmp_path, "planned", NPROC + late + ["--spares", "1", "--heartbeat-timeout-ms", "1000", "--inject", fault],
                  STEPS + ["--planned"] + pause + ["--wait-for-joins", "4",
                           "--journal", str(tmp_path / "planned.jsonl")] + ([] if salvage else ["--no-salvage"]),
                  timeout=400)
    assert job.code == 0, job.output
    want = clean.finals()[0]
    finals = job.finals()
    assert len(finals) == 3 and {f["state"] for f in finals} == {want["state"]}, job.output
    assert job.losses() == clean.losses(), "every loss bitwise the same, the kept and lent micro-batches' included"
    assert plan_worlds(tmp_path / "planned.jsonl") == [3, 3], job.output
    kept = PLANNED_KEPT.search(job.output)
    if not salvage:
        assert kept is None, job.output
    elif fault.startswith("hang"):
        # (Rank 1's 4 left over 3 members: 2 each at most, so the spare computes 2 and lends 2.)
        assert kept and kept.groups() == ("8", "2", "2", "2"), job.output
    else:
        # 8 only if step 19 ran so slow that the kill, timed from it, came after the survivors were done.
        assert kept and 1 <= int(kept.group(1)) <= 8, "the survivors' completed micro-batches were kept\n" + job.output


@pytest.mark.parametrize("planned", [False, True])
def test_tensors_staged_through_host_twins_end_bitwise_through_a_kill(clean, tmp_path, planned):
    # The path of a GPU tensor (nonstop/_device.py), taken here by CPU tensors: every collective runs on a
    # host twin, copied down before it and back up after. A twin not copied back, copied back before its
    # sum is done, or copied back from a step cut short moves the bits. Bucketed: a kill half-way through
    # step 20. Planned: the hang of the planned test above (rank 1 late in step 20, the survivors' blocks
    # complete), after which rank 1's block is computed again, 2 by the spare and 2 lent (broadcast on twins).
    if planned:
        fault, late = "hang:rank=1,step=20", ["--busy-timeout-ms", "20000"]
        extra = ["--planned", "--pause-after-micro-batch-ms", "300", "--pause-rank", "1", "--pause-step", "20"]
    else:
        fault, late, extra = "kill:rank=1,step=20,at=0.5", [], []
    job = run_job(tmp_path, "staged", NPROC + late + ["--spares", "1", "--heartbeat-timeout-ms", "1000",
                                                       "--inject", fault],
                  STEPS + extra + ["--wait-for-joins", "4", "--journal", str(tmp_path / "staged.jsonl")],
                  timeout=400, env=staged_env(tmp_path))
    assert job.code == 0, job.output
    finals = job.finals()
    assert len(finals) == 3 and {f["state"] for f in finals} == {clean.finals()[0]["state"]}, job.output
    assert job.losses() == clean.losses(), "every loss bitwise the same"
    assert "recovery report: 1 recovery" in job.output, job.output
    twins = staged_twins(job)
    for f in finals:
        assert twins.get(f["pid"], {}).get("bucket", 0) > 0, f"rank {f['rank']}'s buckets were not staged\n" + job.output
    if planned:
        kept = PLANNED_KEPT.search(job.output)
        assert kept and kept.groups() == ("8", "2", "2", "2"), job.output
        assert sum(t.get("loan", 0) for t in twins.values()) > 0, "the loans went through twins\n" + job.output


def test_a_planned_step_cut_short_by_a_shrink_keeps_the_survivors_blocks_and_deals_the_rest(clean, tmp_path):
    # No spare: the world shrinks to 2 and rank 2 becomes rank 1, so what the survivors hold is no
    # prefix of their new blocks. They keep their 8 micro-batches all the same, and the lost 4 are
    # dealt over the 2: the same sum in another order, so the loss stays within rounding. With SGD
    # the update scales with the gradient: a micro-batch lost or counted twice moves the curve far
    # more than rounding does.
    sgd = STEPS + ["--optimizer", "sgd"]
    fixed = run_job(tmp_path, "fixed", NPROC + ["--spares", "0", "--inject", "none"], sgd)
    assert fixed.code == 0, fixed.output
    job = run_job(tmp_path, "shrink", NPROC + ["--spares", "0", "--busy-timeout-ms", "20000",
                                               "--inject", "kill:rank=1,step=20"],
                  sgd + ["--planned", "--pause-after-micro-batch-ms", "300", "--pause-rank", "1",
                           "--pause-step", "20", "--journal", str(tmp_path / "shrink.jsonl")])
    assert job.code == 0, job.output
    assert plan_worlds(tmp_path / "shrink.jsonl") == [3, 2], job.output
    kept = PLANNED_KEPT.search(job.output)
    assert kept and kept.groups() == ("8", "2", "2", "0"), "both survivors kept their blocks\n" + job.output
    finals = job.finals()
    assert len(finals) == 2 and len({f["state"] for f in finals}) == 1, job.output
    assert int(finals[0]["tokens"]) == 30 * 24, "every step counted once"
    losses, want = job.losses(), fixed.losses()
    assert sorted(losses) == list(range(30)), job.output
    for step in range(30):
        assert abs(losses[step] - want[step]) <= 1e-4 * abs(want[step]), f"step {step}: {losses[step]} vs {want[step]}"


def test_the_world_shrinks_and_grows_live(clean, tmp_path):
    proc = start_job(tmp_path, "elastic",
                     ["--nproc", "3", "--spares", "0", "--max-world", "3", "--inject", "kill:rank=2,step=8"],
                     ["--steps", "40", "--throttle-ms", "60", "--hold-for-joins", "4",
                      "--journal", str(tmp_path / "elastic.jsonl")])
    journal = tmp_path / "elastic.jsonl"

    shrink_then_grow(tmp_path, proc, journal, 2, 3)
    job = finish_job(tmp_path, "elastic", proc)
    assert job.code == 0, job.output
    assert plan_worlds(journal) == [3, 2, 3], job.output
    finals = job.finals()
    assert len(finals) == 3 and len({f["state"] for f in finals}) == 1, job.output
    assert int(finals[0]["tokens"]) == 40 * 24, "every step counted once across the changes"
    losses = job.losses()
    assert sorted(losses) == list(range(40)), "no step lost or skipped"
    # The two survivors kept their processes through both changes.
    setups = job.setups()
    for f in finals:
        if f["worker"] in ("0", "1"):
            assert [s["pid"] for s in setups if s["worker"] == f["worker"]] == [f["pid"]], job.output
