"""No import circles among moonep_ep modules, the tooling beside the package (``checks``) and the test support code
(``tests/support``), read statically (every import: module level, inside functions, under ``TYPE_CHECKING``), so
a circle that only closes at run time is caught too.

The same graph shows that the package ships nothing only tests or tooling use (every module is reached from what
a user of the library runs: a command, the vLLM plugin, what another program loads by name), and that the
package imports neither ``checks`` nor ``tests``.

One circle is allowed and named: ``memory.cuda`` imports ``cuda_probe`` and ``multimem`` at run time,
and those two name ``cuda``'s classes in annotations only (under ``TYPE_CHECKING``, never executed).
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
SRC = ROOT / "src"

#: The one allowed circle and why: each of its edges back to ``memory.cuda`` is under TYPE_CHECKING.
ALLOWED = {frozenset({"moonep_ep.memory.cuda", "moonep_ep.memory.cuda_probe", "moonep_ep.memory.multimem"})}


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    out = {}
    for base, folder in ((SRC, SRC / "moonep_ep"), (ROOT, ROOT / "checks"), (ROOT, ROOT / "tests" / "support")):
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            out[".".join(parts)] = (path, is_package)
    return out


@functools.lru_cache(maxsize=None)
def _tree(path: pathlib.Path) -> ast.Module:
    """One parse of a source file per test session (every test here reads the same files)."""
    return ast.parse(path.read_text())


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Line numbers of the bodies of ``if TYPE_CHECKING:`` blocks."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def import_graph() -> tuple[dict[str, set[str]], set[tuple[str, str]]]:
    """``module -> modules it imports`` (of the graph's own modules only) and the edges that exist only under
    TYPE_CHECKING."""
    modules = _modules()
    edges: dict[str, set[str]] = {}
    typing_only: set[tuple[str, str]] = set()
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rsplit(".", 1)[0]
        tree = _tree(path)
        hidden = _type_checking_lines(tree)
        runtime: set[str] = set()
        typing: set[str] = set()
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[:len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.append(full if full in modules else base)
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                if target in modules and target != name:
                    (typing if node.lineno in hidden else runtime).add(target)
        edges[name] = runtime | typing
        typing_only |= {(name, t) for t in typing - runtime}
    return edges, typing_only


def circles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_no_import_circle_but_the_named_one():
    edges, _ = import_graph()
    unexpected = [sorted(c) for c in circles(edges) if c not in ALLOWED]
    assert unexpected == [], f"import circles: {unexpected}"
    assert "tests.support.vllm_moe_model" in edges["tests.support.kernel_check"]  # the graph sees tests/support
    assert "checks.soak.sampler" in edges["checks.soak.run"]  # ... and checks
    assert "moonep_ep.memory.accounting" in edges["checks.soak.sampler"]


def test_the_allowed_circle_closes_only_under_type_checking():
    """With the TYPE_CHECKING-only edges removed, no circle is left at all."""
    edges, typing_only = import_graph()
    runtime = {name: {t for t in targets if (name, t) not in typing_only} for name, targets in edges.items()}
    assert circles(runtime) == []
    assert {("moonep_ep.memory.cuda_probe", "moonep_ep.memory.cuda"),
            ("moonep_ep.memory.multimem", "moonep_ep.memory.cuda")} <= typing_only


def test_the_check_finds_a_circle():
    """Positive control: a two-module circle and a three-module one are found; a chain is not."""
    assert circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [frozenset({"a", "b"})]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [frozenset({"a", "b", "c"})]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_plugin_layer_is_one_way():
    """plugin -> manager -> observe.deferred -> observe.stats, and prepare_finalize.padding -> observe.stats; stats
    imports none of the plugin's other modules."""
    edges, _ = import_graph()
    vllm = "moonep_ep.vllm."
    assert vllm + "manager" in edges[vllm + "plugin"]
    assert vllm + "observe.deferred" in edges[vllm + "manager"]
    assert vllm + "observe.stats" in edges[vllm + "observe.deferred"]
    assert vllm + "observe.stats" in edges[vllm + "prepare_finalize.padding"]
    assert not {t for t in edges[vllm + "observe.stats"] if t.startswith(vllm)}
    assert vllm + "plugin" not in edges[vllm + "manager"]


def test_no_library_file_is_over_600_lines():
    """The house rule: no library file over 600 lines (split by role instead). Tests are exempt."""
    long = {str(path.relative_to(SRC)): n for path in (SRC / "moonep_ep").rglob("*.py")
            if (n := len(path.read_text().splitlines())) > 600}
    assert long == {}, long


#: Modules another program loads by name rather than by an import our code writes: Triton loads the
#: backend package ``testing/triton_interpreter`` registers as an entry point, then that package's
#: ``compiler.py`` and ``driver.py`` (``triton/backends/__init__.py``: ``_load_module(name,
#: os.path.join(root, "compiler.py"))``). A user's engine needs them: the engine's Triton experts run under the
#: interpreter there (``serve`` and ``vllm-demo`` import ``triton_interpreter``).
LOADED_BY_NAME = {"moonep_ep.testing.triton_interpreter": {"moonep_ep.testing.triton_cpu",
                                                            "moonep_ep.testing.triton_cpu.compiler",
                                                            "moonep_ep.testing.triton_cpu.driver"}}


def _named_modules(path: pathlib.Path, modules: set[str]) -> set[str]:
    """Modules a file names whole in a string literal (``[sys.executable, "-m", "moonep_ep.x"]``, importlib)."""
    return {node.value for node in ast.walk(_tree(path))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules}


def unreached(edges: dict[str, set[str]], roots: set[str], named: dict[str, set[str]]) -> set[str]:
    """Package modules no walk from ``roots`` reaches, over imports, names in strings and parent packages."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in edges:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # importing a.b.c imports a and a.b
        todo += list(edges[name]) + list(named.get(name, ()))
    return {m for m in edges if m.startswith("moonep_ep")} - seen


def user_roots() -> set[str]:
    """What a user of the library runs: the ``moonep-ep`` command (and ``python -m moonep_ep``) and each of its
    subcommands, the vLLM plugin's entry point, and the modules another program loads by name. Not the Makefile
    or ``scripts/``: what they run beyond these is test and release tooling (``checks``, ``tests/support``)."""
    from moonep_ep.cli.main import SUBCOMMANDS

    return ({"moonep_ep.cli.main", "moonep_ep.__main__"} | set(vllm_plugin_modules().values())
            | {f"moonep_ep.cli.{m}" for m in SUBCOMMANDS.values()} | set(LOADED_BY_NAME))


def vllm_plugin_modules() -> dict[str, str]:
    """``pyproject.toml``'s ``vllm.general_plugins`` entry points: ``{name: module}`` (vLLM loads each in every
    one of its processes)."""
    import tomllib

    points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    return {name: target.split(":")[0] for name, target in points.items()}


#: Kimi K3's CPU stand-ins (issue 47): loaded by vLLM as their own plugin, imported by no library module
K3_STANDINS = "moonep_ep.testing.k3_cpu"


def _importers_of(edges: dict[str, set[str]], package: str) -> set[str]:
    return {m for m, deps in edges.items() if m.startswith("moonep_ep.") and not m.startswith(package)
            and any(d == package or d.startswith(package + ".") for d in deps)}


def test_the_library_never_imports_k3s_cpu_stand_ins_vllm_loads_them_as_their_own_plugin():
    edges, _ = import_graph()
    assert {K3_STANDINS, f"{K3_STANDINS}.mla", f"{K3_STANDINS}.kda"} <= set(edges)
    assert _importers_of(edges, K3_STANDINS) == set()
    assert vllm_plugin_modules() == {"moonep_ep": "moonep_ep.vllm", "moonep_ep_k3_cpu": K3_STANDINS}
    # tests/support checks them; control: a library module that imported them would be named
    assert any(d.startswith(K3_STANDINS) for d in edges["tests.support.k3_cpu_ops"])
    stray = {**edges, "moonep_ep.vllm.cpu.k3": edges["moonep_ep.vllm.cpu.k3"] | {f"{K3_STANDINS}.kda"}}
    assert _importers_of(stray, K3_STANDINS) == {"moonep_ep.vllm.cpu.k3"}


def test_the_package_ships_nothing_only_tests_use():
    """Every module of the package is reached from what users run (:func:`user_roots`). A module only tests or
    tooling reach belongs in ``tests/support`` or ``checks`` (the house rule)."""
    edges, _ = import_graph()
    names = set(edges)
    named = {name: _named_modules(path, names) for name, (path, _) in _modules().items()}
    for package, loaded in LOADED_BY_NAME.items():
        named[package] = named.get(package, set()) | loaded
    roots = user_roots()
    assert not {r for r in roots if not r.startswith("moonep_ep.")}  # checks and tests are never roots
    assert unreached(edges, roots, named) == set()
    # Control: a module that only a tests/support file imports is reported, and so is one only checks imports.
    edges_with_stray = {**edges, "moonep_ep.stray": set(), "moonep_ep.stray_tool": set(),
                        "tests.support.hosts": edges["tests.support.hosts"] | {"moonep_ep.stray"},
                        "checks.soak.run": edges["checks.soak.run"] | {"moonep_ep.stray_tool"}}
    assert unreached(edges_with_stray, roots, named) == {"moonep_ep.stray", "moonep_ep.stray_tool"}


#: A whole dotted module path in a string (``"tests.support.soak_plants.PlantedProbe"``): something loaded by name.
MODULE_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def tooling_imports(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """``module -> the checks/tests names it imports or names whole in a string``, for every package module that
    has any (``checks`` or ``tests``), and every ``checks`` module that names ``tests`` (``gpu_check.sh`` runs the
    checks with ``src`` on the path, not the tests). Read from the syntax tree, not the graph: a package module that
    imports ``tests.cli`` or a module not yet written must be named too."""
    out = {}
    for name, tree in trees.items():
        banned = {"checks", "tests"} if name.startswith("moonep_ep") else {"tests"} if name.startswith("checks") \
            else set()
        hits = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:  # a relative import stays in its package
                named = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_PATH.fullmatch(node.value):
                named = [node.value]
            else:
                continue
            hits |= {n for n in named if n.split(".")[0] in banned}
        if hits:
            out[name] = hits
    return out


def test_the_package_imports_neither_checks_nor_tests():
    """The package stands alone: a user's install has neither folder. ``checks`` imports the package, never the
    tests."""
    trees = {name: _tree(path) for name, (path, _) in _modules().items()}
    assert tooling_imports(trees) == {}
    assert any(t.startswith("moonep_ep.") for t in import_graph()[0]["checks.soak.run"])  # checks is read too
    # Control: a package module importing checks, one importing a test module, one naming a test class to be
    # loaded by name, and a check importing tests/support are each named; a relative import of a package module
    # called ``checks``, prose that starts with "tests" and tests/support importing checks are not.
    planted = {**trees, "moonep_ep.errors": ast.parse("from checks.soak import shm"),
               "moonep_ep.envs": ast.parse("import tests.cli.test_envs"),
               "moonep_ep.launch": ast.parse("EXTENSION = 'tests.support.soak_plants.PlantedProbe'"),
               "checks.gpu.k3": ast.parse("from tests.support.k3_moe_reference import e2m1_from_bits"),
               "moonep_ep.models": ast.parse("from . import checks\nHELP = 'tests. Fix: run them'"),
               "tests.support.hosts": ast.parse("from checks.soak.shm import dev_shm_scan")}
    assert tooling_imports(planted) == {"moonep_ep.errors": {"checks.soak"}, "moonep_ep.envs": {"tests.cli.test_envs"},
                                        "moonep_ep.launch": {"tests.support.soak_plants.PlantedProbe"},
                                        "checks.gpu.k3": {"tests.support.k3_moe_reference"}}
