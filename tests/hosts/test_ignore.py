"""What of the workdir goes to the hosts (eltctl/hosts/ignore.py): the gitignore matcher
as a table, the order of the rules, the size limit, and one walk of a real directory."""

from __future__ import annotations

import pytest

from eltctl.hosts import ignore
from eltctl.hosts.ignore import Rules, parse_line, parse_text

# (patterns, path, is_dir, excluded): each checked against git's gitignore(5) rules.
CASES = [
    # "*" matches within one name, at any depth when the pattern has no "/"
    (["*.log"], "train.log", False, True),
    (["*.log"], "out/deep/train.log", False, True),
    (["*.log"], "train.log.py", False, False),
    (["*.log"], "logs/x.txt", False, False),
    # "?" is one character, never "/"
    (["data?.bin"], "data1.bin", False, True),
    (["data?.bin"], "data12.bin", False, False),
    (["a?b"], "a/b", False, False),
    # [..] classes, negated with ! or ^
    (["run[0-9].txt"], "run7.txt", False, True),
    (["run[0-9].txt"], "runx.txt", False, False),
    (["run[!0-9].txt"], "runx.txt", False, True),
    (["run[^0-9].txt"], "run3.txt", False, False),
    # a leading "/" anchors at the workdir
    (["/hosts.toml"], "hosts.toml", False, True),
    (["/hosts.toml"], "sub/hosts.toml", False, False),
    (["hosts.toml"], "sub/hosts.toml", False, True),
    # a "/" in the middle anchors too
    (["data/raw"], "data/raw", True, True),
    (["data/raw"], "x/data/raw", True, False),
    # a trailing "/" matches directories only (and so everything inside)
    (["build/"], "build", True, True),
    (["build/"], "build", False, False),
    (["build/"], "build/lib/x.py", False, True),
    (["build/"], "src/build/x.py", False, True),
    # "*" never crosses "/"; "**" does
    (["docs/*.md"], "docs/a.md", False, True),
    (["docs/*.md"], "docs/sub/a.md", False, False),
    (["docs/**/*.md"], "docs/sub/deep/a.md", False, True),
    (["docs/**/*.md"], "docs/a.md", False, True),
    (["**/cache"], "cache", True, True),
    (["**/cache"], "a/b/cache", True, True),
    (["out/**"], "out/a/b.txt", False, True),
    (["out/**"], "outx/a.txt", False, False),
    # "!" re-includes; the last matching rule decides
    (["*.pt", "!keep.pt"], "keep.pt", False, False),
    (["*.pt", "!keep.pt"], "other.pt", False, True),
    (["!keep.pt", "*.pt"], "keep.pt", False, True),
    # ... but nothing inside an excluded directory comes back
    (["secret/", "!secret/ok.txt"], "secret/ok.txt", False, True),
    (["secret/*", "!secret/ok.txt"], "secret/ok.txt", False, False),
    # comments and blank lines match nothing; escapes make them literal
    (["# *.py", "", "   "], "train.py", False, False),
    (["\\#notes"], "#notes", False, True),
    (["\\!bang"], "!bang", False, True),
    # trailing spaces are dropped unless escaped
    (["name.txt   "], "name.txt", False, True),
    (["a\\ "], "a ", False, True),
    # an unclosed "[" in an ignore file is a literal "[" (as git)
    (["odd[name"], "odd[name", False, True),
]


@pytest.mark.parametrize("patterns, path, is_dir, excluded", CASES)
def test_gitignore_patterns(patterns, path, is_dir, excluded):
    rules = Rules(files=tuple(parse_text("\n".join(patterns), source="t")))
    assert rules.excluded(path, is_dir).excluded is excluded, (patterns, path)


def test_a_nested_ignore_files_rules_apply_below_its_directory_only():
    rules = Rules(files=tuple(parse_text("/cache\n*.tmp", base="sub", source="sub/.gitignore")))
    assert rules.excluded("sub/cache", True).excluded
    assert not rules.excluded("cache", True).excluded
    assert rules.excluded("sub/deep/x.tmp").excluded and not rules.excluded("x.tmp").excluded


@pytest.mark.parametrize("path, is_dir, why", [
    (".git", True, "version control"), (".venv", True, "a virtual environment"),
    (".venv-host", True, "a virtual environment"), ("pkg/__pycache__", True, "a cache"),
    ("pkg/mod.pyc", False, "a cache"), ("model.pt", False, "a model file"), ("notify.log", False, "a log"),
    ("job.prom", False, "a metrics file"),
])
def test_the_built_in_rules_leave_out_what_is_not_code(path, is_dir, why):
    verdict = Rules(first=ignore.builtin_rules()).excluded(path, is_dir)
    assert verdict.excluded and verdict.why.startswith(why)


def test_the_inventory_has_the_last_word_and_include_overrides_everything():
    files = tuple(parse_text("!*.pt\nnotes/", source=".eltctlignore"))
    rules = Rules(first=ignore.builtin_rules(), files=files,
                  exclude=ignore.compile_patterns(["init.pt"], "[job] exclude"),
                  include=ignore.compile_patterns(["big.bin", ".venv/"], "[job] include"), large=100)
    assert not rules.excluded("weights.pt").excluded  # the ignore file re-includes *.pt
    assert rules.excluded("init.pt").why == "[job] exclude"  # the inventory comes after it
    assert rules.excluded("notes/a.txt").excluded
    assert rules.excluded("huge.dat", size=101).why == "larger than 100 B"
    assert not rules.excluded("big.bin", size=10_000).excluded  # asked for: the size does not matter
    assert not rules.excluded(".venv/lib/big.so", size=10_000).excluded  # so is what a directory named holds
    assert not rules.excluded(".venv", True).excluded and not rules.excluded(".venv/x.py").excluded


def test_job_rules_name_the_jobs_own_files_inside_the_workdir_only(tmp_path):
    rules = Rules(first=ignore.job_rules(tmp_path, [(tmp_path / "hosts [1].toml", "the inventory"),
                                                    (tmp_path.parent / "elsewhere.toml", "the inventory"),
                                                    (tmp_path / "state", "the controller's state"), (None, "x")]))
    assert [r.source for r in rules.first] == ["the inventory", "the controller's state"]
    assert rules.excluded("hosts [1].toml").excluded and not rules.excluded("sub/hosts [1].toml").excluded
    assert rules.excluded("state/job/status.json").excluded


@pytest.mark.parametrize("pattern, says", [
    ("", "is empty"), ("  ", "is empty"), ("# x", "is a comment"), ("data[", "not closed"), ("/", "names no file"),
    ("!", "names no file"),
])
def test_check_pattern_names_what_is_wrong(pattern, says):
    assert says in (ignore.check_pattern(pattern) or "")


@pytest.mark.parametrize("pattern", ["data/", "*.bin", "!keep.bin", "/top.txt", "a/**/b", "[ab].txt"])
def test_check_pattern_accepts_gitignore_patterns(pattern):
    assert ignore.check_pattern(pattern) is None and parse_line(pattern, strict=True) is not None


def test_choose_walks_the_workdir_with_its_ignore_files(tmp_path):
    (tmp_path / "train.py").write_text("print()")
    (tmp_path / "hosts.toml").write_text("[notify]\nheaders = { Authorization = 'Bearer x' }\n")
    (tmp_path / "model.pt").write_bytes(b"x" * 10)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "big.bin").write_bytes(b"x" * 200)
    (tmp_path / "data" / "small.csv").write_text("1,2")
    (tmp_path / "data" / ".gitignore").write_text("*.csv\n")
    (tmp_path / ".eltctlignore").write_text("scratch/\n")
    (tmp_path / "scratch").mkdir()
    (tmp_path / "scratch" / "x.py").write_text("")
    rules = Rules(first=ignore.builtin_rules() + ignore.job_rules(tmp_path, [(tmp_path / "hosts.toml",
                                                                               "the inventory")]), large=100)
    sel = ignore.choose(tmp_path, rules)
    assert sorted(sel.files) == [".eltctlignore", "data/.gitignore", "train.py"]
    left = {p: why for p, _size, why in sel.left_out}
    assert left == {".git/": "version control", "scratch/": ".eltctlignore:1", "hosts.toml": "the inventory",
                    "model.pt": "a model file", "data/big.bin": "larger than 100 B",
                    "data/small.csv": "data/.gitignore:1"}
    said = ignore.describe(sel)
    assert said[0] == (False, "code for each host: 3 files, 22 B; left out: scratch/ (.eltctlignore:1), "
                              "hosts.toml (the inventory), model.pt (a model file), "
                              "data/small.csv (data/.gitignore:1)")
    assert said[1][0] and "data/big.bin (200 B)" in said[1][1] and "[job] include" in said[1][1]


def test_describe_warns_when_the_commands_script_is_left_out(tmp_path):
    (tmp_path / "train.py").write_text("")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "run.py").write_text("")
    (tmp_path / ".gitignore").write_text("train.py\nlib/\n")
    sel = ignore.choose(tmp_path, Rules())
    for needed, why in (("./train.py", ".gitignore:1"), ("lib/run.py", ".gitignore:2")):
        warnings = [text for warn, text in ignore.describe(sel, needed=[needed]) if warn]
        assert warnings == [f"the command's script {needed.removeprefix('./')} is not sent to the hosts "
                            f"(left out by {why}): the workers cannot start; name it (or the directory left "
                            "out) in [job] include"]
    assert [w for w, _t in ignore.describe(sel, needed=[".gitignore"])] == [False]
