"""PyTorch's own store tests against the job's key-value store (nonstop.torch.store()).

tests/python/real/torch_store/test_store.py is torch v1.13.1's
test/distributed/test_store.py, kept as it is (its README says where from).
torch_store/store_worker.py runs, in each worker of a 3-rank `nonstop run`:
its StoreTestBase tests (test_set_get, test_compare_set) and
PythonStoreTest.test_set_get's C++ check (dist._test_python_store), each on
a fresh namespace of the job's store (a PrefixStore over it), every rank in
turn; then checks of the harness's own where the ranks meet through the store
and through the default group's store. Each rank writes its outcomes to
RESULTS/rank<R>.json.

The rest of test_store.py does not apply: its other classes test other stores
(FileStore, HashStore, TCPStore, PrefixStore over those, MyPythonStore) and
torch's rendezvous handlers; TCPStoreTest.test_numkeys_delkeys counts the
one key a TCPStore keeps for itself.

EXCEPTIONS lists the tests that cannot apply to the job's store, each with
its reason: none today.

Run by hand:
  PYTHONPATH=build/python NONSTOP_BIN=build/bin \\
    /usr/bin/python3 -m pytest -q -s -p no:cacheprovider tests/python/test_torch_store.py
"""

import ast
import json
import pathlib

from conftest import bin_dir, run_job

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "torch_store" / "store_worker.py"
TORCH_FILE = HERE / "real" / "torch_store" / "test_store.py"
WORLD = 3
CHECK_TIMEOUT = 30  # seconds one check may take on a rank (store_worker's watchdog)

# PyTorch's tests, as store_worker names them: StoreTestBase's, and PythonStoreTest.test_set_get's check.
TORCH_TESTS = ["StoreTestBase.test_compare_set", "StoreTestBase.test_set_get",
               "PythonStoreTest.test_set_get[dist._test_python_store]"]
# store_worker's own checks (the ranks meet through the store).
HARNESS_CHECKS = ["harness.jobs_store", "harness.blocking_get", "harness.add_from_every_rank",
                  "harness.compare_set_race", "harness.wait_times_out", "harness.check",
                  "harness.delete_seen_by_others", "harness.default_store_is_the_jobs",
                  "harness.meet_through_default_store"]
# Tests that cannot apply to the job's store: name -> reason. None.
EXCEPTIONS = {}

# No spare and no smaller world: a rank that ends ends the job. The workers report no step, so
# nonstop's hang detectors are held off; store_worker's watchdog bounds a check that hangs.
FLAGS = ["--nproc", str(WORLD), "--spares", "0", "--min-world", str(WORLD), "--inject", "none",
         "--busy-timeout-ms", "600000", "--stall-floor-ms", "600000"]


def store_test_base_tests():
    """The test methods of StoreTestBase in the kept file (read, not imported)."""
    tree = ast.parse(TORCH_FILE.read_text())
    base = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StoreTestBase")
    return sorted(f"StoreTestBase.{f.name}" for f in base.body
                  if isinstance(f, ast.FunctionDef) and f.name.startswith("test"))


def first_line(text, limit=300):
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1][:limit] if lines else ""


def test_torch_store_tests_on_the_jobs_store(tmp_path):
    bin_dir()  # NONSTOP_BIN is set
    assert store_test_base_tests() == sorted(t for t in TORCH_TESTS if t.startswith("StoreTestBase.")), \
        "test_store.py's StoreTestBase changed: update TORCH_TESTS"
    results = tmp_path / "results"
    results.mkdir()
    job = run_job(tmp_path, "store", FLAGS, ["--results", str(results), "--timeout", str(CHECK_TIMEOUT)],
                  script=WORKER, timeout=300)
    tail = job.output[-6000:]
    ranks = {}
    for r in range(WORLD):
        path = results / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no results (exit {job.code}):\n{tail}"
        ranks[r] = json.loads(path.read_text())

    problems = []
    for r, res in ranks.items():
        for f in res["failed"]:
            if f["name"] not in EXCEPTIONS:
                problems.append(f"rank {r}: {f['name']} failed: {first_line(f['error'])}")
        for s in res["skipped"]:
            if s["name"] not in EXCEPTIONS:
                problems.append(f"rank {r}: {s['name']} skipped: {s['reason']}")
        told = {f["name"] for f in res["failed"]} | {s["name"] for s in res["skipped"]}
        missing = [n for n in TORCH_TESTS + HARNESS_CHECKS
                   if n not in res["passed"] and n not in EXCEPTIONS and n not in told]
        if missing:
            problems.append(f"rank {r}: did not pass {missing}")
    assert not problems, "\n".join(problems) + f"\n--- the job's output (exit {job.code}):\n{tail}"

    applies = [n for n in TORCH_TESTS if n not in EXCEPTIONS]
    torch_passed = sum(1 for res in ranks.values() for n in res["passed"] if n in TORCH_TESTS)
    assert torch_passed == WORLD * len(applies) == 9 - WORLD * (len(TORCH_TESTS) - len(applies)), ranks
    want = sorted(n for n in TORCH_TESTS + HARNESS_CHECKS if n not in EXCEPTIONS)
    assert all(sorted(res["passed"]) == want for res in ranks.values()), ranks
    assert job.code == 0, tail
