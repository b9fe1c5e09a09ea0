"""Prints the test methods of torch's distributed suite (DistributedTest._DistTestBase), one a
line, in the order the runs take them (unittest's: sorted by name)."""

import tempfile
import unittest

from suite_import import import_suite

suite = import_suite(3, tempfile.gettempdir())
for name in unittest.TestLoader().getTestCaseNames(suite.DistributedTest._DistTestBase):
    print(name)
