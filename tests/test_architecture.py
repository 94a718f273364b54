"""The layout's rules, checked on the source (ARCHITECTURE.md draws them):

- no import cycle among the project's modules (imports inside functions count:
  a lazy import is still a dependency);
- the runtime (`eltctl_runtime`, folder runtime/) never imports the control side:
  it is what runs on hosts, with Python and torch only;
- the stdlib-only runtime modules the control side uses import no torch at module level;
- the top of the runtime (runtime/*.py) holds only standard-library modules the control
  side imports: each is imported by some eltctl/ module and imports no torch at module level;
- sizes, in eltctl/ and runtime/ (issue 48): no class over 450 lines (`ElasticJob`, the
  largest, at most 600 lines and at most 35 distinct attributes set on `self`), no source
  file over 800 lines. A failure names each offender with its size and the limit.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"eltctl": ROOT / "eltctl", "eltctl_runtime": ROOT / "runtime"}
# What the control side imports from the runtime: these must not need torch.
STDLIB_ONLY = ("eltctl_runtime", "eltctl_runtime.protocol", "eltctl_runtime.files", "eltctl_runtime.pids",
               "eltctl_runtime.nvsmi", "eltctl_runtime.checkpoint.format", "eltctl_runtime.checkpoint.load",
               "eltctl_runtime.checkpoint.store", "eltctl_runtime.owner",
               "eltctl_runtime.claims", "eltctl_runtime.store.auth", "eltctl_runtime.restart.progress", "eltctl_runtime.netif",
               "eltctl_runtime.store.server", "eltctl_runtime.store.client",
               "eltctl_runtime.store", "eltctl_runtime.checkpoint", "eltctl_runtime.restart", "eltctl_runtime.member",
               "eltctl_runtime.member.plan", "eltctl_runtime.member.config")


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


# --------------------------------------------------------------------------- sizes (issue 48)

FILE_LINES = 800
CLASS_LINES = 450
# the exceptions: (file relative to the repository, class) -> (lines, attributes set on self)
LARGER = {("runtime/train/job.py", "ElasticJob"): (600, 35)}
SIZED = ("eltctl", "runtime")


def source_files() -> list[Path]:
    return [p for top in SIZED for p in sorted((ROOT / top).rglob("*.py"))]


def classes_of(source: str) -> list[tuple[str, int, int]]:
    """(name, lines from its `class` line to its last, distinct attributes set on `self` in
    it), for every class of a module, nested ones too."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            out.append((node.name, node.end_lineno - node.lineno + 1, len(attributes_set_on_self(node))))
    return out


def attributes_set_on_self(cls: ast.ClassDef) -> set[str]:
    """The names `self.NAME = ...` (also `+=`, annotated, and in tuple targets) sets in the class."""
    found: set[str] = set()

    def targets(t: ast.expr) -> None:
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                targets(e)
        elif isinstance(t, ast.Starred):
            targets(t.value)
        elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
            found.add(t.attr)

    for node in ast.walk(cls):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                targets(t)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets(node.target)
    return found


def oversized_classes() -> list[str]:
    out = []
    for path in source_files():
        rel = path.relative_to(ROOT).as_posix()
        for name, lines, attrs in classes_of(path.read_text(encoding="utf-8")):
            max_lines, max_attrs = LARGER.get((rel, name), (CLASS_LINES, None))
            if lines > max_lines:
                out.append(f"{rel}: class {name} is {lines} lines (limit {max_lines})")
            if max_attrs is not None and attrs > max_attrs:
                out.append(f"{rel}: class {name} sets {attrs} attributes on self (limit {max_attrs})")
    return out


def oversized_files() -> list[str]:
    out = []
    for path in source_files():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > FILE_LINES:
            out.append(f"{path.relative_to(ROOT).as_posix()}: {lines} lines (limit {FILE_LINES})")
    return out


def test_the_size_checks_measure_classes_and_their_attributes():
    source = ("class A:\n"
              "    x = 1\n"
              "    def f(self):\n"
              "        self.a = self.b = 1\n"
              "        self.c += 1\n"
              "        self.d: int = 2\n"
              "        (self.e, [self.f, *self.g]), other.h = (1, [2, 3]), 4\n"
              "        self.a = 5\n"
              "    class B:\n"
              "        pass\n")
    assert sorted(classes_of(source)) == [("A", 10, 7), ("B", 2, 0)]


def test_no_class_over_450_lines_and_elastic_job_within_its_own_limits():
    found = oversized_classes()
    assert not found, "split these classes along their seams:\n" + "\n".join(found)


def test_no_source_file_over_800_lines():
    found = oversized_files()
    assert not found, "split these files by concern:\n" + "\n".join(found)


def test_the_top_of_the_runtime_holds_only_stdlib_modules_the_control_side_imports():
    mods, g = modules(), graph()
    control_uses = {d for name, deps in g.items() if name.split(".")[0] == "eltctl" for d in deps}
    problems = []
    for path in sorted((ROOT / "runtime").glob("*.py")):
        if path.name == "__init__.py":
            continue
        name = f"eltctl_runtime.{path.stem}"
        assert mods[name] == path
        if name not in control_uses:
            problems.append(f"runtime/{path.name}: no eltctl/ module imports {name}; move it into the "
                            "subpackage of its concern")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
        top += [n.module or "" for n in tree.body if isinstance(n, ast.ImportFrom) and not n.level]
        heavy = sorted({m for m in top if m.split(".")[0] not in (*sys.stdlib_module_names, "eltctl_runtime")})
        if heavy:
            problems.append(f"runtime/{path.name}: imports {', '.join(heavy)} at module level (not the standard "
                            "library)")
    assert not problems, "\n".join(problems)
