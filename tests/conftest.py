"""Shared fixtures. Multi-process scenarios live in ``mp_scenarios.py`` (importable
by spawned ranks, which inherit this sys.path)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
# Small logical granularity keeps multi-process tests fast while still
# exercising every alignment rule (CUDA's 2 MiB is the default elsewhere).
os.environ.setdefault("MOONEP_EP_TIMEOUT_S", "30")
