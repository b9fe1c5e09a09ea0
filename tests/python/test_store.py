"""The job's store (docs/store.md) kept through a controller takeover and a worker's kill: a DDP
job (store_job.py) whose ranks write to the store every step, wait in it for a key while the
controller is killed and another takes the job over from the journal, count in it once each
around that takeover, and lose a rank to a kill while the others wait in the store for it (their
wait ends with nonstop.Aborted and runs again with the step), whose spare reads what its
predecessor wrote.

Run by hand:
  PYTHONPATH=build/python NONSTOP_BIN=build/bin \\
    /usr/bin/python3 -m pytest -q -s -p no:cacheprovider tests/python/test_store.py
"""

import pathlib
import re

from conftest import run_job

HERE = pathlib.Path(__file__).resolve().parent


def test_the_store_is_kept_through_a_takeover_and_a_kill(tmp_path):
    job = run_job(tmp_path, "store", ["--nproc", "3", "--spares", "1", "--inject", "kill:rank=1,step=7"],
                  ["--job-file", str(tmp_path / "job.json"), "--takeover-step", "3"],
                  script=HERE / "store_job.py", timeout=240)
    tail = job.output[-5000:]
    assert job.code == 0, tail
    assert "killed the controller" in job.output, tail
    assert "store WRONG" not in job.output, tail
    assert len(job.events("takeover")) == 1, "the controller was taken over once\n" + tail
    assert len(job.events("fault")) == 1, "the injected kill, and no other fault\n" + tail
    verdicts = dict(re.findall(r"\[rank (\d)\] store (ok \d+|WRONG: .*)", job.output))
    assert sorted(verdicts) == ["0", "1", "2"], tail
    assert all(v.startswith("ok") for v in verdicts.values()), verdicts
    # The keys of 10 steps of 3 ranks, big, late, adds, adds_counted, adds_done, wait/7,
    # waiting/7/0 and /2, done/0..2.
    assert {v for v in verdicts.values()} == {f"ok {10 * 3 + 6 + 2 + 3}"}, verdicts
    # Ranks 0 and 2 waited for rank 1's key when it was killed: the wait ended with Aborted and
    # ran again with the step (a wait left hanging would have cost them the abort's deadline).
    assert dict(re.findall(r"\[rank (\d)\] waits at step 7: (\d+)", job.output)) == {"0": "2", "1": "0", "2": "2"}, tail
    # The writes are in the journal, once each: the takeover replayed them.
    adds = [r for r in job.events("store") if r["key"] == "adds"]
    assert len(adds) == 3, adds
