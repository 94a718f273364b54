"""What of the job's code directory travels to the hosts: gitignore patterns, and one choice.

The workdir is copied to every host (`ops.sync_code`); what it holds beside the code
must not go along: the inventory (a token in `[notify] headers`), the controller's
state, exported models, logs, version control, environments, caches. The choice is
made here once, by rules in gitignore's syntax, and every copy path uses it:

1. the built-in rules (`BUILTIN`, below), and the job's own files found inside the
   workdir (the inventory, the state directory, the metrics file: `job_rules`);
2. `.gitignore` and `.eltctlignore` in the workdir and its subdirectories (a deeper
   file's rules come after a shallower one's: the last rule that matches decides, as
   in git);
3. `[job] exclude` (the inventory has the last word over the files);
4. `[job] include`: anything it matches is sent, the built-in rules and the size
   limit notwithstanding (a file inside a directory left out needs the directory named).

A file larger than `LARGE_FILE_BYTES` is left out unless `[job] include` names it:
`up` says so, naming it.

The syntax (git's gitignore(5)): `#` comments and blank lines; `!` re-includes; a
trailing `/` matches directories only; a `/` at the start or in the middle anchors the
pattern at its file's directory, otherwise it matches at any depth; `*` and `?` never
match `/`; `[a-z]`, `[!...]` classes; `**/`, `/**`, `/**/` span directories; `\\`
escapes. As in git, a path inside a directory that is left out cannot be re-included.

`Rules.excluded` is the pure decision; `choose` walks a directory with it (the only
I/O here: listing, sizes, the ignore files).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable

IGNORE_FILES = (".gitignore", ".eltctlignore")  # read in each directory, in this order
LARGE_FILE_BYTES = 50 * 1000 * 1000  # a file above this is left out unless [job] include names it
SEND_WARN_BYTES = 20 * 1000 * 1000  # `up` warns when the code it sends is larger than this

# Never sent unless `[job] include` asks: (pattern, why); the why is what `up` shows. A model
# file: what `eltctl checkpoints export` writes (model.pt), weights, checkpoints.
BUILTIN: tuple[tuple[str, str], ...] = (
    (".git/", "version control"), (".hg/", "version control"), (".svn/", "version control"),
    (".venv*/", "a virtual environment"), ("venv/", "a virtual environment"),
    ("__pycache__/", "a cache"), ("*.py[co]", "a cache"), (".mypy_cache/", "a cache"),
    (".pytest_cache/", "a cache"), (".ipynb_checkpoints/", "a cache"), ("node_modules/", "a cache"),
    (".eltctl/", "eltctl's state"),
    ("*.pt", "a model file"), ("*.pth", "a model file"),
    ("*.ckpt", "a model file"), ("*.safetensors", "a model file"),
    ("*.log", "a log"), ("*.prom", "a metrics file"),
)
# Left out without a word in `up`'s summary: everyone expects these to stay home.
QUIET = frozenset({"version control", "a virtual environment", "a cache", "eltctl's state"})


class PatternError(ValueError):
    """A pattern that cannot be matched (an unclosed `[`); the message says which and why."""


@dataclass(frozen=True)
class Rule:
    pattern: str  # as written (after trimming)
    negate: bool
    dir_only: bool
    base: str  # the directory (relative, POSIX, "" for the workdir) whose paths it matches
    regex: re.Pattern[str]
    source: str  # where it was written: ".gitignore:3", "[job] exclude", a built-in's reason

    def matches(self, path: str, is_dir: bool) -> bool:
        if self.dir_only and not is_dir:
            return False
        if self.base:
            if not path.startswith(self.base + "/"):
                return False
            path = path[len(self.base) + 1:]
        return self.regex.fullmatch(path) is not None


def _class(pattern: str, i: int) -> tuple[str, int] | None:
    """The regex of the bracket expression starting at pattern[i] == "[", and the index after
    it; None when it is not closed."""
    j = i + 1
    out = "["
    if j < len(pattern) and pattern[j] in "!^":
        out += "^"
        j += 1
    first = True
    while j < len(pattern):
        c = pattern[j]
        if c == "]" and not first:
            return out + "]", j + 1
        if c == "\\" and j + 1 < len(pattern):
            j += 1
            c = pattern[j]
        out += re.escape(c) if c != "-" else "-"
        first = False
        j += 1
    return None


def translate(body: str, *, anchored: bool, strict: bool = False) -> str:
    """The regex of a pattern's body (no `!`, no leading or trailing `/`), for a path
    relative to the rule's base; not `anchored`: at any depth. `strict`: an unclosed `[`
    is an error (the inventory's patterns), else a literal `[` (an ignore file's, as git)."""
    out = []
    i = 0
    n = len(body)
    while i < n:
        c = body[i]
        if c == "*" and body.startswith("**", i):
            before_ok = i == 0 or body[i - 1] == "/"
            after = i + 2
            if before_ok and (after == n or body[after] == "/"):
                if after == n:  # trailing "/**" (or the whole pattern): everything below
                    out.append(".*")
                    i = after
                else:  # "**/" : zero or more directories
                    out.append("(?:.*/)?")
                    i = after + 1
                continue
            out.append("[^/]*")  # "**" inside a name is a plain "*"
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            cls = _class(body, i)
            if cls is None:
                if strict:
                    raise PatternError(f"{body!r} has a '[' that is not closed: close it with ']' or write '\\['")
                out.append(re.escape("["))
            else:
                out.append(cls[0])
                i = cls[1]
                continue
        elif c == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(body[i]))
        else:
            out.append(re.escape(c))
        i += 1
    regex = "".join(out)
    return regex if anchored else "(?:.*/)?" + regex


def parse_line(line: str, *, base: str = "", source: str = "", strict: bool = False) -> Rule | None:
    """One line of an ignore file (or one `[job] exclude` entry) as a rule; None for a blank
    line or a comment. Raises `PatternError` (strict) for a pattern that cannot match."""
    text = line.rstrip("\n").rstrip("\r")
    # trailing spaces are dropped unless escaped with a backslash
    stripped = text.rstrip(" ")
    if stripped.endswith("\\") and len(stripped) < len(text):
        stripped += " "
    text = stripped
    if not text or text.startswith("#"):
        return None
    negate = text.startswith("!")
    if negate:
        text = text[1:]
    elif text.startswith("\\!") or text.startswith("\\#"):
        text = text[1:]
    dir_only = text.endswith("/") and not text.endswith("\\/")
    body = text.rstrip("/") if dir_only else text
    anchored = body.startswith("/") or "/" in body
    body = body.lstrip("/")
    if not body:
        if strict:
            raise PatternError(f"{line!r} names no file")
        return None
    regex = translate(body, anchored=anchored, strict=strict)
    return Rule(pattern=line.strip(), negate=negate, dir_only=dir_only, base=base,
                regex=re.compile(regex, re.DOTALL), source=source)


def parse_text(text: str, *, base: str = "", source: str = "") -> list[Rule]:
    """The rules of an ignore file's text (never raises: a bad line is taken literally)."""
    rules = []
    for number, line in enumerate(text.splitlines(), 1):
        rule = parse_line(line, base=base, source=f"{source}:{number}")
        if rule is not None:
            rules.append(rule)
    return rules


def check_pattern(pattern: str) -> str | None:
    """What is wrong with a pattern of the inventory's (`[job] exclude`, `include`), or None."""
    if not pattern.strip():
        return "is empty: write a pattern such as \"data/\" or \"*.bin\""
    if pattern.lstrip().startswith("#"):
        return f"{pattern!r} is a comment in gitignore's syntax and matches nothing: write \\# for a '#'"
    try:
        if parse_line(pattern, strict=True) is None:
            return f"{pattern!r} matches nothing"
    except PatternError as exc:
        return str(exc)
    return None


def literal(relpath: str) -> str:
    """An anchored pattern that matches exactly this path (its special characters escaped)."""
    return "/" + re.sub(r"([*?\[\]\\!# ])", r"\\\1", relpath)


@dataclass(frozen=True)
class Verdict:
    excluded: bool
    why: str = ""  # the rule's source (a built-in's reason, ".gitignore:3", "[job] exclude")


@dataclass(frozen=True)
class Rules:
    """The rules in their order (the last that matches a path decides): the built-in and
    the job's own files' (`first`), the ignore files' (`files`, shallower first), `[job]
    exclude`'s (`exclude`); then `[job] include`'s, which send whatever they match."""

    first: tuple[Rule, ...] = ()
    files: tuple[Rule, ...] = ()
    exclude: tuple[Rule, ...] = ()
    include: tuple[Rule, ...] = ()
    large: int = LARGE_FILE_BYTES

    def with_files(self, more: Iterable[Rule]) -> "Rules":
        return replace(self, files=self.files + tuple(more))

    def _own(self, path: str, is_dir: bool) -> Verdict:
        """The path's own verdict, its parents not looked at."""
        if any(r.matches(path, is_dir) for r in self.include):
            return Verdict(False, "[job] include")
        for rule in reversed(self.first + self.files + self.exclude):
            if rule.matches(path, is_dir):
                return Verdict(not rule.negate, rule.source)
        return Verdict(False)

    def excluded(self, path: str, is_dir: bool = False, size: int | None = None) -> Verdict:
        """Pure: is `path` (relative to the workdir, POSIX) left out? A path inside a
        left-out directory is left out whatever its own rules say (as in git); a file
        above the size limit is, unless `[job] include` names it."""
        parts = path.split("/")
        for k in range(1, len(parts)):
            parent = self._own("/".join(parts[:k]), True)
            if parent.excluded:
                return parent
        own = self._own(path, is_dir)
        if own.excluded:
            return own
        if not is_dir and size is not None and size > self.large and not self._asked_for(parts):
            return Verdict(True, f"larger than {human(self.large)}")
        return own

    def _asked_for(self, parts: list[str]) -> bool:
        """`[job] include` names the file or a directory above it."""
        names = [("/".join(parts[:k]), True) for k in range(1, len(parts))] + [("/".join(parts), False)]
        return any(r.matches(p, d) for r in self.include for p, d in names)


def compile_patterns(patterns: Iterable[str], source: str) -> tuple[Rule, ...]:
    """The inventory's patterns (checked by the parser already) as rules."""
    out = []
    for p in patterns:
        rule = parse_line(p, source=source, strict=True)
        if rule is not None:
            out.append(rule)
    return tuple(out)


def builtin_rules() -> tuple[Rule, ...]:
    return tuple(r for p, why in BUILTIN if (r := parse_line(p, source=why)) is not None)


def job_rules(workdir: Path, own_files: Iterable[tuple[Path | None, str]]) -> tuple[Rule, ...]:
    """Rules leaving out the job's own files that lie inside the workdir (the inventory, the
    state directory, the metrics file), each with its reason."""
    root = Path(os.path.abspath(workdir))
    out = []
    for path, why in own_files:
        if path is None:
            continue
        try:
            rel = Path(os.path.abspath(path)).relative_to(root).as_posix()
        except ValueError:
            continue
        if rel in ("", "."):
            continue
        rule = parse_line(literal(rel), source=why)
        if rule is not None:
            out.append(rule)
    return tuple(out)


@dataclass(frozen=True)
class Selection:
    """What goes to the hosts: {relative path: size}, and what was left out."""

    files: dict[str, int] = field(default_factory=dict)
    left_out: tuple[tuple[str, int, str], ...] = ()  # (path, size, why) of files (and dirs: size -1)

    @property
    def total(self) -> int:
        return sum(self.files.values())

    def largest(self, n: int = 3) -> list[tuple[str, int]]:
        return sorted(self.files.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


def choose(workdir: Path, rules: Rules) -> Selection:
    """Walk `workdir` and choose with `rules` plus the ignore files found on the way (a
    directory left out is not entered; symlinks to files are followed, to directories not)."""
    root = Path(workdir)
    files: dict[str, int] = {}
    left: list[tuple[str, int, str]] = []
    per_dir: dict[str, Rules] = {}
    for d, dirs, names in os.walk(root):
        rel_dir = Path(d).relative_to(root).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir
        parent = per_dir.get(rel_dir.rpartition("/")[0], rules) if rel_dir else rules
        here = per_dir[rel_dir] = parent.with_files(_ignore_files(root, rel_dir))
        kept = []
        for name in sorted(dirs):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            v = here.excluded(rel, True)
            if v.excluded:
                left.append((rel + "/", -1, v.why))
            else:
                kept.append(name)
        dirs[:] = kept
        for name in sorted(names):
            p = Path(d) / name
            rel = f"{rel_dir}/{name}" if rel_dir else name
            try:
                if not p.is_file():
                    continue
                size = p.stat().st_size
            except OSError:
                continue
            v = here.excluded(rel, False, size)
            if v.excluded:
                left.append((rel, size, v.why))
            else:
                files[rel] = size
    return Selection(files=files, left_out=tuple(left))


def _ignore_files(root: Path, rel_dir: str) -> list[Rule]:
    """The rules of the ignore files in one directory of the workdir."""
    out: list[Rule] = []
    for name in IGNORE_FILES:
        try:
            text = (root / rel_dir / name).read_text(errors="replace")
        except OSError:
            continue
        out += parse_text(text, base=rel_dir, source=f"{rel_dir + '/' if rel_dir else ''}{name}")
    return out


def human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def describe(selection: Selection, *, needed: Iterable[str] = (), shown: int = 5) -> list[tuple[bool, str]]:
    """What `eltctl up` says of the code it sends: [(is a warning, text)]: the count and
    size, what was left out that a person may have expected to go (not version control,
    caches, environments), the large files left out, a file the command needs (`needed`:
    its script, relative to the workdir) left out, and a warning above `SEND_WARN_BYTES`
    naming the largest files."""
    n = len(selection.files)
    line = f"code for each host: {n} file{'s' if n != 1 else ''}, {human(selection.total)}"
    told = [(p, size, why) for p, size, why in selection.left_out
            if why not in QUIET and not why.startswith("larger than")]
    if told:
        names = ", ".join(f"{p} ({why})" for p, _s, why in told[:shown])
        more = f" and {len(told) - shown} more" if len(told) > shown else ""
        line += f"; left out: {names}{more}"
    out = [(False, line)]
    for p, size, why in selection.left_out:
        if why.startswith("larger than"):
            out.append((True, f"{p} ({human(size)}) is not sent to the hosts: {why}; to send it, add it to "
                              "[job] include"))
    for path in needed:
        rel = os.path.normpath(path)
        why = next((w for p, _s, w in selection.left_out
                    if p == rel or (p.endswith("/") and rel.startswith(p))), None)
        if why is not None and not os.path.isabs(rel):
            out.append((True, f"the command's script {rel} is not sent to the hosts (left out by {why}): the "
                              "workers cannot start; name it (or the directory left out) in [job] include"))
    if selection.total > SEND_WARN_BYTES:
        big = ", ".join(f"{p} ({human(size)})" for p, size in selection.largest())
        out.append((True, f"the code sent to each host is {human(selection.total)} (above "
                          f"{human(SEND_WARN_BYTES)}); the largest files: {big}; leave out what the workers "
                          "do not need with [job] exclude or a .eltctlignore file"))
    return out
