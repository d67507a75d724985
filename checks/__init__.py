"""Test and release tooling that lives beside the package, not in it: what ``make`` and ``scripts/`` run from the
repository root with ``python -m checks...`` (``soak``: the server under hours of load, ``make soak``; ``gpu``:
the correctness checks ``scripts/gpu_check.sh`` runs on a machine with one GPU). It imports ``moonep_ep``; no
``moonep_ep`` module imports it (``tests/cli/test_layering.py``).
"""
