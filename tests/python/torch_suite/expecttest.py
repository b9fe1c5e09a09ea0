"""A stand-in for the `expecttest` package (not in Debian 12), which torch's
testing helpers (torch/testing/_internal/common_utils.py) import: its TestCase
and ACCEPT flag, without the expect-file machinery the distributed suite never
uses. Put on sys.path only by tests/python/torch_suite/worker.py."""

import unittest

ACCEPT = False


class TestCase(unittest.TestCase):
    longMessage = True

    def assertExpectedInline(self, actual, expect, skip=0):  # noqa: N802 (expecttest's name)
        self.assertEqual(actual, expect)
