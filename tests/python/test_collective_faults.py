"""A kill inside each kind of collective besides DDP's gradient sum (docs/python.md,
"torch.distributed over nonstop"): rank 2 of epochs.py dies (SIGKILL) as it enters the
step's all_gather, broadcast, all_to_all, isend/irecv ring, reduce_scatter or a subgroup's
all_reduce, with its peers inside; they get nonstop.Aborted, a spare takes rank 2, the step
runs again, and every rank ends on the fault-free run's parameters, bit for bit."""

import pathlib
import re

import pytest

from conftest import run_job

HERE = pathlib.Path(__file__).resolve().parent
SCRIPT = HERE / "epochs.py"
FLAGS = ["--nproc", "3", "--spares", "1", "--inject", "none"]
DIE_AT = 5


def finals(output):
    return dict(re.findall(r"\[rank (\d)\] final params (\w+)", output))


@pytest.mark.parametrize("kind", ["all_gather", "broadcast", "all_to_all", "send_recv", "reduce_scatter",
                                  "subgroup_all_reduce"])
def test_a_kill_inside_a_collective_reruns_the_step_bitwise(tmp_path, kind):
    args = ["--epochs", "2", "--collective", kind]
    clean = run_job(tmp_path, "clean", FLAGS, args, script=SCRIPT, timeout=300)
    assert clean.code == 0, clean.output
    assert len(finals(clean.output)) == 3 and len(set(finals(clean.output).values())) == 1, clean.output
    marker = tmp_path / "died"
    killed = run_job(tmp_path, "killed", FLAGS,
                     args + ["--die-in-collective", str(DIE_AT), "--die-marker", str(marker)], script=SCRIPT,
                     timeout=300)
    assert killed.code == 0, killed.output
    assert marker.exists(), "rank 2 died in the collective"
    assert len(killed.events("recovery_end")) == 1, killed.output
    assert finals(killed.output) == finals(clean.output), killed.output[-4000:]
