"""World-invariant steps from Python (nonstop.torch.InvariantDataParallel,
docs/python.md "World-invariant steps"): the step's gradient is the sum of its
micro-batch gradients along one fixed tree, so a job ends on the same bits at
every world size, after a kill with a spare, after a shrink and after a grow;
a fault at the reduction keeps the sums the survivors had folded and computes
only the lost rank's micro-batches again, dealt over every member."""

import re

import pytest

from conftest import finish_job, plan_worlds, run_job, shrink_then_grow, staged_env, staged_twins, start_job

STEPS = ["--steps", "30"]
INVARIANT = STEPS + ["--world-invariant"]
KEPT = re.compile(r"step 20: kept the sums of (\d+) of 12 micro-batches from the step in flight")


def final_states(job):
    assert job.code == 0, job.output
    states = {(f["params"], f["state"]) for f in job.finals()}
    assert len(states) == 1, "every rank ends on the same state\n" + job.output
    return states.pop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free run at 3 workers: parameters and whole state."""
    tmp = tmp_path_factory.mktemp("reference")
    return final_states(run_job(tmp, "ref", ["--nproc", "3", "--spares", "0", "--inject", "none"], INVARIANT))


def test_the_same_bits_at_every_world_size(reference, tmp_path):
    for n in (1, 2, 4):
        job = run_job(tmp_path, f"n{n}", ["--nproc", str(n), "--spares", "0", "--inject", "none"], INVARIANT)
        assert final_states(job) == reference, f"{n} worker(s)\n{job.output}"
    # Not so by chance: the ring (DataParallel) sums in another order at another world size.
    one = final_states(run_job(tmp_path, "ring1", ["--nproc", "1", "--spares", "0", "--inject", "none"], STEPS))
    three = final_states(run_job(tmp_path, "ring3", ["--nproc", "3", "--spares", "0", "--inject", "none"], STEPS))
    assert one != three


@pytest.mark.parametrize("spares,salvage,staged", [(1, True, False), (0, True, False), (1, False, False),
                                                   (1, True, True)])
def test_a_kill_at_the_reduction_keeps_the_folded_sums_and_ends_bitwise(reference, tmp_path, spares, salvage, staged):
    # The kill fires at rank 1's reduction of step 20, and rank 1 pauses 300 ms after each micro-batch of it:
    # the survivors had folded their blocks, however loaded the machine. With a spare the world stays
    # 3, without it shrinks to 2; either way the retry keeps the survivors' sums.
    # (Rank 1 late on purpose is no hang: the hang detector's floor is raised past its 1.2 s.)
    flags = ["--nproc", "3", "--spares", str(spares), "--busy-timeout-ms", "20000", "--inject", "kill:rank=1,step=20"]
    extra = ["--pause-after-micro-batch-ms", "300", "--pause-rank", "1", "--pause-step", "20"]
    extra += ["--wait-for-joins", "4", "--journal", str(tmp_path / "kill.jsonl")] if spares else []
    # staged: the path of a GPU tensor (nonstop/_device.py): every micro-batch folded from a host twin, the
    # tree's sum written into one and copied back up.
    job = run_job(tmp_path, "kill", flags, INVARIANT + extra + ([] if salvage else ["--no-salvage"]),
                  env=staged_env(tmp_path) if staged else None)
    assert final_states(job) == reference, job.output
    if staged:
        twins = staged_twins(job)
        for f in job.finals():
            mine = twins.get(f["pid"], {})
            assert mine.get("tree.add", 0) > 0 and mine.get("tree.reduce", 0) > 0, f"rank {f['rank']}\n{job.output}"
    assert "recovery report: 1 recovery" in job.output, job.output
    kept = KEPT.search(job.output)
    if salvage:
        # 12 micro-batches over 3 ranks: the two survivors' 8, never the lost rank's 4.
        assert kept and kept.group(1) == "8", job.output
    else:
        assert kept is None, job.output
    worlds = plan_worlds(tmp_path / "kill.jsonl")
    assert worlds == ([3, 3] if spares else [3, 2]), job.output


def test_a_kill_between_micro_batches_keeps_what_the_survivors_folded(reference, tmp_path):
    # 300 ms after each micro-batch, 4 a rank: the kill half-way into step 20 (about 600 ms in) lands
    # when each survivor has folded 1 to 3 of its 4. Those partial runs are offered and kept; the
    # rest, and the lost rank's 4, are dealt over the 3 members.
    job = run_job(tmp_path, "mid", ["--nproc", "3", "--spares", "1", "--inject", "kill:rank=1,step=20,at=0.5"],
                  INVARIANT + ["--pause-after-micro-batch-ms", "300", "--wait-for-joins", "4",
                               "--journal", str(tmp_path / "mid.jsonl")], timeout=400)
    assert final_states(job) == reference, job.output
    kept = KEPT.search(job.output)
    # 1 to 7 as a rule; 8 only if step 19 ran so slow (a loaded machine) that the kill, timed from
    # it, came after the survivors had folded all: the bound checked holds whatever the timing.
    assert kept and 1 <= int(kept.group(1)) <= 8, "the survivors' folded sums were kept\n" + job.output


def test_a_shrink_and_a_grow_end_bitwise(reference, tmp_path):
    proc = start_job(tmp_path, "elastic",
                     ["--nproc", "3", "--spares", "0", "--max-world", "3", "--inject", "kill:rank=2,step=8"],
                     INVARIANT + ["--throttle-ms", "60", "--hold-for-joins", "4",
                                  "--journal", str(tmp_path / "elastic.jsonl")])
    journal = tmp_path / "elastic.jsonl"
    shrink_then_grow(tmp_path, proc, journal, 2, 3)
    job = finish_job(tmp_path, "elastic", proc)
    assert final_states(job) == reference, job.output
    assert plan_worlds(journal) == [3, 2, 3], job.output
    assert sorted(job.losses()) == list(range(30)), "no step lost or skipped"
