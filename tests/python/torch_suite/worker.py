"""One rank of PyTorch's own distributed test suite
(torch/testing/_internal/distributed/distributed_test.py,
DistributedTest._DistTestBase), run in this process over one process group
made once: Gloo under torch's launcher, or nonstop's backend under
`nonstop run` (tests/python/test_torch_suite.py drives both).

The suite normally spawns a fresh set of processes per test
(MultiProcessTestCase). Here the launcher's workers are the ranks: each
builds the test case with its rank and calls the tests of --tests (one name
a line, the same file for both backends) from --start on, in order, doing
what the suite's per-test setUp and _run do (a fresh TEMP_DIR with its
barrier and test directories, the RNG seeded, the file barrier reset), and
appends one JSON line per test to RESULTS/rank<R>.jsonl: a `start` record
before the test, its outcome after (pass, fail, skip with the reason).

Between two tests the ranks meet at a file barrier (no collective) that
also exchanges their outcomes, then check the group with one all_reduce. A
test that hangs is cut by a watchdog (past --timeout seconds, or --grace
seconds after every other rank has left the test; faulthandler is the
backstop): the rank records the failure and exits, which ends the job. A test
that failed on any rank ends the job too (what it left behind, a send no one
received, must not fail the next test), and so does a group left in error
(the check fails or hangs, the default group was replaced, the ranks'
subgroup counters differ). The driver then starts a fresh job at the next
test.

The suite's backend-name checks all see BACKEND=gloo, over both backends, so
both runs run the same tests; nothing of torch's installed files is changed.
"""

import argparse
import faulthandler
import json
import os
import pathlib
import shutil
import sys
import threading
import time
import traceback
import unittest

HERE = pathlib.Path(__file__).resolve().parent


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=("gloo", "nonstop"), required=True)
    p.add_argument("--results", required=True, help="directory of the rank<R>.jsonl files")
    p.add_argument("--tests", required=True, help="file of test names, one a line, in the order to run")
    p.add_argument("--start", type=int, default=0, help="index in --tests of the first test to run")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds one test may take on one rank")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds a rank may stay in a test after every other rank has left it")
    p.add_argument("--fail-grace", type=float, default=3.0,
                   help="seconds a rank may stay in a test after another rank failed it")
    p.add_argument("--world", type=int, default=3)
    return p.parse_args()


ARGS = parse_args()
sys.argv = sys.argv[:1]  # torch's common_utils parses the command line at import

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

RESULTS = pathlib.Path(ARGS.results)
SYNC = RESULTS / f"sync-{ARGS.start}"  # this job's file barriers (a fresh job starts at a later index)
BARRIER_SLACK = 20.0  # a barrier waits this long past the test timeout for the slowest rank

t_init = time.monotonic()
if ARGS.backend == "nonstop":
    import nonstop.torch

    # A ported script's call (docs/python.md, "Porting a DDP script"): joins the job, makes the
    # default group nonstop's and sets RANK, WORLD_SIZE, ... from here on. (torch's own
    # dist.init_process_group("nonstop") is refused: the backend is registered at the join.)
    nonstop.torch.init_process_group(backend="gloo")
    if os.environ.get("TORCH_SUITE_NONSTOP_REGISTER", "1") != "0":
        # The suite wraps its models in torch's own DDP, which over nonstop needs the job's state
        # registered first (its error says so): a placeholder, the same on every rank, as
        # tests/python/collectives.py registers. TORCH_SUITE_NONSTOP_REGISTER=0 leaves it out.
        torch.manual_seed(0)
        nonstop.torch.init_process_group(torch.nn.Linear(2, 1))
else:
    dist.init_process_group("gloo")
RANK, WORLD = dist.get_rank(), dist.get_world_size()
assert WORLD == ARGS.world, f"the launcher made a world of {WORLD}, the driver asked for {ARGS.world}"
GROUP = dist.distributed_c10d._get_default_group()
GROUP_BACKEND = dist.get_backend()
init_seconds = time.monotonic() - t_init

TMP = RESULTS / "tmp"
(TMP / "import").mkdir(parents=True, exist_ok=True)
from suite_import import import_suite  # noqa: E402

suite = import_suite(WORLD, str(TMP / "import"))
from torch.testing._internal import common_distributed, common_utils  # noqa: E402

# The suite's _run also turns on DDP's ReplicatedTensor path (_set_ddp_with_replicated_tensor):
# left off here, since that path imports torch.distributed._shard.sharded_tensor, whose
# dataclasses Python 3.11 refuses in Debian's torch 1.13 (ValueError: mutable default
# TensorProperties), which would fail every DDP test on both backends alike.
os.environ["TORCH_SHOW_CPP_STACKTRACES"] = "1"  # as MultiProcessTestCase.run_test does

SKIP_CODES = {s.exit_code: s.message for s in common_distributed.TEST_SKIPS.values()}


class Suite(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
    """The suite's own composition (test/distributed/test_distributed_spawn.py), run in place."""


def record(entry):
    entry = {**entry, "time": round(time.time(), 3)}
    with open(RESULTS / f"rank{RANK}.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def abort_job(why):
    """Ends this rank and tells the others to end too: the driver starts a fresh job."""
    record({"event": "broken", "rank": RANK, "why": why})
    try:
        (SYNC / f"abort-{RANK}").write_text(why)
    except OSError:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(3)


def file_barrier(tag, payload, timeout):
    """All ranks meet without a collective; returns every rank's payload."""
    SYNC.mkdir(parents=True, exist_ok=True)
    mine = SYNC / f"{tag}-{RANK}"
    tmp = SYNC / f".{tag}-{RANK}"
    tmp.write_text(json.dumps(payload))
    tmp.rename(mine)
    deadline = time.monotonic() + timeout
    while True:
        files = [SYNC / f"{tag}-{r}" for r in range(WORLD)]
        if all(f.exists() for f in files):
            return [json.loads(f.read_text()) for f in files]
        aborts = sorted(SYNC.glob("abort-*"))
        if aborts:
            abort_job(f"{aborts[0].name}: {aborts[0].read_text()}")
        if time.monotonic() > deadline:
            missing = [r for r, f in enumerate(files) if not f.exists()]
            abort_job(f"barrier {tag}: ranks {missing} did not arrive in {timeout:.0f} s")
        time.sleep(0.01)


def fresh_temp_dir(idx):
    """The suite's initialize_temp_directories, shared by the ranks: one per test."""
    d = TMP / str(idx)
    for sub in ("barrier", "test_dir", "init_dir"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    os.environ["TEMP_DIR"] = str(d)
    return d


def peers_left(idx):
    """The other ranks that have finished test `idx` (their post-test barrier file exists)."""
    return [r for r in range(WORLD) if r != RANK and (SYNC / f"post-{idx}-{r}").exists()]


def peers_failed(idx):
    """The other ranks that have left test `idx` failing it."""
    out = []
    for r in peers_left(idx):
        try:
            if json.loads((SYNC / f"post-{idx}-{r}").read_text())["outcome"] == "fail":
                out.append(r)
        except (OSError, ValueError, KeyError):
            pass
    return out


def barrier_sync(cls, wait_for=None, timeout=10):
    """The suite's file barrier (distributed_test.Barrier.sync), which also gives up at once when
    a rank that has not arrived has already left the test: in the suite's own process model it
    would have exited, here it runs on, and the barrier would wait out its 10 s for nothing."""
    if wait_for is None:
        wait_for = dist.get_world_size()
    cls.barrier_id += 1
    barrier_dir = os.path.join(os.environ["TEMP_DIR"], "barrier")
    with suite._lock():
        with open(os.path.join(barrier_dir, str(os.getpid())), "w") as f:
            f.write(str(cls.barrier_id))

    def arrived():
        with suite._lock():
            count = 0
            for f_name in os.listdir(barrier_dir):
                with open(os.path.join(barrier_dir, f_name)) as f:
                    count += int(f.read()) >= cls.barrier_id
            return count

    start_time = time.time()
    while arrived() != wait_for:
        left = peers_left(CURRENT["idx"])
        if left and arrived() != wait_for:
            raise RuntimeError(f"barrier timeout: ranks {left} left the test without reaching barrier "
                               f"{cls.barrier_id}")
        if time.time() - start_time > timeout:
            raise RuntimeError("barrier timeout")
        time.sleep(0.02)


CURRENT = {"idx": None, "test": None, "t0": 0.0}


def die(why):
    """A rank stuck in a test: records the failure, tells the others, ends the job."""
    record({"outcome": "fail", "error": why, "event": "end", "idx": CURRENT["idx"], "test": CURRENT["test"],
            "rank": RANK, "seconds": round(time.monotonic() - CURRENT["t0"], 3)})
    faulthandler.dump_traceback(all_threads=True)
    abort_job(f"after {CURRENT['test']}: this rank hung ({why})")


def watchdog():
    """Cuts a test that runs past --timeout, that goes on --grace seconds after every other rank
    has left it (a collective no peer will join: no need to wait out the timeout), or
    --fail-grace seconds after a rank failed it (the test has failed: what this rank waits for,
    a send to the failed rank, say, may never come)."""
    since = {}
    while True:
        time.sleep(0.1)
        idx = CURRENT["idx"]
        if idx is None:
            since.clear()
            continue
        now = time.monotonic()
        if now - CURRENT["t0"] > ARGS.timeout:
            die(f"timed out: still in the test after {ARGS.timeout:.0f} s")
        for key, present, grace, why in (
                ("left", len(peers_left(idx)) == WORLD - 1, ARGS.grace, "every other rank had left it"),
                ("failed", bool(peers_failed(idx)), ARGS.fail_grace, "a rank failed it")):
            if not present:
                since.pop(key, None)
                continue
            since.setdefault(key, now)
            if now - since[key] > grace and CURRENT["idx"] == idx:
                die(f"hung: still in the test {grace:.0f} s after {why}")


def run_one(name, idx):
    case = Suite(name)
    case.rank = RANK
    case.file_name = str(TMP / str(idx) / "file_name")
    case.skip_return_code_checks = []
    common_utils.set_rng_seed(common_utils.SEED)  # a fresh process of the suite starts seeded so
    suite.Barrier.barrier_id = 0
    method = getattr(Suite, name)
    if getattr(method, "__unittest_skip__", False):  # sandcastle_skip_if and unittest.skip* marks
        return {"outcome": "skip", "reason": getattr(method, "__unittest_skip_why__", "")}
    try:
        getattr(case, name)()
        return {"outcome": "pass"}
    except unittest.SkipTest as e:
        return {"outcome": "skip", "reason": str(e)}
    except SystemExit as e:  # the suite's skip decorators exit with a code of TEST_SKIPS
        if e.code in SKIP_CODES:
            return {"outcome": "skip", "reason": SKIP_CODES[e.code]}
        return {"outcome": "fail", "error": f"SystemExit({e.code!r})"}
    except BaseException as e:  # noqa: B036 (a test's KeyboardInterrupt is its failure too)
        return {"outcome": "fail", "error": f"{type(e).__name__}: {e}"[:2000],
                "traceback": traceback.format_exc()[-4000:]}


def group_check():
    """Whether the job's group is still whole: the same default group, world and rank, the
    same count of subgroups made on every rank (checked by the caller), one all_reduce right,
    one send and recv along the ring right."""
    if not dist.is_initialized():
        return "the default group was destroyed"
    if ARGS.backend == "gloo" and dist.distributed_c10d._get_default_group() is not GROUP:
        return "the default group was replaced"
    if dist.get_backend() != GROUP_BACKEND:
        return f"the default group's backend is now {dist.get_backend()}"
    if (dist.get_rank(), dist.get_world_size()) != (RANK, WORLD):
        return f"rank {dist.get_rank()} of {dist.get_world_size()}, was {RANK} of {WORLD}"
    t = torch.full((4,), float(RANK + 1))
    faulthandler.dump_traceback_later(ARGS.timeout, exit=True)
    try:
        dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001
        return f"the check's all_reduce raised {type(e).__name__}: {e}"[:500]
    finally:
        faulthandler.cancel_dump_traceback_later()
    want = float(WORLD * (WORLD + 1) // 2)
    if t.tolist() != [want] * 4:
        return f"the check's all_reduce gave {t.tolist()}, not {want}"
    # Point-to-point too (a failed monitored_barrier leaves receives pending): a ring exchange.
    got = torch.zeros(1)
    faulthandler.dump_traceback_later(ARGS.timeout, exit=True)
    try:
        for work in [dist.isend(torch.full((1,), float(RANK)), (RANK + 1) % WORLD),
                     dist.irecv(got, (RANK - 1) % WORLD)]:
            work.wait()
    except Exception as e:  # noqa: BLE001
        return f"the check's send and recv raised {type(e).__name__}: {e}"[:500]
    finally:
        faulthandler.cancel_dump_traceback_later()
    if got.item() != float((RANK - 1) % WORLD):
        return f"the check's recv gave {got.item()}, not {(RANK - 1) % WORLD}"
    return None


def main():
    names = [n.strip() for n in pathlib.Path(ARGS.tests).read_text().splitlines() if n.strip()]
    record({"event": "job", "rank": RANK, "start": ARGS.start, "backend": ARGS.backend,
            "group_backend": GROUP_BACKEND, "init_seconds": round(init_seconds, 3), "pid": os.getpid()})
    suite.Barrier.sync = classmethod(barrier_sync)
    threading.Thread(target=watchdog, daemon=True, name="torch-suite-watchdog").start()
    for idx in range(ARGS.start, len(names)):
        name = names[idx]
        method = getattr(Suite, name)
        if getattr(method, "__unittest_skip__", False):  # marked at import: the same on every rank
            record({"event": "start", "idx": idx, "test": name, "rank": RANK})
            record({"outcome": "skip", "reason": getattr(method, "__unittest_skip_why__", ""), "event": "end",
                    "idx": idx, "test": name, "rank": RANK, "seconds": 0.0})
            continue
        fresh_temp_dir(idx)
        file_barrier(f"pre-{idx}", {}, ARGS.timeout + BARRIER_SLACK)
        env = dict(os.environ)
        record({"event": "start", "idx": idx, "test": name, "rank": RANK})
        t0 = time.monotonic()
        CURRENT.update(idx=idx, test=name, t0=t0)
        # The watchdog cuts a hang (a hang costs this test only); faulthandler is the backstop
        # where the watchdog cannot run (a test that holds the GIL).
        faulthandler.dump_traceback_later(ARGS.timeout + 10, exit=True)
        try:
            result = run_one(name, idx)
        finally:
            faulthandler.cancel_dump_traceback_later()
            CURRENT["idx"] = None
        result.update({"event": "end", "idx": idx, "test": name, "rank": RANK,
                       "seconds": round(time.monotonic() - t0, 3)})
        os.environ.clear()
        os.environ.update(env)
        record(result)
        groups = dist.distributed_c10d._group_count
        peers = file_barrier(f"post-{idx}", {"outcome": result["outcome"], "groups": groups},
                             ARGS.timeout + BARRIER_SLACK)
        if len({p["groups"] for p in peers}) != 1:
            abort_job(f"after {name}: the ranks made different numbers of subgroups "
                      f"{[p['groups'] for p in peers]}")
        failed = [r for r, p in enumerate(peers) if p["outcome"] == "fail"]
        if failed:  # what it left behind (a send no one received, a half-made group) stays with it
            abort_job(f"after {name}: it failed on ranks {failed}, so the next test gets a fresh job")
        why = group_check()
        if why:
            abort_job(f"after {name}: {why}")
        if RANK == 0:
            shutil.rmtree(TMP / str(idx), ignore_errors=True)
    record({"event": "done", "rank": RANK})
    file_barrier("done", {}, ARGS.timeout + BARRIER_SLACK)
    if ARGS.backend == "nonstop":
        nonstop.torch.destroy_process_group()
    else:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
