"""Run the moonep-ep command in a subprocess, as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def moonep_ep(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moonep_ep.cli.main", *args],
                          capture_output=True, text=True, timeout=timeout)


def moonep_ep_json(*args: str, timeout: float = 300) -> dict[str, Any]:
    """Run with ``--json``; assert exit 0 and exactly one JSON object on stdout."""
    proc = moonep_ep(*args, "--json", timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)  # exactly one JSON document: progress goes to stderr
