"""Shared settings for every test package.

Rank bodies of the multi-process tests sit in the test modules that assert on
them; spawned ranks import those modules as ``tests.<layer>.<module>`` (pytest
puts the repository root on ``sys.path``, and ``spawn`` hands it to children).
"""

from __future__ import annotations

import os

# A peer that dies is reported within this bound (the library default is 60 s).
os.environ.setdefault("MOONEP_EP_TIMEOUT_S", "30")
