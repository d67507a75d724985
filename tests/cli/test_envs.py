"""``moonep_ep.envs``: every variable declared once, parsed strictly, and the README table generated from it."""

from __future__ import annotations

import os
import pathlib
import re

import pytest

from moonep_ep import envs
from moonep_ep.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_readme_table_is_the_generated_one():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- envs:begin -->\n(.*?)\n<!-- envs:end -->", readme, re.S)
    assert block, "README.md lost its <!-- envs:begin/end --> markers"
    assert block.group(1) == envs.markdown_table(), "regenerate with: python -m moonep_ep.envs"


def test_every_variable_read_in_the_code_is_declared():
    """No module reads a MOONEP_EP_* variable that envs.py does not declare (tests set others freely)."""
    used = set()
    for path in (ROOT / "src").rglob("*.py"):
        used |= set(re.findall(r"\bMOONEP_EP_[A-Z0-9_]+", path.read_text()))
    assert used - set(envs.VARIABLES) == set(), used - set(envs.VARIABLES)


def test_only_envs_reads_the_environment_for_settings():
    """Settings are read in one module: no other library module calls os.environ.get on MOONEP_EP_*."""
    offenders = []
    for path in (ROOT / "src" / "moonep_ep").rglob("*.py"):
        if path.name == "envs.py":
            continue
        if re.search(r"(environ\.get|getenv)\(\s*[\"']MOONEP_EP_", path.read_text()):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


@pytest.mark.parametrize("name, raw, want", [
    ("MOONEP_EP_TIMEOUT_S", None, 60.0), ("MOONEP_EP_TIMEOUT_S", " 12.5 ", 12.5),
    ("MOONEP_EP_CPU", "yes", True), ("MOONEP_EP_CPU", "0", False), ("MOONEP_EP_CPU", "", False),
    ("MOONEP_EP_LAYOUT", "Replicated", "replicated"), ("MOONEP_EP_HOST_GRANULARITY", "65536", 65536),
    ("MOONEP_EP_HOST_GRANULARITY", None, None),
])
def test_parse_rules(monkeypatch, name, raw, want):
    if raw is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, raw)
    assert getattr(envs, name) == want


@pytest.mark.parametrize("name, raw, accepted", [
    ("MOONEP_EP_LAYOUT", "sharded2", "sharded | replicated"), ("MOONEP_EP_CPU", "maybe", "1 or 0"),
    ("MOONEP_EP_TIMEOUT_S", "soon", "a number"), ("MOONEP_EP_TIMEOUT_S", "0", ">= 1"),
    ("MOONEP_EP_MC_BIND_RETRIES", "2.5", "an integer"), ("MOONEP_EP_HOST_GRANULARITY", "1024", ">= 4096"),
])
def test_bad_values_name_the_variable_the_value_and_the_fix(monkeypatch, name, raw, accepted):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ConfigError) as info:
        getattr(envs, name)
    msg = str(info.value)
    assert name in msg and repr(raw) in msg and accepted in msg and "Fix:" in msg


def test_unknown_names_are_attribute_errors():
    with pytest.raises(AttributeError):
        envs.MOONEP_EP_NOT_A_SETTING  # noqa: B018
    assert "MOONEP_EP_TIMEOUT_S" in dir(envs) and os.environ is not None
