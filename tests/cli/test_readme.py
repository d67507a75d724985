"""README.md's commands are executable documentation: every ``moonep-ep ...`` and ``make ...``
line of its fenced blocks runs here, as a new user would type it, in the environment
``make install`` builds (this interpreter's ``bin`` directory first on ``PATH``).

A line exits 0, or, when its comment starts with ``error:``, exits non-zero with one
line that names the fix. Nothing may end in a Python traceback.

Documented per-line overrides (the README line is still what a user runs):

* ``make test`` runs as ``make -n test``: running the suite from inside itself would
  recurse; the dry run proves the target and its recipe resolve. ``make soak`` (30 minutes of
  load) runs as ``make -n soak``; ``tests/vllm/test_soak.py`` runs its 3-minute version.
* Lines that start a vLLM engine or server are run, exactly as written, by the engine
  tests named in ``RUN_ELSEWHERE`` (one engine start serves several checks there);
  this test checks that those tests still contain the command.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

OVERRIDES = {"make test": "make -n test", "make soak": "make -n soak"}

#: README line -> (test file that runs it verbatim, the text that must appear there). The vllm-demo line
#: is what `make demo` runs: the engine test runs `make demo` and checks that make ran that command.
RUN_ELSEWHERE = {
    "make demo": ("tests/vllm/test_engine.py", '["make", "demo"]'),
    "moonep-ep vllm-demo --reload --json": ("tests/vllm/test_engine.py",
                                            'DEMO_COMMAND = "moonep-ep vllm-demo --reload --json"'),
    "make serve": ("tests/vllm/test_serve.py", '"--", "make", "serve"]'),
    "moonep-ep vllm-demo --model tiny-kimi-k2-thinking-int4 --reload --json": (
        "tests/vllm/test_quantized_checkpoints.py",
        'README_COMMAND = "moonep-ep vllm-demo --model tiny-kimi-k2-thinking-int4 --reload --json"'),
    "moonep-ep vllm-demo --model tiny-k3-mxfp4 --runs dp_sharded --reload --max-tokens 4 --json": (
        "tests/vllm/test_k3_engine.py",
        'README_COMMAND = "moonep-ep vllm-demo --model tiny-k3-mxfp4 --runs dp_sharded --reload --max-tokens 4 '
        '--json"'),
    # Needs the vLLM environment to choose the engine's command (run there by the multi-host tests).
    "moonep-ep serve --dp 4 --hosts 10.0.0.1,10.0.0.2 --gloo-ifname eth0 --dry-run": (
        "tests/vllm/test_multihost.py",
        'README_HOSTS_COMMAND = "moonep-ep serve --dp 4 --hosts 10.0.0.1,10.0.0.2 --gloo-ifname eth0 --dry-run"'),
}


#: ``NAME=value`` words in front of a command set its environment, as in a shell.
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def readme_commands() -> list[tuple[str, str]]:
    """``(command, comment)`` of every moonep-ep / make line in README.md's fenced blocks."""
    text = (ROOT / "README.md").read_text()
    out = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S):
        for line in block.splitlines():
            command, _, comment = line.partition("#")
            command = " ".join(command.split())
            program = next((w for w in command.split() if not ENV_ASSIGNMENT.match(w)), "")
            if program in ("moonep-ep", "make"):
                out.append((command, comment.strip()))
    return out


COMMANDS = readme_commands()


def test_the_readme_has_the_commands_this_test_knows():
    names = [c for c, _ in COMMANDS]
    assert names[:3] == ["make demo", "make serve", "make test"]  # the README opens with the set-up commands
    assert sum("moonep-ep " in c for c in names) >= 9
    assert len(set(names)) == len(names)
    for command in RUN_ELSEWHERE:
        assert command in names, f"RUN_ELSEWHERE names {command!r}, which the README no longer shows"


@pytest.mark.parametrize("command, comment", [c for c in COMMANDS if c[0] not in RUN_ELSEWHERE],
                         ids=[c for c, _ in COMMANDS if c not in RUN_ELSEWHERE])
def test_readme_command_runs(command, comment, tmp_path):
    argv = shlex.split(OVERRIDES.get(command, command))
    env = dict(os.environ, PATH=f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("PYTHONPATH", None)  # the installed package, as a user has it
    while ENV_ASSIGNMENT.match(argv[0]):
        name, _, value = argv.pop(0).partition("=")
        env[name] = value
    cwd = tmp_path if argv[0] == "moonep-ep" else ROOT  # make runs in the checkout; outputs land in tmp
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=cwd, env=env)
    output = proc.stdout + proc.stderr
    assert "Traceback (most recent call last)" not in output, output[-4000:]
    if comment.startswith("error:"):
        assert proc.returncode != 0
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Fix:" in lines[0], proc.stderr
        return
    assert proc.returncode == 0, f"{command} exited {proc.returncode}:\n{output[-4000:]}"
    if "--json" in argv:
        import json

        assert isinstance(json.loads(proc.stdout), dict)  # exactly one JSON object on stdout
    if "--plot" in argv:
        png = cwd / argv[argv.index("--plot") + 1]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("command", sorted(RUN_ELSEWHERE))
def test_engine_commands_run_verbatim_in_the_engine_tests(command):
    path, needle = RUN_ELSEWHERE[command]
    assert needle in (ROOT / path).read_text(), f"{path} no longer runs `{command}`"
