"""Sharded optimizer state from Python (nonstop.torch.ShardedOptimizer and
ShardedDataParallel, docs/python.md "Sharded optimizer state"): each rank of a
group of 2 holds half of AdamW's state; a kill with a spare ends bitwise equal
to the fault-free run (the spare copies its shard from the shard's other
holder); a shrink on a kill with no spare carries on within rounding; and the
loss curve is the unsharded optimizer's, within rounding."""

import re

import pytest

from conftest import run_job, staged_env, staged_twins

# Clipped to a norm the gradient exceeds: the norm over every shard matters.
SHARDED = ["--steps", "30", "--shard-group", "2", "--clip-norm", "0.05"]
FOUR = ["--nproc", "4"]
STATE_FLOATS = re.compile(r"worker=(\d+) shard=(\d) of 2 optimizer state floats=(\d+)")
PARAMETERS = 16 * 48 + 48 + 48 * 48 + 48 + 48 + 1  # tests/python/trainer.py's model


def by_rank(job):
    assert job.code == 0, job.output
    finals = {f["rank"]: f for f in job.finals()}
    assert len({f["params"] for f in finals.values()}) == 1, "every rank ends on the same parameters\n" + job.output
    return finals


def assert_spare_took_rank_1_bitwise(job, clean):
    """The spare took rank 1 and every rank ends on the fault-free run's parameters and shard of the
    state, every loss the same."""
    want = by_rank(clean)
    finals = by_rank(job)
    assert finals["1"]["worker"] == "4", "the spare took rank 1\n" + job.output
    for rank in "0123":
        assert finals[rank]["params"] == want[rank]["params"], job.output
        assert finals[rank]["state"] == want[rank]["state"], f"rank {rank}'s shard of the state\n{job.output}"
    assert job.losses() == clean.losses(), "every loss bitwise the same"
    return finals


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clean")
    return run_job(tmp, "clean", FOUR + ["--spares", "0", "--inject", "none"], SHARDED)


def test_each_rank_holds_its_shard_of_the_optimizer_state(clean):
    finals = by_rank(clean)
    shards = {int(m.group(1)): (int(m.group(2)), int(m.group(3))) for m in STATE_FLOATS.finditer(clean.output)}
    assert len(shards) == 4, clean.output
    half = (PARAMETERS + 1) // 2  # padded to a multiple of 2, then halved
    for worker, (shard, floats) in shards.items():
        assert shard == worker % 2
        assert floats == 2 * half + 1, "AdamW's two moments of one shard, and its step count"
    # Ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1: the same state within a shard, another across.
    assert finals["0"]["state"] == finals["2"]["state"] != finals["1"]["state"] == finals["3"]["state"]


def test_a_kill_with_a_spare_ends_bitwise_equal(clean, tmp_path):
    job = run_job(tmp_path, "kill", FOUR + ["--spares", "1", "--inject", "kill:rank=1,step=20"],
                  SHARDED + ["--wait-for-joins", "5", "--journal", str(tmp_path / "kill.jsonl")])
    assert_spare_took_rank_1_bitwise(job, clean)
    recovered = [e["recovery"] for e in job.events("recovery_end")]
    assert recovered and recovered[0]["bytes_copied"] > 0, "the spare copied its shard from its peers"


def test_a_shrink_and_the_unsharded_optimizer_stay_within_rounding(clean, tmp_path):
    # Rank 0 lost, no spare: the world shrinks to 2 (a multiple of the group), workers 1 and 2 become
    # ranks 0 and 1, and each changes shard: it copies the other shard's state from its holder. A
    # wrong or missing copy (zero moments) would move the loss curve far more than 1e-4.
    shrunk = run_job(tmp_path, "shrink", FOUR + ["--spares", "0", "--inject", "kill:rank=0,step=20"], SHARDED)
    by_rank(shrunk)
    assert "world=2" in shrunk.output, shrunk.output
    assert len(re.findall(r"re-sharded: copied shard \d of the optimizer state", shrunk.output)) == 2, shrunk.output
    whole = run_job(tmp_path, "whole", FOUR + ["--spares", "0", "--inject", "none"],
                    ["--steps", "30", "--clip-norm", "0.05"])
    by_rank(whole)
    for other in (shrunk, whole):
        losses = other.losses()
        assert sorted(losses) == list(range(30)), other.output
        for step, loss in clean.losses().items():
            assert abs(losses[step] - loss) <= 1e-4 * abs(loss), f"step {step}: {losses[step]} vs {loss}"


def test_a_model_on_a_gpu_keeps_its_shards_in_host_memory_and_ends_bitwise_through_a_kill(clean, tmp_path):
    # The path of a model on a GPU (docs/gpu.md, "Sharded state on a GPU"), taken here by CPU tensors:
    # the model's parameters and gradients live in buffers of their own, the registered (sharded) state
    # in host memory; each reduce() copies the gradients down and each gather copies the parameters up.
    # A copy left out or made at the wrong moment (the parameters before the gather) moves the bits;
    # the spare copies its shard into host memory and its model's parameters are the gathered ones.
    job = run_job(tmp_path, "staged", FOUR + ["--spares", "1", "--inject", "kill:rank=1,step=20,at=0.5"],
                  SHARDED + ["--wait-for-joins", "5"], env=staged_env(tmp_path))
    finals = assert_spare_took_rank_1_bitwise(job, clean)
    twins = staged_twins(job)
    for rank, f in finals.items():
        copies = twins.get(f["pid"], {})
        # The spare ran the last 9 or 10 steps (as the kill found step 20): a copy of each a step.
        assert copies.get("shard.grads", 0) >= 9 and copies.get("shard.params", 0) >= 9, \
            f"rank {rank} did not copy its gradients down and its parameters up each step: {copies}\n{job.output}"


def test_ranks_without_a_micro_batch_still_gather_and_reduce_in_step(tmp_path):
    # 2 micro-batches a step over 4 ranks: ranks 2 and 3 run no forward, so their reduce() gathers the
    # parameters first, in the same order as the forwards of ranks 0 and 1 (or the group would hang).
    few = ["--steps", "12", "--shard-group", "2", "--global-batch", "4", "--micro-batch", "2"]
    job = run_job(tmp_path, "few", FOUR + ["--spares", "0", "--inject", "none"], few, timeout=120)
    by_rank(job)
    assert sorted(job.losses()) == list(range(12)), job.output
