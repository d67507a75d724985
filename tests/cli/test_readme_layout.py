"""README.md's "Layout of the code" names every Python file of the package, of ``checks`` and of ``tests/support``,
and no file that is not there (as ``test_envs`` keeps the README's variable table equal to ``envs.py``).

The list is the first fenced block after the section's heading: a line at column 0 whose first word ends in
``/`` is a root (``src/moonep_ep/``, ``checks/``, ``tests/``); an indented line whose first word ends in ``/`` is a
folder inside the nearest less indented folder; any other indented line continues the nearest less indented
folder; every ``NAME.py`` on a line is a file of that folder. ``__init__.py`` and ``__main__.py`` are
not listed.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: The trees the list must cover: every module of the package, of the tooling beside it and of the test support code.
TREES = ("src/moonep_ep", "checks", "tests/support")
UNLISTED = {"__init__.py", "__main__.py"}


def layout_block(readme: str) -> str:
    section = readme.split("## Layout of the code", 1)[1]
    block = re.search(r"```[a-z]*\n(.*?)```", section, re.S)
    assert block, "README.md's Layout of the code lost its fenced file list"
    return block.group(1)


def listed_files(block: str) -> set[str]:
    """Every ``folder/NAME.py`` the block names (paths relative to the repository)."""
    files: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indent, folder) of the open folders, outermost first
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        first, _, rest = line.strip().partition(" ")
        if indent == 0:
            stack = [(0, first.rstrip("/"))] if first.endswith("/") else []
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if not stack:
            continue
        if first.endswith("/"):
            stack.append((indent, f"{stack[-1][1]}/{first.rstrip('/')}"))
        else:
            rest = line
        folder = stack[-1][1]
        files |= {f"{folder}/{name}" for name in re.findall(r"(?<![\w/.])(\w+\.py)\b", rest)}
    return files


def tree_files() -> set[str]:
    return {str(path.relative_to(ROOT)) for tree in TREES for path in (ROOT / tree).rglob("*.py")
            if path.name not in UNLISTED and "__pycache__" not in path.parts}


def test_readme_lists_every_file_of_the_tree_and_no_other():
    listed = {f for f in listed_files(layout_block((ROOT / "README.md").read_text()))
              if f.startswith(TREES)}
    actual = tree_files()
    assert sorted(actual - listed) == [], "in the tree, missing from README.md's Layout of the code"
    assert sorted(listed - actual) == [], "in README.md's Layout of the code, not in the tree"


def test_the_parser_reads_nesting_and_continuations():
    """Control: folders nest by indentation, continuation lines stay in their folder, a root resets."""
    block = ("src/pkg/\n"
             "  a.py · b.py (see c)\n"
             "  sub/   c.py\n"
             "         d.py\n"
             "    deep/  e.py\n"
             "  other/ f.py\n"
             "tests/      x/ y/\n"
             "  support/  g.py\n")
    assert listed_files(block) == {"src/pkg/a.py", "src/pkg/b.py", "src/pkg/sub/c.py", "src/pkg/sub/d.py",
                                   "src/pkg/sub/deep/e.py", "src/pkg/other/f.py", "tests/support/g.py"}
