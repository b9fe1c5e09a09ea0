"""Durable checkpoints from Python: every rank calls save at a step boundary
and rank 0 writes (asynchronously, in nonstop-train's format and tensor
names); a new job resumes from it and ends bitwise where the uninterrupted
job ends, its Python counter counted once per step, with the optimizer state
whole or sharded; nonstop-train and a PyTorch script resume each other's
checkpoints with the writer's exact parameters."""

import json
import pathlib
import re
import struct
import subprocess
import sys

import pytest

from conftest import bin_dir, run_job, staged_env, staged_twins

HERE = pathlib.Path(__file__).resolve().parent
SCRIPT = HERE / "checkpoint_job.py"
LLAMA = HERE.parents[1] / "examples" / "pytorch" / "train_llama.py"
FINAL = re.compile(r"final checksum (\w+) seen (\d+)")
# No fault is injected in these jobs: a 5 s heartbeat timeout keeps a host whose agent is starved
# for a second (CI runs the wheel test's pip beside them on two cores) from being declared lost.
SLOW_OK = ["--heartbeat-timeout-ms", "5000"]
RUN = ["--nproc", "2", "--spares", "0", "--inject", "none"] + SLOW_OK
RUN_4 = ["--nproc", "4", "--spares", "0", "--inject", "none"] + SLOW_OK


def safetensors_header(saved):
    raw = (saved / "state.safetensors").read_bytes()
    return json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])


def final(job):
    found = set(FINAL.findall(job.output))
    assert len(found) == 1, job.output[-3000:]
    return found.pop()


def test_a_job_resumed_from_a_python_checkpoint_ends_where_the_uninterrupted_one_does(tmp_path):
    whole = run_job(tmp_path, "whole", RUN, ["--steps", "20"], script=SCRIPT)
    assert whole.code == 0, whole.output
    ckpt = tmp_path / "ckpt"
    first = run_job(tmp_path, "first", RUN, ["--steps", "12", "--save-at", "9", "--checkpoint-dir", str(ckpt)],
                    script=SCRIPT)
    assert first.code == 0, first.output
    saved, = ckpt.glob("step-*")
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["step"] == 9 and manifest["world_size"] == 2, manifest
    header = safetensors_header(saved)
    # nonstop-train's names: each parameter by the model's name, AdamW's moments per parameter.
    assert {"0.weight", "adamw.exp_avg.0.weight", "adamw.exp_avg_sq.0.weight", "adamw.step.0.weight", "step",
            "extra.int"} <= set(header), sorted(header)
    assert header["0.weight"]["shape"] == header["adamw.exp_avg.0.weight"]["shape"] == [32, 8], header
    resumed = run_job(tmp_path, "resumed", RUN, ["--steps", "20", "--resume", str(ckpt)], script=SCRIPT)
    assert resumed.code == 0, resumed.output
    assert "first step 10" in resumed.output, resumed.output[-3000:]
    assert final(resumed) == final(whole) == (final(whole)[0], "20"), "bitwise, and every step counted once"
    missing = run_job(tmp_path, "afresh", RUN, ["--steps", "3", "--resume", str(tmp_path / "none")], script=SCRIPT)
    assert missing.code == 0 and "first step 0" in missing.output, missing.output[-3000:]


@pytest.mark.parametrize("staged", [False, True])
def test_sharded_optimizer_state_is_gathered_for_the_checkpoint_and_each_rank_resumes_its_shard(tmp_path, staged):
    # Staged: the path of a sharded model on a GPU (docs/gpu.md), taken by CPU tensors: the checkpoint
    # is written from and loaded into the registered host copy of the parameters, which the first
    # gather copies up to the model's (loading into the model's own would be overwritten by it).
    sharded = RUN_4
    args = ["--shard-group", "2"]
    env = staged_env(tmp_path) if staged else None
    whole = run_job(tmp_path, "whole", sharded, ["--steps", "20", *args], script=SCRIPT)
    assert whole.code == 0, whole.output
    ckpt = tmp_path / "ckpt"
    first = run_job(tmp_path, "first", sharded, ["--steps", "12", "--save-at", "9", "--checkpoint-dir", str(ckpt),
                                                 *args], script=SCRIPT, env=env)
    assert first.code == 0, first.output
    saved, = ckpt.glob("step-*")
    header = safetensors_header(saved)
    # The layout of an unsharded run: the moments whole, per parameter.
    assert header["adamw.exp_avg.0.weight"]["shape"] == [32, 8] and "optimizer.exp_avg" not in header, header
    resumed = run_job(tmp_path, "resumed", sharded, ["--steps", "20", "--resume", str(ckpt), *args], script=SCRIPT,
                      env=env)
    assert resumed.code == 0, resumed.output
    assert "first step 10" in resumed.output, resumed.output[-3000:]
    assert final(resumed) == final(whole), "bitwise: every rank took its shard of the moments back"
    if staged:
        twins = staged_twins(resumed)
        assert len(twins) == 4 and all(t.get("shard.params", 0) > 1 for t in twins.values()), resumed.output
        return
    # The same layout: an unsharded job resumes from it too (another reduction: not the same bits).
    unsharded = run_job(tmp_path, "unsharded", sharded, ["--steps", "12", "--resume", str(ckpt)], script=SCRIPT)
    assert unsharded.code == 0 and "first step 10" in unsharded.output, unsharded.output[-3000:]


def run_native(tmp_path, name, command):
    """`nonstop run` (2 workers, no fault) of a command that is not a Python script."""
    cmd = [str(bin_dir() / "nonstop"), "run", "--journal", str(tmp_path / f"{name}.jsonl"), *RUN, "--", *command]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    return done.returncode, done.stdout + done.stderr


def test_nonstop_train_and_a_python_script_resume_each_others_checkpoints(tmp_path):
    # nonstop-train's llama-tiny, 4 steps, a checkpoint after step 3.
    cpp, py = tmp_path / "cpp", tmp_path / "py"
    code, out = run_native(tmp_path, "cpp", [str(bin_dir() / "nonstop-train"), "--steps", "4",
                                             "--checkpoint-dir", str(cpp), "--checkpoint-every", "4"])
    assert code == 0, out[-3000:]
    written = json.loads((cpp / "step-000000003" / "manifest.json").read_text())
    # The same model in plain PyTorch resumes from it: its parameters have nonstop-train's bits.
    code, out = run_native(tmp_path, "py", [sys.executable, str(LLAMA), "--steps", "6", "--resume-from", str(cpp),
                                            "--checkpoint-dir", str(py), "--checkpoint-every", "6"])
    assert code == 0, out[-3000:]
    assert f"starting at step 4, parameter checksum {written['parameter_checksum']}" in out, out[-3000:]
    assert "written by nonstop-train: loaded by name" in out and "optimizer step counts set to 4" in out, out[-3000:]
    # And back: nonstop-train resumes from the script's checkpoint, with its bits.
    back = json.loads((py / "step-000000005" / "manifest.json").read_text())
    assert back["recipe"] == "python"
    code, out = run_native(tmp_path, "back", [str(bin_dir() / "nonstop-train"), "--steps", "8", "--resume", str(py)])
    assert code == 0, out[-3000:]
    assert f"written by python: loaded by name (parameters and AdamW moments), parameter checksum here " \
           f"{back['parameter_checksum']}" in out, out[-3000:]


def as_written_by_nonstop_train(ckpt):
    """Makes a Python checkpoint say nonstop-train wrote it (the tensor names are
    the same): the Python package then loads it by name."""
    for manifest in ckpt.glob("step-*/manifest.json"):
        m = json.loads(manifest.read_text())
        m["writer"] = "nonstop-train"
        manifest.write_text(json.dumps(m))


def test_a_spare_of_a_job_resumed_by_name_takes_its_state_from_its_peers(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = run_job(tmp_path, "first", RUN, ["--steps", "12", "--save-at", "9", "--checkpoint-dir", str(ckpt)],
                    script=SCRIPT)
    assert first.code == 0, first.output
    as_written_by_nonstop_train(ckpt)
    plain = run_job(tmp_path, "plain", RUN, ["--steps", "20", "--resume", str(ckpt)], script=SCRIPT)
    assert plain.code == 0 and "loaded by name" in plain.output, plain.output[-3000:]
    # The spare loads the checkpoint too, then copies the step it takes over from its peers: what it
    # loaded (the AdamW step counts set from the checkpoint's step among it) must not win.
    faulted = run_job(tmp_path, "faulted",
                      ["--nproc", "2", "--spares", "1", "--inject", "kill:rank=1,step=14"] + SLOW_OK,
                      ["--steps", "20", "--resume", str(ckpt)], script=SCRIPT)
    assert faulted.code == 0, faulted.output[-3000:]
    assert final(faulted) == final(plain), "the spare trained on with its peers' state, not the checkpoint's"


def test_a_sharded_save_on_rank_0_alone_is_refused_before_anything_is_written(tmp_path):
    ckpt = tmp_path / "ckpt"
    job = run_job(tmp_path, "misuse", RUN_4, ["--steps", "12", "--save-at", "9", "--checkpoint-dir", str(ckpt),
                                              "--shard-group", "2", "--save-on-rank-0-only"], script=SCRIPT,
                  timeout=120)
    # Whichever side sees it first: rank 0's tagged record against its peer's training, or the peer's
    # gather against rank 0's 16-byte record. The job goes on without the rank that failed.
    ours = "save_checkpoint with a ShardedOptimizer is a collective of the first shard group: call it on every rank"
    transport = "the peers disagree on the sequence of collectives"
    assert ours in job.output or transport in job.output, job.output[-3000:]
    assert not list(ckpt.glob("step-*")), "nothing written"
