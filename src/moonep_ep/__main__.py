"""``python -m moonep_ep ...``: the ``moonep-ep`` command without an installed entry point
(``PYTHONPATH=src python3 -m moonep_ep check``, as ``scripts/gpu_check.sh`` runs it)."""

import sys

from .cli.main import main

sys.exit(main())
