"""Check a training script's top-level imports on a host without running it:
`python -c <this> LOCAL PATHS < script.py`.

Compiles the script read from stdin (a syntax error of this interpreter is reported
with its line), then resolves the imports of its leading import block with
importlib.util.find_spec, which finds a module without importing it (nothing of the
script or of its packages runs). Only the leading block: an import after other code
may depend on it (a sys.path edit), and an import inside try/if is optional by design.
LOCAL (a JSON list) names the modules beside the script in the job's workdir, which the
host has once the code is synced; PATHS (a JSON list) the job's extra PYTHONPATH.
Prints one JSON line: {"python", "checked", "missing": [[module, line], ...]} or
{"python", "syntax": {"line", "message"}}. Standard library only, Python 3.8+.
"""

import ast
import importlib.util
import json
import sys


def leading_imports(tree):
    """(top-level module, line) of each absolute import before the first other statement."""
    out = []
    for i, node in enumerate(tree.body):
        if isinstance(node, ast.Import):
            out += [(a.name.split(".")[0], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module != "__future__":
                out.append((node.module.split(".")[0], node.lineno))
        elif i == 0 and isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None), ast.Constant):
            continue  # the docstring
        else:
            break
    return out


def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return True  # a module that cannot be looked up this way: not reported


def main(argv):
    local, paths = set(json.loads(argv[0])), json.loads(argv[1])
    # `python -c` puts the current directory (the login's home) first: the worker has its own
    sys.path[:] = [p for p in sys.path if p not in ("", ".")]
    sys.path[:0] = paths
    source = sys.stdin.buffer.read()
    version = "%d.%d.%d" % sys.version_info[:3]
    try:
        tree = compile(source, "<script>", "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
        compile(tree, "<script>", "exec", dont_inherit=True)
    except SyntaxError as e:
        print(json.dumps({"python": version, "syntax": {"line": e.lineno, "message": e.msg}}))
        return 0
    imports = leading_imports(tree)
    missing, seen = [], set()
    for name, line in imports:
        if name not in seen and name not in local and not found(name):
            missing.append([name, line])
        seen.add(name)
    print(json.dumps({"python": version, "checked": len(imports), "missing": missing}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
