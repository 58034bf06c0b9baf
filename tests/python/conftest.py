"""Puts tests/python/support on ``sys.path``, so that every test module imports the shared helpers (``_tolerance``,
``_devices``, ``_paths``, ...) by name from whichever layer folder it sits in (docs/design.md, "Tests and benchmarks
layout"). The worker scripts under workers/ insert support/ themselves: they also run outside pytest."""

import os
import sys

_SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")
if _SUPPORT not in sys.path:
    sys.path.insert(0, _SUPPORT)
