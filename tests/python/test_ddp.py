"""DDP's options, buffers, hooks and per-rank state through a kill, on
epochs.py (the tutorial's shape) under `nonstop run` (docs/python.md,
"DDP's options", "Buffers through a fault" and "What registration does")."""

import pathlib
import re

import pytest

from conftest import run_job

HERE = pathlib.Path(__file__).resolve().parent
SCRIPT = HERE / "epochs.py"
FLAGS = ["--nproc", "3", "--spares", "1"]


def finals(output, what="params"):
    return dict(re.findall(rf"\[rank (\d)\] final {what} (\w+)", output))


def clean_and_killed(tmp_path, args, kill="kill:rank=1,step=5"):
    clean = run_job(tmp_path, "clean", FLAGS + ["--inject", "none"], args, script=SCRIPT, timeout=300)
    assert clean.code == 0, clean.output
    killed = run_job(tmp_path, "killed", FLAGS + ["--inject", kill], args, script=SCRIPT, timeout=300)
    assert killed.code == 0, killed.output
    assert len(killed.events("recovery_end")) == 1, killed.output
    return clean, killed


@pytest.mark.parametrize("args", [
    ["--ddp-options", "find_unused_parameters"],  # DDP's int32 map of the parameters used, summed
    ["--ddp-options", "gradient_as_bucket_view"],
    ["--ddp-options", "static_graph"],  # a spare's first iteration is not the job's
    ["--comm-hook", "allreduce"],  # torch's allreduce hook over nonstop's share weighting
    ["--comm-hook", "fp16"],  # float16 buckets, summed as float32
    ["--norm", "sync"],  # SyncBatchNorm's collectives: an all-reduce inside the backward pass
], ids=lambda a: "-".join(a).strip("-"))
def test_each_option_trains_through_a_kill_bitwise(tmp_path, args):
    clean, killed = clean_and_killed(tmp_path, ["--epochs", "2", *args])
    assert len(set(finals(clean.output).values())) == 1, clean.output
    assert finals(killed.output) == finals(clean.output)


def test_batchnorm_buffers_through_a_kill_of_rank_0(tmp_path):
    # broadcast_buffers on (DDP's default): the step cut short runs again from the buffers its
    # forward found (rank 0's, broadcast), so every rank ends on the fault-free run's buffers,
    # the spare that took rank 0 included.
    clean, killed = clean_and_killed(tmp_path, ["--norm", "batch"], kill="kill:rank=0,step=5")
    assert len(finals(clean.output, "buffers")) == 3
    assert finals(killed.output, "buffers") == finals(clean.output, "buffers")
    assert finals(killed.output) == finals(clean.output)


def test_batchnorm_buffers_per_rank_without_broadcast(tmp_path):
    # broadcast_buffers off: each rank's buffers are its own; the survivors end on their fault-free
    # bits, and the spare on a survivor's buffers trained on with rank 0's batches (docs/python.md).
    clean, killed = clean_and_killed(tmp_path, ["--norm", "batch", "--no-broadcast-buffers"],
                                     kill="kill:rank=0,step=5")
    want, got = finals(clean.output, "buffers"), finals(killed.output, "buffers")
    assert len(set(want.values())) == 3, "without the broadcast each rank's buffers differ"
    assert got["1"] == want["1"] and got["2"] == want["2"], (want, got)
    assert got["0"] != want["0"], "the spare's buffers are a survivor's, not the dead rank's"
    assert finals(killed.output) == finals(clean.output)


def test_powersgd_trains_on_after_a_kill(tmp_path):
    # PowerSGD compresses from its second iteration; its error feedback is each rank's own, and a
    # spare's starts at zero: the job trains on, every rank on the same parameters, not bitwise.
    clean, killed = clean_and_killed(tmp_path, ["--epochs", "4", "--comm-hook", "powersgd"],
                                     kill="kill:rank=1,step=9")
    assert len(set(finals(killed.output).values())) == 1, killed.output
    assert len(finals(killed.output)) == 3


def test_a_per_rank_counter_passes_the_replica_check(tmp_path):
    # A counter that differs by rank, registered with per_rank=, checked every 2 steps: never
    # compared, so no member is found diverged; a spare that takes rank 1 goes on from rank 0's.
    args = ["--epochs", "4", "--count-samples"]
    env = {"NONSTOP_REPLICA_CHECK_EVERY": "2"}
    clean = run_job(tmp_path, "clean", FLAGS + ["--inject", "none"], args, script=SCRIPT, timeout=300, env=env)
    assert clean.code == 0, clean.output
    counts = dict(re.findall(r"\[rank (\d)\] trained on (\d+) samples", clean.output))
    assert counts == {"0": "128", "1": "144", "2": "160"}, clean.output
    assert clean.events("recovery_start") == [], clean.output
    steps = [s for s in clean.events("step") if "replica_check_ms" in s]
    assert len(steps) >= 5, "the replica check ran"
    killed = run_job(tmp_path, "killed", FLAGS + ["--inject", "kill:rank=1,step=9"], args, script=SCRIPT,
                     timeout=300, env=env)
    assert killed.code == 0, killed.output
    assert len(killed.events("recovery_start")) == 1, "the kill, and no repair"
    counts = dict(re.findall(r"\[rank (\d)\] trained on (\d+) samples", killed.output))
    # rank 0's 9 steps of 8 + 0, then rank 1's 7 steps of 8 + 1
    assert counts == {"0": "128", "1": str(9 * 8 + 7 * 9), "2": "160"}, killed.output


def test_without_set_epoch_every_epoch_has_epoch_0s_order_through_a_kill(tmp_path):
    # torch's sampler without set_epoch gives every epoch the order of epoch 0; so does nonstop's,
    # and a spare that replays the loop (no epoch numbers to go by) skips the epochs the job
    # finished by counting its loops.
    args = ["--epochs", "3", "--shuffle", "--no-set-epoch"]
    clean, killed = clean_and_killed(tmp_path, args, kill="kill:rank=1,step=6")
    began = re.findall(r"\[rank 0\] epoch (\d) began with samples (\[[\d, ]+\])", clean.output)
    assert [e for e, _ in began] == ["0", "1", "2"], clean.output
    assert len({order for _, order in began}) == 1, began
    assert finals(killed.output) == finals(clean.output)
    # rank 1 printed epoch 0 and died at step 6 (epoch 1: 4 steps an epoch); the spare that took
    # the rank trained epochs 1 and 2 only
    assert re.findall(r"\[rank 1\] epoch (\d) began", killed.output) == ["0", "1", "2"], killed.output
