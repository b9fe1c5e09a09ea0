"""Imports torch's distributed test suite with its gates opened in memory (torch's installed
files are never changed): the suite's backend-name checks see BACKEND=gloo over both backends,
and its require_backends_available({"nccl", "gloo"}) marks, which gate CPU tests (most DDP ones)
on NCCL being compiled in, see NCCL as available: Debian's torch has no NCCL, and the tests that
do need it stay skipped by their own NCCL-only and GPU marks."""

import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
SUITE = "torch.testing._internal.distributed.distributed_test"


def import_suite(world: int, temp_dir: str):
    sys.argv = sys.argv[:1]  # torch's common_utils parses the command line at import
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))  # the expecttest stand-in
    os.environ["BACKEND"] = "gloo"
    os.environ["WORLD_SIZE"] = str(world)
    os.environ["TEMP_DIR"] = temp_dir
    # INIT_METHOD stays the launchers' env:// (unset), so the tests that re-initialise the default
    # group over file:// only are skipped on both backends.
    os.environ.pop("INIT_METHOD", None)

    import torch.distributed as dist
    from torch.testing._internal import common_distributed  # noqa: F401  (imported unpatched)

    real = dist.is_nccl_available

    def is_nccl_available():
        caller = sys._getframe(1)
        if caller.f_code.co_name == "check" and caller.f_globals.get("__name__") == SUITE:
            return True  # require_backends_available's check, at the suite's import
        return real()

    dist.is_nccl_available = is_nccl_available
    try:
        from torch.testing._internal.distributed import distributed_test as suite
    finally:
        dist.is_nccl_available = real
    return suite
