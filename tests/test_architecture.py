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
  file over 800 lines. A failure names each offender with its size and the limit. A class
  is measured with the project-defined classes it inherits from (its mixins, transitively:
  `class A(_B, _C)` is as big as A, B and C together, and sets their attributes), except
  the documented contracts in CONTRACTS: otherwise a class cut into mixins that share
  `self` would pass as rooms while it is still one object.
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
    it), for every class of a module, nested ones too (its own body only: no bases)."""
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


# Project classes a subclass is measured without: documented seams whose body is an interface
# (the methods every implementation overrides, their documented defaults), not state or
# behaviour the subclass shares `self` with. (module, class) -> why. Not one: a mixin, public
# or private (MemberViews, which ElasticJob and the Supervisor read `self._session` through,
# counts with both), nor a class subclassed to vary it (ReplicatedPath under LowRankPath).
CONTRACTS = {
    ("eltctl_runtime.train.gradients", "GradientPath"):
        "the gradient-path seam (runtime/README.md 'Where a change goes'): an ABC whose body is the "
        "contract's documentation and defaults; every path implements it",
}


class Project:
    """Every module's top-level classes and what its names refer to, to resolve base classes
    to the project's own (a name defined there, imported from a project module, or
    `module.Name` of an imported project module). Anything else (torch's, the standard
    library's) is not the project's and is not measured."""

    def __init__(self, mods: dict[str, Path], contracts: dict[tuple[str, str], str] = CONTRACTS) -> None:
        self.contracts = contracts
        self.trees = {name: ast.parse(path.read_text(encoding="utf-8"), str(path)) for name, path in mods.items()}
        known = set(mods)
        self.classes = {name: {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
                        for name, tree in self.trees.items()}
        self.names: dict[str, dict[str, tuple[str, str | None]]] = {}  # module -> local name -> (module, attr)
        for name, tree in self.trees.items():
            package = name if mods[name].name == "__init__.py" else name.rpartition(".")[0]
            local: dict[str, tuple[str, str | None]] = {}
            for node in tree.body:
                if isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                        base = ".".join([*anchor, base] if base else anchor)
                    for a in node.names:
                        sub = f"{base}.{a.name}"
                        local[a.asname or a.name] = (sub, None) if sub in known else (base, a.name)
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.asname and a.name in known:
                            local[a.asname] = (a.name, None)
            self.names[name] = local

    def find(self, module: str, name: str, seen: int = 0) -> tuple[str, ast.ClassDef] | None:
        """The project class `name` of `module`: defined there, or imported into it."""
        if name in self.classes.get(module, {}):
            return module, self.classes[module][name]
        where = self.names.get(module, {}).get(name)
        if where is None or where[1] is None or seen > 8:
            return None
        return self.find(where[0], where[1], seen + 1)

    def base(self, module: str, expr: ast.expr) -> tuple[str, ast.ClassDef] | None:
        if isinstance(expr, ast.Name):
            return self.find(module, expr.id)
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            where = self.names.get(module, {}).get(expr.value.id)
            if where is not None and where[1] is None:  # an imported project module
                return self.find(where[0], expr.attr)
        return None

    def measured_bases(self, module: str, cls: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
        """The project classes `cls` inherits from, transitively, but CONTRACTS and their bases."""
        out: list[tuple[str, ast.ClassDef]] = []
        todo = [(module, b) for b in cls.bases]
        while todo:
            mod, expr = todo.pop(0)
            found = self.base(mod, expr)
            if found is None or (found[0], found[1].name) in self.contracts or found in out:
                continue
            out.append(found)
            todo.extend((found[0], b) for b in found[1].bases)
        return out

    def sizes(self, module: str) -> list[tuple[str, int, int, list[str]]]:
        """(name, lines, distinct attributes set on self, the bases measured with it) of every
        class of `module`, nested ones too, each with its measured bases."""
        out = []
        for node in ast.walk(self.trees[module]):
            if isinstance(node, ast.ClassDef):
                bases = self.measured_bases(module, node)
                lines = sum(c.end_lineno - c.lineno + 1 for _m, c in [(module, node), *bases])
                attrs = set().union(attributes_set_on_self(node), *(attributes_set_on_self(c) for _m, c in bases))
                out.append((node.name, lines, len(attrs), [c.name for _m, c in bases]))
        return out


def oversized_classes() -> list[str]:
    mods = modules()
    project = Project(mods)
    out = []
    for name, path in sorted(mods.items(), key=lambda kv: kv[1]):
        rel = path.relative_to(ROOT).as_posix()
        for cls, lines, attrs, bases in project.sizes(name):
            max_lines, max_attrs = LARGER.get((rel, cls), (CLASS_LINES, None))
            with_bases = f" with its bases {', '.join(bases)}" if bases else ""
            if lines > max_lines:
                out.append(f"{rel}: class {cls} is {lines} lines{with_bases} (limit {max_lines})")
            if max_attrs is not None and attrs > max_attrs:
                out.append(f"{rel}: class {cls} sets {attrs} attributes on self{with_bases} (limit {max_attrs})")
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


def test_a_class_is_measured_with_the_project_classes_it_inherits_but_not_a_contract(tmp_path):
    files = {
        "pkg/__init__.py": "",
        "pkg/parts.py": ("class _Part:\n"
                         "    def f(self):\n"
                         "        self.a = self.b = 1\n"
                         "\n"
                         "class _Deeper(_Part):\n"
                         "    def g(self):\n"
                         "        self.c = 3\n"),
        "pkg/seam.py": ("class Seam:\n"
                        "    def h(self):\n"
                        "        self.d = 4\n"),
        "pkg/again.py": "from .parts import _Deeper as Renamed\n",
        "pkg/big.py": ("import torch.distributed as dist\n"
                       "from . import seam\n"
                       "from .again import Renamed\n"
                       "\n"
                       "class Big(Renamed, seam.Seam, dist.Store):\n"
                       "    def i(self):\n"
                       "        self.a = 5\n"
                       "        self.e = 6\n"),
    }
    mods = {}
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        name = rel.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        mods[name] = path
    # _Deeper (imported under another name, through a module that re-exports it) and its own
    # base _Part count with Big; torch's dist.Store is not the project's
    with_seam = {c[0]: c[1:] for c in Project(mods, contracts={}).sizes("pkg.big")}
    assert with_seam["Big"] == (4 + 3 + 3 + 3, 5, ["_Deeper", "Seam", "_Part"])
    # a contract (and what it inherits) does not
    no_seam = {c[0]: c[1:] for c in Project(mods, contracts={("pkg.seam", "Seam"): "a seam"}).sizes("pkg.big")}
    assert no_seam["Big"] == (4 + 3 + 3, 4, ["_Deeper", "_Part"])
    assert Project(mods).sizes("pkg.parts") == [("_Part", 3, 2, []), ("_Deeper", 6, 3, ["_Part"])]


def test_every_contract_names_a_project_class():
    project = Project(modules())
    assert [key for key in CONTRACTS if project.find(*key) is None] == []


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


def test_every_test_module_has_a_basename_of_its_own():
    """The test folders are not packages, so pytest imports each test module by its
    basename: a second tests/**/test_x.py stops the whole run's collection of one of them
    ("import file mismatch")."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: where for name, where in seen.items() if len(where) > 1} == {}
