"""One rank of PyTorch's own store tests run against the job's key-value store.

Runs inside a worker of `nonstop run` (tests/python/test_torch_store.py
launches it): joins the job with nonstop.torch.init_process_group(backend=...),
takes the job-wide store from nonstop.torch.store(), and runs on it:

- the tests of PyTorch's StoreTestBase (tests/python/real/torch_store/
  test_store.py, torch v1.13.1's test/distributed/test_store.py, imported as
  it is: test_set_get and test_compare_set), through a subclass whose
  _create_store hands each test a fresh namespace of the job's store, a
  torch.distributed.PrefixStore over it;
- PythonStoreTest.test_set_get's body, torch's C++ check
  torch.distributed._test_python_store, on a fresh namespace too (it calls a
  store written in Python through torch's C++ trampoline, as every torch
  component does);
- a few checks of this harness's own (named harness.*): the ranks meet through
  the store (a blocking get, add and compare_set from every rank at once, a
  wait that must time out, check), and through the default group's store.

A PrefixStore does not narrow num_keys(): torch's PrefixStore.getNumKeys
returns the underlying store's count of every key. StoreTestBase asserts an
exact count (its num_keys_total, "5" for a fresh store, "6" for TCPStore,
which holds a key of its own): the subclass here says 5 plus the keys the
job's store already held when the test made its store. So the ranks take
turns at torch's tests (rank 0, then 1, then 2: each waits in the store for
its turn), no other rank writing meanwhile; then they all meet.

Each rank prints one line `TORCH_STORE_SUMMARY {json}` (rank, world, mode,
passed, failed [{name, error}], skipped [{name, reason}], seconds), writes
the same JSON to RESULTS/rank<R>.json with --results, and exits 1 when a check
failed (3 when one hung past --timeout: a watchdog ends the rank).

Without nonstop, to check the harness itself on a store known to be good:
  /usr/bin/python3 tests/python/torch_store/store_worker.py --hashstore --world 3
runs the same checks with threads as ranks over one torch.distributed.HashStore
(the default-group checks are skipped there).
"""

import argparse
import contextlib
import datetime
import faulthandler
import json
import os
import pathlib
import sys
import threading
import time
import traceback
import unittest
import uuid

HERE = pathlib.Path(__file__).resolve().parent
TORCH_TESTS = HERE.parent / "real" / "torch_store"  # test_store.py, unchanged
STAND_IN = HERE.parent / "torch_suite"  # expecttest.py: torch's common_utils imports it, Debian 12 lacks it

ROOT = "torch_store_test"  # the namespace of this harness in the job's store


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", help="directory to write rank<R>.json into")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds one check may take on one rank before the watchdog ends the rank")
    p.add_argument("--hashstore", action="store_true",
                   help="no job: threads as ranks over one torch.distributed.HashStore (checks the harness)")
    p.add_argument("--world", type=int, default=3, help="ranks (threads) of --hashstore")
    return p.parse_args()


ARGS = parse_args()
sys.argv = sys.argv[:1]  # torch's common_utils parses the command line when imported
for path in (STAND_IN, TORCH_TESTS):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch.distributed as dist  # noqa: E402

import test_store  # noqa: E402  (PyTorch's file, as it is)


def seconds(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)


class Outcomes:
    """One rank's results; the watchdog ends the process when one of its checks hangs."""

    every = []  # every rank's of this process (--hashstore runs them all in one)
    lock = threading.Lock()

    def __init__(self, rank: int, world: int, mode: str):
        self.rank, self.world, self.mode = rank, world, mode
        self.passed, self.failed, self.skipped = [], [], []
        self.t0 = time.monotonic()
        self.current, self.deadline = None, None
        with Outcomes.lock:
            Outcomes.every.append(self)

    def summary(self) -> dict:
        return {"rank": self.rank, "world": self.world, "mode": self.mode, "passed": self.passed,
                "failed": self.failed, "skipped": self.skipped, "seconds": round(time.monotonic() - self.t0, 3)}

    @contextlib.contextmanager
    def timed(self, name: str, timeout: float):
        with Outcomes.lock:
            self.current, self.deadline = name, time.monotonic() + timeout
        try:
            yield
        finally:
            with Outcomes.lock:
                self.current, self.deadline = None, None

    def run(self, name: str, fn, timeout: float, quiet: bool = False) -> bool:
        """Runs `fn` as the check `name`: it fails by raising, is skipped by unittest.SkipTest.
        A quiet one (the harness's own steps: turns, meetings) is listed only when it fails."""
        with self.timed(name, timeout):
            try:
                fn()
            except unittest.SkipTest as e:
                self.skipped.append({"name": name, "reason": str(e)})
            except Exception:  # noqa: BLE001 (any failure is the check's outcome)
                self.failed.append({"name": name, "error": traceback.format_exc()})
                return False
            else:
                if not quiet:
                    self.passed.append(name)
        return True

    def run_test(self, name: str, test: unittest.TestCase, timeout: float) -> None:
        """Runs one unittest test (torch's) as the check `name`."""
        result = unittest.TestResult()
        with self.timed(name, timeout):
            test.run(result)
        for _, err in result.failures + result.errors + result.unexpectedSuccesses:
            self.failed.append({"name": name, "error": err})
        for _, reason in result.skipped:
            self.skipped.append({"name": name, "reason": reason})
        if result.testsRun == 1 and result.wasSuccessful() and not result.skipped:
            self.passed.append(name)
        elif result.testsRun != 1:
            self.failed.append({"name": name, "error": f"unittest ran {result.testsRun} tests, not 1"})

    def report(self) -> None:
        text = json.dumps(self.summary(), sort_keys=True)
        if ARGS.results:
            path = pathlib.Path(ARGS.results) / f"rank{self.rank}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text + "\n")
            tmp.rename(path)
        print(f"TORCH_STORE_SUMMARY {text}", flush=True)


def start_watchdog() -> None:
    """Ends the process (exit 3) when a check runs past its time, after every rank's report."""

    def watch():
        while True:
            time.sleep(0.2)
            with Outcomes.lock:
                late = [o for o in Outcomes.every if o.deadline is not None and time.monotonic() > o.deadline]
                for o in late:
                    o.failed.append({"name": o.current, "error": "hung past its time (the watchdog ended the rank)"})
                    o.deadline = None
            if late:
                faulthandler.dump_traceback(all_threads=True)
                for o in Outcomes.every:
                    o.report()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(3)

    threading.Thread(target=watch, name="store-watchdog", daemon=True).start()


def torch_store_case(make_store):
    """PyTorch's StoreTestBase over `make_store(test name)`: a fresh namespace of the job's store."""

    class JobStoreTest(test_store.TestCase, test_store.StoreTestBase):
        def _create_store(self):
            store = make_store(self._testMethodName)
            # Every key of the job's store counts: a PrefixStore's num_keys is its whole store's.
            self._keys_before = store.num_keys()
            return store

        @property
        def num_keys_total(self):
            return test_store.StoreTestBase.num_keys_total.fget(self) + self._keys_before

    return JobStoreTest


def run_torch_tests(outcomes: Outcomes, space) -> None:
    """The StoreTestBase tests and torch's C++ store check, each on a fresh namespace under `space`."""
    case = torch_store_case(lambda test: dist.PrefixStore(test, space))
    for name in unittest.TestLoader().getTestCaseNames(case):
        outcomes.run_test(f"StoreTestBase.{name}", case(name), ARGS.timeout)
    outcomes.run(PYTHON_STORE_TEST, lambda: dist._test_python_store(dist.PrefixStore("python_store", space)),
                 ARGS.timeout)


# PythonStoreTest.test_set_get runs torch's C++ check on test_store.py's own MyPythonStore; here on
# the job's store.
PYTHON_STORE_TEST = "PythonStoreTest.test_set_get[dist._test_python_store]"


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def meet(outcomes: Outcomes, job, run: str, rank: int, world: int, default_store) -> None:
    """The ranks meet through the store (harness.* checks: this harness's own, not torch's)."""
    space = dist.PrefixStore(f"{run}/meet", dist.PrefixStore(ROOT, job))
    wait_s = ARGS.timeout

    def arrive(tag: str) -> None:
        space.set(f"{tag}/{rank}", str(rank))
        space.wait([f"{tag}/{r}" for r in range(world)], seconds(wait_s))

    def blocking_get():
        # Rank 0 sets the key late: the others wait for it, then read it.
        if rank == 0:
            time.sleep(0.5)
            space.set("hello", b"from rank 0")
        else:
            space.wait(["hello"], seconds(wait_s))
        expect(space.get("hello") == b"from rank 0", f"get('hello') = {space.get('hello')!r}")

    def add_from_every_rank():
        for _ in range(10):
            space.add("count", rank + 1)
        arrive("added")
        total, want = int(space.get("count")), 10 * world * (world + 1) // 2
        expect(total == want, f"count = {total}, every rank's adds should sum to {want}")
        expect(space.add("count", 0) == total, "add(key, 0) should return the value")

    def compare_set_race():
        mine = f"rank{rank}".encode()
        seen = space.compare_set("owner", "", mine)  # the rank that finds the key absent sets it
        space.set(f"seen/{rank}", seen)
        arrive("raced")
        every = [space.get(f"seen/{r}") for r in range(world)]
        owner = space.get("owner")
        expect(all(s == owner for s in every), f"compare_set returned {every}, the key holds {owner!r}")
        expect(owner in [f"rank{r}".encode() for r in range(world)], f"owner = {owner!r}")

    def wait_times_out():
        t = time.monotonic()
        try:
            space.wait([f"never/{rank}"], seconds(0.5))
        except RuntimeError as e:
            took = time.monotonic() - t
            expect(0.4 <= took < 10, f"wait(0.5 s) on a missing key raised after {took:.2f} s")
            expect("imeout" in str(e), f"the error should say it timed out, as torch's stores do: {e}")
            return
        raise AssertionError("wait on a key no one sets returned instead of raising RuntimeError")

    def check():
        if not hasattr(job, "check"):
            raise unittest.SkipTest("torch 1.13's Store has no Python check(), and this store defines none")
        key = f"{ROOT}/{run}/meet/hello"  # PrefixStore joins its prefix and the key with '/'
        expect(job.check([key]) is True, f"check([{key!r}]) should be True")
        expect(job.check([key, f"{key}-absent"]) is False, "check with a missing key should be False")

    def delete_seen_by_others():
        if rank == 0:
            space.set("doomed", "x")
        arrive("doomed-set")
        expect(space.get("doomed") == b"x", "every rank should see the key rank 0 set")
        arrive("doomed-read")
        if rank == 0:
            expect(space.delete_key("doomed") is True, "delete_key of a present key should return True")
            expect(space.delete_key("doomed") is False, "delete_key of a deleted key should return False")
        arrive("doomed-deleted")
        t = time.monotonic()
        try:
            space.wait(["doomed"], seconds(0.5))
        except RuntimeError:
            expect(time.monotonic() - t < 10, "the wait should time out at 0.5 s")
            return
        raise AssertionError("a key rank 0 deleted was still there for this rank")

    def default_store_is_the_jobs():
        if default_store is None:
            raise unittest.SkipTest("no default group (--hashstore)")
        chain, store = [], default_store
        while store is not None:
            chain.append(type(store).__name__)
            if store is job:
                break
            store = getattr(store, "underlying_store", None)
        expect(store is job, f"the default group's store ({' -> '.join(chain)}) does not lead to "
                             f"nonstop.torch.store()")

    def meet_through_default_store():
        if default_store is None:
            raise unittest.SkipTest("no default group (--hashstore)")
        key = f"{ROOT}/{run}/default"
        if rank == 0:
            default_store.set(key, b"through the default store")
        expect(default_store.get(key) == b"through the default store", "the value rank 0 set")

    for name, fn in (("harness.blocking_get", blocking_get), ("harness.add_from_every_rank", add_from_every_rank),
                     ("harness.compare_set_race", compare_set_race), ("harness.wait_times_out", wait_times_out),
                     ("harness.check", check), ("harness.delete_seen_by_others", delete_seen_by_others),
                     ("harness.default_store_is_the_jobs", default_store_is_the_jobs),
                     ("harness.meet_through_default_store", meet_through_default_store)):
        outcomes.run(name, fn, wait_s + 10)
        # A check that failed on one rank must not leave the others behind in the next one.
        if not outcomes.run(f"harness.sync_after.{name}", lambda: arrive(f"after/{name}"), wait_s + 10,
                            quiet=True):
            return


def run_rank(outcomes: Outcomes, job, default_store) -> None:
    """Torch's tests on each rank in turn, then the ranks meet."""
    rank, world = outcomes.rank, outcomes.world
    root = dist.PrefixStore(ROOT, job)
    found = {}

    def agree_on_run():
        # One name for this run's keys: rank 0 makes it, the others read it (a blocking get).
        if rank == 0:
            found["run"] = uuid.uuid4().hex
            root.set("run", found["run"])
        else:
            found["run"] = root.get("run").decode()

    turn_wait = ARGS.timeout * (world + 1)  # the ranks before this one run their turns meanwhile
    if not outcomes.run("harness.agree_on_run", agree_on_run, ARGS.timeout, quiet=True):
        return
    base = dist.PrefixStore(found["run"], root)
    if outcomes.run("harness.take_turn", lambda: base.wait([f"turn/{rank}"], seconds(turn_wait)) if rank else None,
                    turn_wait + 10, quiet=True):
        try:
            run_torch_tests(outcomes, dist.PrefixStore(f"rank{rank}", base))
        finally:
            outcomes.run("harness.hand_on_turn", lambda: base.set(f"turn/{rank + 1}", "go"), ARGS.timeout, quiet=True)
    if outcomes.run("harness.turns_done", lambda: base.wait([f"turn/{world}"], seconds(turn_wait)), turn_wait + 10,
                    quiet=True):
        meet(outcomes, job, found["run"], rank, world, default_store)


def main_nonstop() -> int:
    import nonstop.torch

    nonstop.torch.init_process_group(backend="nonstop")
    rank, world = dist.get_rank(), dist.get_world_size()
    found = {}

    def jobs_store():
        found["job"] = nonstop.torch.store()
        expect(isinstance(found["job"], dist.Store), f"nonstop.torch.store() is a {type(found['job'])}")
        expect(nonstop.torch.store() is found["job"], "nonstop.torch.store() should return the same object each call")

    outcomes = Outcomes(rank, world, "nonstop")
    if outcomes.run("harness.jobs_store", jobs_store, ARGS.timeout):
        run_rank(outcomes, found["job"], dist.distributed_c10d._get_default_store())
    outcomes.report()
    nonstop.torch.destroy_process_group()
    return 1 if outcomes.failed else 0


def main_hashstore() -> int:
    job = dist.HashStore()
    found = [Outcomes(rank, ARGS.world, "hashstore") for rank in range(ARGS.world)]
    threads = [threading.Thread(target=run_rank, args=(o, job, None)) for o in found]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for outcomes in found:
        outcomes.report()
    return 1 if any(o.failed for o in found) else 0


if __name__ == "__main__":
    faulthandler.enable()
    start_watchdog()
    if ARGS.hashstore:
        sys.exit(main_hashstore())
    sys.exit(main_nonstop())
