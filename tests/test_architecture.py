"""The layout's rules, checked on the source (ARCHITECTURE.md draws them):

- no import cycle among the project's modules (imports inside functions count:
  a lazy import is still a dependency);
- the runtime (`eltctl_runtime`, folder runtime/) never imports the control side:
  it is what runs on hosts, with Python and torch only;
- the stdlib-only runtime modules the control side uses import no torch at module level.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"eltctl": ROOT / "eltctl", "eltctl_runtime": ROOT / "runtime"}
# What the control side imports from the runtime: these must not need torch.
STDLIB_ONLY = ("eltctl_runtime", "eltctl_runtime.protocol", "eltctl_runtime.files", "eltctl_runtime.pids",
               "eltctl_runtime.nvsmi", "eltctl_runtime.checkpoint.store", "eltctl_runtime.owner",
               "eltctl_runtime.claims", "eltctl_runtime.store.auth", "eltctl_runtime.restart.progress", "eltctl_runtime.netif",
               "eltctl_runtime.store.server", "eltctl_runtime.store.client",
               "eltctl_runtime.store", "eltctl_runtime.checkpoint", "eltctl_runtime.restart", "eltctl_runtime.member",
               "eltctl_runtime.member.plan", "eltctl_runtime.config")


def modules() -> dict[str, Path]:
    out = {}
    for top, base in PACKAGES.items():
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [top, *rel.parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: set[str], *, top_level_only: bool = False) -> set[str]:
    """The project modules `name` imports (a `from pkg import sub` names the submodule)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = tree.body if top_level_only else ast.walk(tree)
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import sub` names the submodule; a name that is not a module, the package
            targets = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_among_the_projects_modules():
    assert cycles(graph()) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_runtime_never_imports_the_control_side():
    offenders = {name: sorted(d for d in deps if d.split(".")[0] == "eltctl")
                 for name, deps in graph().items() if name.startswith("eltctl_runtime")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_runtime_modules_the_control_side_uses_need_no_torch():
    mods = modules()
    for name in STDLIB_ONLY:
        tree = ast.parse(mods[name].read_text(encoding="utf-8"))
        top = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
        top += [n.module or "" for n in tree.body if isinstance(n, ast.ImportFrom)]
        assert not [m for m in top if m.split(".")[0] in ("torch", "numpy", "eltctl")], name
    control_uses = {d for name, deps in graph().items() if name.split(".")[0] == "eltctl"
                    for d in deps if d.startswith("eltctl_runtime")}
    assert control_uses <= set(STDLIB_ONLY), sorted(control_uses - set(STDLIB_ONLY))


def test_every_package_folder_is_in_pyprojects_packages():
    # A folder left out is missing from a non-editable install (`pip install .`):
    # eltctl.ledger was, and `eltctl usage` failed there with ModuleNotFoundError.
    import tomllib

    root = Path(__file__).resolve().parents[1]
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for name, folder in config["package-dir"].items():
        for init in (root / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(root / folder)
            found.add(".".join((name, *rel.parts)))
    assert found - listed == set(), f"add to [tool.setuptools] packages in pyproject.toml: {sorted(found - listed)}"
