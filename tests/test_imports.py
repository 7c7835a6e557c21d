"""No import cycles between the modules of jax_dsa.

Every ``.py`` file of the package is parsed with :mod:`ast` (nothing is imported), and every import
in it counts: module level, function-local and ``if TYPE_CHECKING:`` ones alike, since a local
import only postpones a cycle to the first call.

Edges, for an import written in module ``M`` (relative imports resolved against ``M``'s package):

* ``import jax_dsa.a.b`` and ``from jax_dsa.a.b import name``: ``M -> jax_dsa.a.b``.
* ``from jax_dsa.a import b`` with ``b`` a submodule: ``M -> jax_dsa.a.b``, plus
  ``M -> jax_dsa.a`` when ``jax_dsa/a/__init__.py`` rebinds ``b`` at top level to something else
  (Python then returns the package attribute, which exists only once that line has run).
* ``from jax_dsa.a import name``, any other name: ``M -> jax_dsa.a``; the name is read from the
  package's namespace. So ``from jax_dsa import sparse_mla`` in a module that
  ``jax_dsa/__init__.py`` imports is a cycle.
* ``importlib.import_module("jax_dsa.x")`` with a literal name: ``M -> jax_dsa.x``.

Not counted: the parent packages that ``import jax_dsa.a.b`` runs first (``jax_dsa`` and
``jax_dsa.a``). A package whose ``__init__`` imports its submodules, which import their siblings
by full name, works in any import order: a submodule import needs its parent in ``sys.modules``,
not finished (the import system reference, "The module cache" and "Submodules",
https://docs.python.org/3/reference/import.html). Counting those edges would call every such
package a cycle; reading a name out of the unfinished parent is what breaks, and the
``from pkg import name`` edge above catches that.

Imports outside the package (jax, numpy, ...) are ignored, and so is an import of a module
itself.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGE = "jax_dsa"


def _package_dir(package: str) -> Path:
    # find_spec of a top-level name locates it without running its __init__. An editable install
    # may add a location holding only the compiled modules; the sources are where __init__.py is.
    spec = importlib.util.find_spec(package)
    locations = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    roots = [p for p in locations if (p / "__init__.py").is_file()]
    if not roots:
        pytest.fail(f"{package}: no package directory with an __init__.py in {locations}")
    return roots[0]


def discover_modules(root: Path, package: str) -> tuple[dict[str, Path | None], set[str]]:
    """Module name -> source file (``None`` for a directory without ``__init__.py``), and the
    names that are packages."""
    init = root / "__init__.py"
    modules: dict[str, Path | None] = {package: init if init.exists() else None}
    packages = {package}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        parts = rel.with_suffix("").parts
        if any(not p.isidentifier() for p in parts):  # __pycache__ copies, "my-script.py", ...
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
            if not parts:
                continue
            packages.add(".".join((package, *parts)))
        modules[".".join((package, *parts))] = path
        # Namespace directories on the way down are packages too.
        for i in range(1, len(parts)):
            name = ".".join((package, *parts[:i]))
            packages.add(name)
            modules.setdefault(name, None)
    return modules, packages


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _module_of(name: str, modules: dict) -> str | None:
    """The longest prefix of ``name`` that is a module of the package."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in modules:
            return candidate
    return None


def _top_level_bindings(tree: ast.Module):
    """(name, node) for each name a module binds outside functions and classes."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                yield (alias.asname or alias.name.split(".")[0]), node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        yield sub.id, node
        else:  # if / try / with / for at top level
            for field in ("body", "orelse", "finalbody", "handlers"):
                stack.extend(getattr(node, field, []) or [])


def _imports(module: str, tree: ast.AST, packages: set[str]):
    """(imported name, name inside it or None, line) for every import in ``tree``."""
    is_package = module in packages
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = _resolve_relative(module, is_package, node.level, node.module)
            for alias in node.names:
                yield base, (None if alias.name == "*" else alias.name), node.lineno
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "importlib"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and not node.args[0].value.startswith(".")
        ):
            yield node.args[0].value, None, node.lineno


def _rebinds_submodule(init_tree: ast.Module, package: str, name: str) -> bool:
    """Whether ``package/__init__.py`` binds ``name`` to something other than its submodule."""
    submodule = f"{package}.{name}"
    for bound, node in _top_level_bindings(init_tree):
        if bound != name:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = _resolve_relative(package, True, node.level, node.module)
            if any((a.asname or a.name) == name and f"{base}.{a.name}" == submodule
                   for a in node.names):
                continue
        if isinstance(node, ast.Import) and any(
            a.asname == name and a.name == submodule for a in node.names
        ):
            continue
        return True
    return False


def build_import_graph(root: Path, package: str = PACKAGE):
    """``{module: {imported module: [(file, line), ...]}}`` over the package's modules."""
    modules, packages = discover_modules(root, package)
    trees = {}
    for name, path in modules.items():
        if path is not None:
            trees[name] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    graph: dict[str, dict[str, list]] = {name: {} for name in modules}

    def add(src, dst, line):
        if dst is not None and dst != src:
            graph[src].setdefault(dst, []).append((modules[src], line))

    for src, tree in trees.items():
        for target, attr, line in _imports(src, tree, packages):
            if target != package and not target.startswith(package + "."):
                continue
            if attr is None:
                add(src, _module_of(target, modules), line)
                continue
            if target in packages and f"{target}.{attr}" in modules:
                add(src, f"{target}.{attr}", line)
                init = trees.get(target)
                if init is not None and _rebinds_submodule(init, target, attr):
                    add(src, target, line)
            else:
                add(src, _module_of(target, modules), line)
    return graph


def find_cycles(graph: dict[str, dict]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component with more than one
    module (Tarjan's algorithm, then a breadth-first path back to the component's first
    module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []

    def strongconnect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    cycles = []
    for component in components:
        members, start = set(component), component[0]
        parent: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in parent:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in members and w not in parent:
                        parent[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [start]
        v = parent[start]
        while v != start:
            path.append(v)
            v = parent[v]
        path.append(start)
        cycles.append(path[::-1])
    return sorted(cycles)


def describe(cycle: list[str], graph: dict, root: Path) -> str:
    lines = [" -> ".join(cycle)]
    for a, b in zip(cycle, cycle[1:]):
        where = ", ".join(
            f"{path.relative_to(root.parent)}:{line}" for path, line in sorted(set(graph[a][b]))
        )
        lines.append(f"    {a} imports {b} ({where})")
    return "\n".join(lines)


def test_jax_dsa_has_no_import_cycles():
    root = _package_dir(PACKAGE)
    graph = build_import_graph(root)
    assert len(graph) > 1 and any(graph.values()), f"no modules or imports found under {root}"
    cycles = find_cycles(graph)
    report = "\n".join(describe(c, graph, root) for c in cycles)
    if report:
        print(report)
    assert not cycles, f"{len(cycles)} import cycle(s) in {PACKAGE}:\n{report}"


# The checker itself, on a small package written for the purpose.


def _write(root: Path, files: dict[str, str]):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_finds_local_relative_and_parent_cycles(tmp_path):
    root = tmp_path / "pkg"
    _write(root, {
        "__init__.py": "from pkg.a.x import f\nimport pkg.c\n",
        "a/__init__.py": "from .x import f\nfrom pkg.a import y\n",
        # x -> y at module level, y -> x only inside a function.
        "a/x.py": "from . import y\ndef f():\n    return y.g()\n",
        "a/y.py": "def g():\n    from pkg.a.x import f\n    return f\n",
        # z reads a name from the top package, whose __init__ imports z through b.
        "b/__init__.py": "", "b/z.py": "from pkg import f\n",
        "c.py": "import pkg.b.z\n",
    })
    graph = build_import_graph(root, "pkg")
    assert set(graph["pkg.a.x"]) == {"pkg.a.y"}
    assert set(graph["pkg.a.y"]) == {"pkg.a.x"}
    assert set(graph["pkg.b.z"]) == {"pkg"}
    assert set(graph["pkg.a"]) == {"pkg.a.x", "pkg.a.y"}
    cycles = find_cycles(graph)
    assert ["pkg", "pkg.c", "pkg.b.z", "pkg"] in cycles
    assert ["pkg.a.x", "pkg.a.y", "pkg.a.x"] in cycles
    assert len(cycles) == 2
    assert "pkg/a/y.py:2" in describe(["pkg.a.x", "pkg.a.y", "pkg.a.x"], graph, root)


def test_checker_accepts_a_package_that_reexports_its_submodules(tmp_path):
    root = tmp_path / "pkg"
    _write(root, {
        "__init__.py": "from pkg.cfg import get\n",
        # The package imports both families; they share a sibling, never the package.
        "cfg/__init__.py": "from pkg.cfg.one import A\nfrom pkg.cfg.two import B\n"
                           "def get():\n    return A, B\n",
        "cfg/common.py": "X = 1\n",
        "cfg/one.py": "from pkg.cfg.common import X\nA = X\n",
        "cfg/two.py": "from .common import X\nfrom . import one\nB = one.A + X\n",
    })
    graph = build_import_graph(root, "pkg")
    assert set(graph["pkg.cfg.two"]) == {"pkg.cfg.common", "pkg.cfg.one"}
    assert find_cycles(graph) == []
    # A submodule shadowed by a name of the package's __init__ reads the package.
    (root / "cfg/three.py").write_text("from pkg.cfg import one\n")
    (root / "cfg/__init__.py").write_text(
        "from pkg.cfg.two import B\nimport pkg.cfg.three\none = 1\n"
    )
    graph = build_import_graph(root, "pkg")
    assert set(graph["pkg.cfg.three"]) == {"pkg.cfg", "pkg.cfg.one"}
    assert find_cycles(graph) == [["pkg.cfg", "pkg.cfg.three", "pkg.cfg"]]


def test_subpackages_load_on_first_use():
    """``import jax_dsa`` loads the ops only; ``jax_dsa.nn``, ``jax_dsa.configs``, ... import
    on first attribute access; other names still raise AttributeError."""
    import subprocess
    import sys

    code = (
        "import sys, jax_dsa\n"
        "assert 'jax_dsa.nn' not in sys.modules and 'flax' not in sys.modules\n"
        "c = jax_dsa.configs.get_config('glm5-tiny')\n"
        "assert jax_dsa.nn.DSAAttention and jax_dsa.interop and jax_dsa.sharding\n"
        "try:\n"
        "    jax_dsa.no_such_name\n"
        "except AttributeError as e:\n"
        "    assert 'no_such_name' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
