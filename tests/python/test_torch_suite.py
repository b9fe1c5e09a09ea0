"""PyTorch's own backend-neutral distributed test suite
(torch/testing/_internal/distributed/distributed_test.py, class
DistributedTest._DistTestBase, as Debian's python3-torch ships it) at world 3
on CPU tensors: over Gloo under torch's launcher, and over nonstop's process
group under `nonstop run`, the same tests in the same order
(torch_suite/worker.py runs them in each launched worker, its docstring says
how). A test passes when it passes on every rank.

Each job runs the tests from an index on; a test that hangs (the worker's
watchdog), fails on any rank or leaves the group in error ends the job, and
the driver here starts a fresh one at the next test. Tests the suite skips
on a CPU-only Gloo run (CUDA, NCCL, more GPUs, ...) are left out of the
count. The test fails when a test that Gloo passes fails over nonstop, unless
docs/python.md lists it among the tests that cannot apply (KNOWN_GAPS, read from there).

Run by hand (TORCH_SUITE_K: a regular expression on the names; TORCH_SUITE_TIMEOUT: seconds a
test may take, 30; TORCH_SUITE_KEEP: where the results stay, with report.txt and outcomes.json):
  PYTHONPATH=build/python NONSTOP_BIN=build/bin TORCH_SUITE_K=all_reduce TORCH_SUITE_KEEP=/tmp/ts \\
    /usr/bin/python3 -m pytest -q -s -p no:cacheprovider tests/python/test_torch_suite.py
"""

import collections
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Tuple

from conftest import bin_dir, finish_job, start_job

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "torch_suite" / "worker.py"
LIST = HERE / "torch_suite" / "list_tests.py"
WORLD = 3
TEST_TIMEOUT = float(os.environ.get("TORCH_SUITE_TIMEOUT", "30"))  # seconds one test may take on a rank
RUN_BUDGET = 400  # seconds one backend's run may take, all its jobs together (CTest gives 900 to both)

DOCS = HERE.parents[1] / "docs" / "python.md"


def exceptions() -> Dict[str, str]:
    """The tests that cannot apply to nonstop, each with its reason: the list docs/python.md keeps
    ("PyTorch's own suite"), between its two markers, a `- `name`: reason` line each."""
    text = DOCS.read_text()
    begin, end = "<!-- torch-suite-exceptions", "<!-- end torch-suite-exceptions -->"
    assert begin in text and end in text, f"{DOCS} lost its list of the suite's exceptions"
    block = text[text.index(begin):text.index(end)]
    found = dict(re.findall(r"^- `(test_\w+)`: (.+)$", block, re.M))
    assert found, f"{DOCS}: the list of the suite's exceptions is empty"
    return found


KNOWN_GAPS = exceptions()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def suite_tests() -> List[str]:
    out = subprocess.run([sys.executable, str(LIST)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    names = out.stdout.split()
    pattern = os.environ.get("TORCH_SUITE_K")  # a subset by hand: a regular expression on the names
    return [n for n in names if re.search(pattern, n)] if pattern else names


def read_records(results: pathlib.Path) -> List[dict]:
    out = []
    for r in range(WORLD):
        path = results / f"rank{r}.jsonl"
        if path.exists():
            out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def launch(backend: str, results: pathlib.Path, start: int) -> subprocess.Popen:
    args = ["--backend", backend, "--results", str(results), "--tests", str(results / "tests.txt"),
            "--start", str(start), "--timeout", str(TEST_TIMEOUT), "--world", str(WORLD)]
    if backend == "nonstop":
        # No spares and no smaller world: a rank that ends ends the job. nonstop's own hang and
        # stall detectors are held off (the suite never reports a step); the worker's alarm cuts hangs.
        flags = ["--nproc", str(WORLD), "--spares", "0", "--min-world", str(WORLD), "--inject", "none",
                 "--busy-timeout-ms", "3600000", "--stall-floor-ms", "3600000", "--join-timeout-ms", "600000"]
        return start_job(results, f"job-{start}", flags, args, script=WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           "--monitor_interval", "1",  # a rank that ends the job is noticed in 1 s, not 5
           "--redirects", "1", "--tee", "1",  # torch 1.13 under Python 3.11 cannot parse "0"
           str(WORKER), *args]
    log = open(results / f"job-{start}.out", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=results, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_suite(backend: str, results: pathlib.Path, names: List[str]) -> Tuple[Dict[str, dict], float, int]:
    """Runs `names` over `backend`, a fresh job after each one that ends early; returns each
    test's merged outcome, the wall time and the number of jobs."""
    results.mkdir(parents=True, exist_ok=True)
    (results / "tests.txt").write_text("".join(n + "\n" for n in names))
    t0 = time.monotonic()
    start, jobs, stuck = 0, 0, 0
    while start < len(names):
        assert time.monotonic() - t0 < RUN_BUDGET, f"{backend}: past {RUN_BUDGET} s at test {start}"
        before = len(read_records(results))
        proc = launch(backend, results, start)
        jobs += 1
        # A job with no new record for this long is stuck (a barrier waits test timeout + 20 s).
        quiet_limit, last_count, last_change = TEST_TIMEOUT + 60, before, time.monotonic()
        while proc.poll() is None:
            time.sleep(0.25)
            count = len(read_records(results))
            if count != last_count:
                last_count, last_change = count, time.monotonic()
            if time.monotonic() - last_change > quiet_limit or time.monotonic() - t0 > RUN_BUDGET:
                stop(proc)
        if backend == "nonstop":
            finish_job(results, f"job-{start}", proc, timeout=10)
        started = [r["idx"] for r in read_records(results) if r.get("event") == "start" and r["idx"] >= start]
        if not started:
            stuck += 1
            tail = (results / f"job-{start}.out").read_text()[-3000:]
            assert stuck < 2, f"{backend}: two jobs in a row ran no test (from {names[start]}):\n{tail}"
            continue
        stuck = 0
        start = max(started) + 1
    return merge(read_records(results), names), time.monotonic() - t0, jobs


def merge(records: List[dict], names: List[str]) -> Dict[str, dict]:
    """One outcome a test: pass on every rank is a pass; a failure on any rank, or a rank with no
    result (it hung past the alarm or its job ended), is a failure; otherwise a skip."""
    ends = collections.defaultdict(dict)
    started = collections.defaultdict(set)
    broken = {}
    for r in records:
        if r.get("event") == "start":
            started[r["idx"]].add(r["rank"])
        elif r.get("event") == "end":
            ends[r["idx"]][r["rank"]] = r
        elif r.get("event") == "broken":
            m = re.match(r"after (\S+): (.*)", r["why"])
            if m:
                broken.setdefault(m.group(1), m.group(2))
    out = {}
    for idx, name in enumerate(names):
        by_rank = ends.get(idx, {})
        seconds = max((e["seconds"] for e in by_rank.values()), default=None)
        fails = {rank: e["error"] for rank, e in sorted(by_rank.items()) if e["outcome"] == "fail"}
        missing = [r for r in range(WORLD) if r not in by_rank]
        if not started.get(idx):
            entry = {"outcome": "fail", "error": "not run (its job ended before it)"}
        elif fails or missing:
            errors = [f"rank {rank}: {err}" for rank, err in fails.items()]
            errors += [f"rank {r}: no result (hung past the {TEST_TIMEOUT:.0f} s alarm, or its job ended)"
                       for r in missing]
            entry = {"outcome": "fail", "error": "; ".join(errors)}
        elif all(e["outcome"] == "pass" for e in by_rank.values()):
            entry = {"outcome": "pass"}
        else:
            entry = {"outcome": "skip", "reason": next(e["reason"] for e in by_rank.values()
                                                       if e["outcome"] == "skip")}
        entry["seconds"] = seconds
        if name in broken:
            entry["broke_group"] = broken[name]
        out[name] = entry
    return out


def first_line(text: str, limit: int = 160) -> str:
    return text.strip().splitlines()[0][:limit] if text and text.strip() else ""


def report(names, gloo, ours, walls, jobs) -> Tuple[str, List[str]]:
    applies = [n for n in names if gloo[n]["outcome"] != "skip"]
    skipped = collections.Counter(gloo[n]["reason"] for n in names if gloo[n]["outcome"] == "skip")
    gloo_pass = [n for n in applies if gloo[n]["outcome"] == "pass"]
    ours_pass = [n for n in applies if ours[n]["outcome"] == "pass"]
    gaps = [n for n in gloo_pass if ours[n]["outcome"] != "pass"]
    lines = [f"gloo passed {len(gloo_pass)} of {len(applies)}; nonstop passed {len(ours_pass)} of "
             f"{len(applies)} (CPU tests that apply)",
             f"wall time: gloo {walls['gloo']:.0f} s in {jobs['gloo']} jobs; nonstop {walls['nonstop']:.0f} s "
             f"in {jobs['nonstop']} jobs; {len(names) - len(applies)} of {len(names)} tests skipped over gloo "
             f"(do not apply to CPU tensors):"]
    lines += [f"  {count:3d}  {reason}" for reason, count in skipped.most_common()]
    lines.append(f"Gloo passes, nonstop fails ({len(gaps)}):")
    for n in gaps:
        known = " [KNOWN_GAPS]" if n in KNOWN_GAPS else ""
        lines.append(f"  {n}{known}: {first_line(ours[n].get('error') or ours[n].get('reason', ''))}")
    causes = collections.Counter(KNOWN_GAPS[n] for n in gaps if n in KNOWN_GAPS)
    if causes:
        lines.append("  by cause (KNOWN_GAPS):")
        lines += [f"    {count:3d}  {cause}" for cause, count in causes.most_common()]
    lines.append("Gloo fails too (the suite's own, on this machine):")
    lines += [f"  {n}: {first_line(gloo[n]['error'])}" for n in applies if gloo[n]["outcome"] == "fail"]
    stale = [n for n in KNOWN_GAPS if n in ours and ours[n]["outcome"] == "pass"]
    if stale:
        lines.append(f"KNOWN_GAPS that pass now (remove them): {', '.join(stale)}")
    for backend, res in (("gloo", gloo), ("nonstop", ours)):
        slow = sorted((n for n in names if res[n]["seconds"] is not None), key=lambda n: -res[n]["seconds"])
        lines.append(f"slowest over {backend}: " + ", ".join(f"{n} {res[n]['seconds']:.1f} s" for n in slow[:10]))
        broke = [n for n in names if "broke_group" in res[n]]
        if broke:
            lines.append(f"fresh jobs over {backend} after: " + "; ".join(
                f"{n} ({first_line(res[n]['broke_group'], 100)})" for n in broke))
    lines.append("per test (gloo / nonstop):")
    lines += [f"  {i:3d} {n}: {gloo[n]['outcome']} / {ours[n]['outcome']}" for i, n in enumerate(names)]
    return "\n".join(lines), [n for n in gaps if n not in KNOWN_GAPS]


def test_torch_distributed_suite_over_gloo_and_nonstop(tmp_path, capsys):
    bin_dir()  # NONSTOP_BIN is set
    keep = os.environ.get("TORCH_SUITE_KEEP")
    root = pathlib.Path(keep) if keep else tmp_path
    names = suite_tests()
    assert names, "no test of torch's suite selected"
    results, walls, jobs = {}, {}, {}
    for backend in ("gloo", "nonstop"):
        results[backend], walls[backend], jobs[backend] = run_suite(backend, root / backend, names)
    text, unexpected = report(names, results["gloo"], results["nonstop"], walls, jobs)
    gloo_passed = sum(1 for n in names if results["gloo"][n]["outcome"] == "pass")
    (root / "report.txt").write_text(text + "\n")
    (root / "outcomes.json").write_text(json.dumps(results, indent=1, sort_keys=True))
    with capsys.disabled():
        print("\n" + text, flush=True)
    # A harness that ran nothing would pass: Gloo passes 113 of the whole suite on this machine.
    least = 1 if os.environ.get("TORCH_SUITE_K") else 100
    assert gloo_passed >= least, f"Gloo passed {gloo_passed} tests: the harness ran too few to compare"
    assert not unexpected, "tests Gloo passes that fail over nonstop, not in KNOWN_GAPS:\n" + "\n".join(
        f"  {n}: {first_line(results['nonstop'][n].get('error', ''), 300)}" for n in unexpected)
