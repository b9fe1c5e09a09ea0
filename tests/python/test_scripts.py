"""What real scripts do, under `nonstop run` (docs/recovery.md, "Slow is not hung"
and "A failure that repeats"): a rank 0 that spends long seconds saving its
snapshot is busy, not hung; a bug in the script ends the job with exit 12 and
its traceback instead of looping through spares; torch's own launcher check sees
torchrun's environment from its first line, and a failure leaves torchelastic's
error file; a script that fails after training ended fails the job."""

import json
import os
import pathlib
import re
import time


from conftest import run_job

HERE = pathlib.Path(__file__).resolve().parent
SCRIPT = HERE / "epochs.py"
FINAL = re.compile(r"\[rank (\d)\] final params (\w+)")


def finals(output):
    return dict(FINAL.findall(output))


def timed(tmp_path, name, flags, args):
    start = time.monotonic()
    job = run_job(tmp_path, name, flags, args, script=SCRIPT, timeout=400)
    return job, time.monotonic() - start


def test_a_rank_saving_for_30_s_each_epoch_is_not_hung(tmp_path):
    # The others wait in the next epoch's first all-reduce for 30 s each time:
    # with the default busy timeout (60 s) that is no fault, and the job's wall
    # time is the clean run's plus the saves.
    flags = ["--nproc", "3", "--spares", "1", "--inject", "none"]
    clean, clean_s = timed(tmp_path, "clean", flags, ["--epochs", "2"])
    assert clean.code == 0, clean.output
    slow, slow_s = timed(tmp_path, "slow", flags, ["--epochs", "2", "--save-seconds", "30"])
    assert slow.code == 0, slow.output
    assert slow.events("fault") == [], slow.output
    assert slow.events("recovery_start") == [], slow.output
    assert finals(slow.output) == finals(clean.output), "the same bits as the clean run"
    waits = slow.events("waiting")
    assert waits and all(w["rank"] == 0 for w in waits), "the journal says whom the others waited for"
    # About the clean run's plus the 60 s of saves (a save overlaps the other ranks' last steps).
    assert 55 <= slow_s - clean_s <= 60 + 20, f"clean {clean_s:.1f} s, with the saves {slow_s:.1f} s"


def test_a_marked_section_is_not_hung_past_the_busy_timeout(tmp_path):
    # A busy timeout of 2 s, and rank 0 saving for 6 s each epoch, spinning on
    # a core: inside `session.busy("snapshot")` no fault; the same save
    # unmarked is found as a hang at the busy timeout.
    flags = ["--nproc", "3", "--spares", "0", "--inject", "none", "--busy-timeout-ms", "2000"]
    marked, _ = timed(tmp_path, "marked", flags, ["--epochs", "2", "--save-seconds", "6", "--spin", "--busy"])
    assert marked.code == 0, marked.output
    assert marked.events("fault") == [], marked.output
    waits = marked.events("waiting")
    assert waits and waits[0]["section"] == "snapshot", marked.output
    unmarked, _ = timed(tmp_path, "unmarked", flags, ["--epochs", "2", "--save-seconds", "6", "--spin"])
    faults = unmarked.events("fault")
    assert faults, unmarked.output
    assert faults[0]["kind"] == "hang detector" and faults[0]["rank"] == 0, faults[0]
    waited = float(re.search(r"waited (\d+) ms", faults[0]["detail"]).group(1))
    assert 2000 <= waited <= 4000, faults[0]["detail"]


def test_a_bug_on_one_ranks_data_ends_the_job_after_two_repeats(tmp_path):
    # Rank 1 raises at step 5, and so does each spare that takes rank 1: the
    # first is replaced (a flaky node would be), the third ends the job.
    job, took = timed(tmp_path, "bug", ["--nproc", "3", "--spares", "3", "--inject", "none"],
                      ["--raise-at-step", "5", "--raise-ranks", "1"])
    assert job.code == 12, job.output
    assert took < 60, f"{took:.1f} s"
    ends = job.events("job_end")
    assert len(ends) == 1 and ends[0]["exit_code"] == 12, ends
    reason = ends[0]["reason"]
    assert "the same exception was raised 3 times" in reason, reason
    assert "Rank 1 raised at step 5: ValueError: sample of step 5 on rank 1 is malformed" in reason, reason
    assert "Traceback (most recent call last)" in reason and "epochs.py" in reason, reason
    assert len(job.events("recovery_start")) == 2, "two replacements, then the end"
    assert job.output.count("[nonstop] job FAILED") == 1, job.output
    tracebacks = [line for line in job.output.splitlines() if line == "Traceback (most recent call last):"]
    assert len(tracebacks) == 1, "the controller prints the script's traceback once (the workers' own are [rank N])"


def test_a_bug_on_every_rank_ends_the_job_at_once(tmp_path):
    job, took = timed(tmp_path, "all", ["--nproc", "3", "--spares", "1", "--inject", "none"],
                      ["--raise-at-step", "5", "--raise-ranks", "all"])
    assert job.code == 12, job.output
    assert took < 60, f"{took:.1f} s"
    reason = job.events("job_end")[0]["reason"]
    assert "every member (3) raised the same exception at step 5" in reason, reason
    assert job.events("recovery_start") == [], "no rank was replaced"


LAUNCHER_SCRIPT = HERE / "real" / "torch_launcher" / "test_script.py"  # PyTorch's, as it is
ENV_LINE = re.compile(r"\[worker (\d+)\] (\w+) = (.*)")


def test_a_spare_takes_the_distributed_path_of_a_script_that_tests_rank_for_minus_one(tmp_path):
    # nanoGPT's `ddp = int(os.environ.get("RANK", -1)) != -1`: a spare that started with RANK=-1
    # trained alone and exited (a new-user trial saw it). It now starts with a RANK no member has,
    # joins with the rank= and world_size= it read, and takes rank 1 at the kill.
    flags = ["--nproc", "3", "--spares", "1"]
    clean = run_job(tmp_path, "clean", [*flags, "--inject", "none"], ["--join-first"], script=SCRIPT, timeout=400)
    assert clean.code == 0, clean.output
    killed = run_job(tmp_path, "killed", [*flags, "--inject", "kill:rank=1,step=5"], ["--join-first"],
                     script=SCRIPT, timeout=400)
    assert killed.code == 0, killed.output
    assert "training alone" not in killed.output, killed.output
    assert [len(p["members"]) for p in killed.events("plan")] == [3, 3], "the spare took the rank"
    assert len(killed.events("recovery_end")) == 1, killed.output
    assert finals(killed.output) == finals(clean.output), "the same bits as the clean run"
    assert len(set(finals(clean.output).values())) == 1, clean.output
    # The drop-in reports no step time: the session measures it, so the fault's cost is told in
    # normal steps (it said "no normal step was known yet" after 4 steps).
    assert re.search(r"time lost \d+ ms, [\d.]+ of a normal step", killed.output), killed.output


EVAL = re.compile(r"\[rank (\d)\] eval epoch (\d+): (\d+) samples, loss (\S+)")


def test_an_evaluation_loader_deals_the_live_world_and_the_first_loader_trains(tmp_path):
    # A training loader, then an evaluation loader of 31 samples, as minGPT's trainer makes them;
    # the drop-in DDP registers the first. Each epoch every rank evaluates its share of the live
    # world, torch's way (padded to a multiple of the world), and the sums are all-reduced: 33 at
    # world 3 with every rank agreeing; after a kill with no spare, 32 at world 2.
    args = ["--join-first", "--eval", "31", "--epochs", "3"]
    clean = run_job(tmp_path, "clean", ["--nproc", "3", "--spares", "0", "--inject", "none"], args,
                    script=SCRIPT, timeout=400)
    assert clean.code == 0, clean.output
    evals = EVAL.findall(clean.output)
    assert sorted({(e, n) for _, e, n, _ in evals}) == [("0", "33"), ("1", "33"), ("2", "33")], clean.output
    assert len({(e, loss) for _, e, _, loss in evals}) == 3, "the ranks agree on each epoch's loss"
    # 96 samples in global batches of 24: 4 steps an epoch; the kill lands in epoch 1.
    shrunk = run_job(tmp_path, "shrunk", ["--nproc", "3", "--spares", "0", "--inject", "kill:rank=2,step=5"], args,
                     script=SCRIPT, timeout=400)
    assert shrunk.code == 0, shrunk.output
    assert [len(p["members"]) for p in shrunk.events("plan")] == [3, 2], shrunk.output
    by_epoch = {}
    for rank, epoch, n, loss in EVAL.findall(shrunk.output):
        by_epoch.setdefault(epoch, set()).add((n, loss))
    assert {n for n, _ in by_epoch["2"]} == {"32"}, shrunk.output
    assert len(by_epoch["2"]) == 1, "the two ranks agree"
    # A spare takes the rank: the same evaluations as the clean run, bit for bit.
    spare = run_job(tmp_path, "spare", ["--nproc", "3", "--spares", "1", "--inject", "kill:rank=1,step=5"], args,
                    script=SCRIPT, timeout=400)
    assert spare.code == 0, spare.output
    assert finals(spare.output) == finals(clean.output), spare.output
    assert re.findall(r"eval epoch (\d) replayed: (\d+) batches", spare.output) == [("0", "0")], \
        "the spare's replay of epoch 0 evaluated nothing (its peers were in epoch 1)"
    last = {(n, loss) for _, e, n, loss in EVAL.findall(spare.output) if e == "2"}
    assert last == {(n, loss) for _, e, n, loss in evals if e == "2"}, spare.output


def test_torchs_launcher_script_sees_torchruns_environment_from_its_first_line(tmp_path):
    # torch's own launcher check reads 16 variables as it starts and touches a file named by its
    # RANK; it never joins the job, so the job ends as torchrun's would once every worker has.
    touched = tmp_path / "touched"
    touched.mkdir()
    job = run_job(tmp_path, "launcher", ["--nproc", "3", "--spares", "0", "--inject", "none"],
                  ["--touch_file_dir", str(touched)], script=LAUNCHER_SCRIPT,
                  env={"TEST_SENTINEL_PARENT": "from-the-caller"})
    assert job.code == 0, job.output
    assert sorted(p.name for p in touched.iterdir()) == ["0", "1", "2"], job.output
    seen = {}
    for worker, name, value in ENV_LINE.findall(job.output):
        seen.setdefault(int(worker), {})[name] = value
    assert sorted(seen) == [0, 1, 2], job.output
    for worker, env in seen.items():
        assert len(env) == 16, env
        rank = env["RANK"]
        assert env["LOCAL_RANK"] == env["ROLE_RANK"] == rank == str(worker), env
        assert env["WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3", env
        assert (env["GROUP_RANK"], env["ROLE_NAME"], env["MASTER_ADDR"]) == ("0", "default", "127.0.0.1"), env
        assert env["TORCHELASTIC_RESTART_COUNT"] == env["TORCHELASTIC_MAX_RESTARTS"] == "0", env
        assert env["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", "1"), env
        assert env["TEST_SENTINEL_PARENT"] == "from-the-caller", env
        assert env["MASTER_PORT"].isdigit() and env["TORCHELASTIC_RUN_ID"], env
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"error-worker-{worker}.json"), env


def test_a_script_that_raises_leaves_torchelastics_error_file(tmp_path):
    # The traceback the controller was told of is also in TORCHELASTIC_ERROR_FILE, in the format of
    # torch.distributed.elastic's @record (under TMPDIR here: the agent's run directory).
    job = run_job(tmp_path, "raises", ["--nproc", "3", "--spares", "0", "--inject", "none"],
                  ["--raise-at-step", "2", "--raise-ranks", "all"], script=SCRIPT, env={"TMPDIR": str(tmp_path)})
    assert job.code == 12, job.output
    files = sorted(tmp_path.glob("nonstop-agent-*/error-worker-*.json"))
    assert len(files) == 3, job.output
    record = json.loads(files[0].read_text())["message"]
    assert record["message"].startswith("ValueError: sample of step 2"), record
    assert "Traceback" in record["extraInfo"]["py_callstack"] and record["extraInfo"]["timestamp"].isdigit()


def test_a_script_that_fails_after_destroy_process_group_fails_the_job(tmp_path):
    # Training ended (every rank finished), then the script fails on one rank (saving the model, say):
    # the job fails with 12, as torchrun's would with that rank's code, naming the rank.
    script = tmp_path / "fails_after.py"
    script.write_text(
        "import sys\n"
        "import torch.distributed as dist\n"
        "import nonstop.torch\n"
        "nonstop.torch.init_process_group(backend='nonstop')\n"
        "rank = dist.get_rank()\n"
        "nonstop.torch.destroy_process_group()\n"
        "sys.exit(3 if rank == 1 else 0)\n")
    job = run_job(tmp_path, "after", ["--nproc", "3", "--spares", "0", "--inject", "none"], script=script)
    assert job.code == 12, job.output
    assert "rank 1 (worker 1) exited with code 3 after training ended" in job.output, job.output
    assert len(job.events("failed_after_end")) == 1, job.output
