"""Durable checkpoints from Python: rank 0 saves one at a step boundary
(asynchronously, in the format nonstop-train writes: safetensors and a
manifest), a new job resumes from it, and ends bitwise where the
uninterrupted job ends, its Python counter counted once per step."""

import json
import pathlib
import re
import struct

from conftest import run_job

HERE = pathlib.Path(__file__).resolve().parent
SCRIPT = HERE / "checkpoint_job.py"
FINAL = re.compile(r"final checksum (\w+) seen (\d+)")
RUN = ["--nproc", "2", "--spares", "0", "--inject", "none"]


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
    raw = (saved / "state.safetensors").read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    assert {"params", "extra.int"} <= set(header), sorted(header)
    resumed = run_job(tmp_path, "resumed", RUN, ["--steps", "20", "--resume", str(ckpt)], script=SCRIPT)
    assert resumed.code == 0, resumed.output
    assert "first step 10" in resumed.output, resumed.output[-3000:]
    assert final(resumed) == final(whole) == (final(whole)[0], "20"), "bitwise, and every step counted once"
    missing = run_job(tmp_path, "afresh", RUN, ["--steps", "3", "--resume", str(tmp_path / "none")], script=SCRIPT)
    assert missing.code == 0 and "first step 0" in missing.output, missing.output[-3000:]
