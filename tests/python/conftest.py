"""Shared helpers of the Python tests: the build's binaries (NONSTOP_BIN, set
by CTest) and running a job under `nonstop run`."""

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import time
from typing import Dict, List, Optional

import pytest

HERE = pathlib.Path(__file__).resolve().parent
TRAINER = HERE / "trainer.py"
FINAL = re.compile(r"final rank=(\d+) worker=(\d+) pid=(\d+) generation=(\d+) world=(\d+) params=(\w+) "
                   r"state=(\w+) tokens=(\d+) setups=(\d+)")
SETUP = re.compile(r"setup worker=(\d+) pid=(\d+)")


def bin_dir() -> pathlib.Path:
    path = os.environ.get("NONSTOP_BIN")
    if not path:
        pytest.fail("NONSTOP_BIN is not set: run these tests through ctest (tests/CMakeLists.txt sets it)")
    return pathlib.Path(path).resolve()


def journal_events(journal: pathlib.Path, kind: str) -> List[dict]:
    """The records of one kind in a job's journal (none yet if it does not exist)."""
    out = []
    if journal.exists():
        for line in journal.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                if record.get("event") == kind:
                    out.append(record)
    return out


@dataclasses.dataclass
class Job:
    code: int
    output: str
    journal: pathlib.Path

    def events(self, kind: str) -> List[dict]:
        return journal_events(self.journal, kind)

    def finals(self) -> List[Dict[str, str]]:
        keys = ("rank", "worker", "pid", "generation", "world", "params", "state", "tokens", "setups")
        return [dict(zip(keys, m.groups())) for m in FINAL.finditer(self.output)]

    def setups(self) -> List[Dict[str, str]]:
        return [{"worker": m.group(1), "pid": m.group(2)} for m in SETUP.finditer(self.output)]

    def losses(self) -> Dict[int, float]:
        return {e["step"]: e["loss"] for e in self.events("step")}


def plan_worlds(journal: pathlib.Path) -> List[int]:
    """The world of each plan in a job's journal, in order."""
    return [len(p["members"]) for p in journal_events(journal, "plan")]


def shrink_then_grow(tmp: pathlib.Path, proc: subprocess.Popen, journal: pathlib.Path, shrunk: int,
                     grown: int) -> None:
    """Waits (up to 120 s) for the job's world to be `shrunk` after a kill, then asks
    `nonstop scale` for `grown` workers."""
    deadline = time.monotonic() + 120
    while plan_worlds(journal)[-1:] != [shrunk]:
        assert proc.poll() is None and time.monotonic() < deadline, f"the shrink to {shrunk} on the kill"
        time.sleep(0.05)
    grow = subprocess.run([str(bin_dir() / "nonstop"), "scale", "--job", str(tmp / "job.json"),
                           "--world-size", str(grown)], capture_output=True, text=True, timeout=30)
    assert grow.returncode == 0, grow.stdout + grow.stderr


def start_job(tmp: pathlib.Path, name: str, run_flags: List[str], trainer_args: List[str],
              script: Optional[pathlib.Path] = None, env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    journal = tmp / f"{name}.jsonl"
    cmd = [str(bin_dir() / "nonstop"), "run", "--journal", str(journal), *run_flags, "--",
           sys.executable, str(script or TRAINER), *trainer_args]
    log = open(tmp / f"{name}.out", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True,
                            env={**os.environ, **(env or {})})


def finish_job(tmp: pathlib.Path, name: str, proc: subprocess.Popen, timeout: float = 240) -> Job:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        code = -9
    return Job(code, (tmp / f"{name}.out").read_text(), tmp / f"{name}.jsonl")


def run_job(tmp: pathlib.Path, name: str, run_flags: List[str], trainer_args: List[str] = (),
            script: Optional[pathlib.Path] = None, timeout: float = 240,
            env: Optional[Dict[str, str]] = None) -> Job:
    return finish_job(tmp, name, start_job(tmp, name, run_flags, list(trainer_args), script, env), timeout)


STAGED = re.compile(r"staged pid=(\d+) twins=(\S*)")


def staged_env(tmp: pathlib.Path) -> Dict[str, str]:
    """The environment of a job whose Python workers run every collective on a
    host twin of its tensor, as they do for a GPU tensor (nonstop/_device.py),
    with CPU tensors: a sitecustomize sets the switch in each worker and prints
    `staged pid=P twins=SITE:N,...` (the twins made at each call site) as the
    worker exits."""
    site = tmp / "staged-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import atexit, os\n"
        "import nonstop._device as d\n"
        "d._stage_cpu_tensors = True\n"
        "atexit.register(lambda: print(f'staged pid={os.getpid()} twins='\n"
        "                              + ','.join(f'{k}:{v}' for k, v in sorted(d.twins.items())), flush=True))\n")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)}


def staged_twins(job: "Job") -> Dict[str, Dict[str, int]]:
    """Twins made per worker pid and call site, from the `staged` lines of a staged_env job."""
    return {pid: {site: int(n) for site, n in (item.split(":") for item in sites.split(",") if item)}
            for pid, sites in STAGED.findall(job.output)}
