"""How long `eltctl down --force` takes once every host is lost, with a mirror that cannot
work and with one that works (issue 24).

On the sshd test bed, two simulated hosts (2 GPUs each, CPU workers) that log in as
accounts of their own (`add_host(login=True)`), this machine as root:

- `dir`: `[storage] mirror` a directory root can write and the hosts' accounts cannot
  (root-owned, 0755). `up --ignore-mirror-check` (plain `up` where that option does
  not exist: the code before the fix) starts it anyway; once a copy has failed, both
  hosts crash and `down --force` is timed;
- `ssh`: an ssh:// mirror on a third simulated host; once a checkpoint is mirrored,
  both hosts crash and `down --force` is timed, with the step `down` names.

    python benchmarks/mirror_down.py [--eltctl-path DIR] [--json]

`--eltctl-path DIR` runs the CLI (and so the controller and the runtime it ships)
from another checkout, e.g. a worktree of main, to compare. Figures are wall-clock
seconds on this machine; the test bed's `connect_timeout` is 5 s.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.testbed import make_testbed  # noqa: E402
from tests.testbed.jobenv import job_env_on, wait_for  # noqa: E402


def scenario(kind: str, eltctl_path: str | None) -> dict:
    with make_testbed() as bed:
        h1, h2 = bed.add_hosts(2, login=True)
        if kind == "dir":
            mirror = bed.dir / "shared-mirror"
            mirror.mkdir()
            mirror.chmod(0o755)
            spec = str(mirror)
        else:
            store = bed.add_host("store")
            spec = f"ssh://{bed.user}@{store.address}:{store.port}{store.dir / 'home' / 'mirror'}"
        gen = job_env_on(bed, [h1, h2], extra=f'\n[storage]\nmirror = "{spec}"\n')
        env = next(gen)
        try:
            if eltctl_path:
                env.env["PYTHONPATH"] = eltctl_path
            has_flag = "--ignore-mirror-check" in env.eltctl("up", "--help").stdout
            args = ["up", "--timeout", "180"] + (["--ignore-mirror-check"] if has_flag and kind == "dir" else [])
            env.eltctl(*args)
            env.training_at(4, timeout=180)
            if kind == "dir":
                wait_for(lambda: ((env.status().get("mirror") or {}).get("failures") or 0) >= 1, 120,
                         "a failed copy to the mirror")
            else:
                wait_for(lambda: (env.status().get("mirror") or {}).get("step"), 120, "a mirrored checkpoint")
            before = env.status().get("mirror") or {}
            for h in (h1, h2):
                h.crash()
            t0 = time.monotonic()
            down = env.eltctl("down", "--force", timeout=600, check=False)
            took = time.monotonic() - t0
            text = " ".join(down.stdout.split())
            named = re.search(r"(?:step|final checkpoint step) (\d+)[^.]*?(?:mirror|mirrored)", text)
            return {"kind": kind, "mirror": spec, "down_s": round(took, 1), "exit": down.returncode,
                    "failures_before": before.get("failures"), "mirrored_before": before.get("step"),
                    "problem_before": (before.get("problem") or {}).get("kind"),
                    "named_step": int(named.group(1)) if named else None,
                    "mirror_lines": [ln for ln in down.stdout.splitlines() if "mirror" in ln][:3]}
        finally:
            gen.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eltctl-path", help="run the CLI from this checkout (PYTHONPATH)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--kinds", default="dir,ssh")
    a = ap.parse_args()
    if a.eltctl_path:
        import os
        os.chdir(a.eltctl_path)  # `python -m eltctl` puts its working directory first on sys.path
    results = [scenario(k, a.eltctl_path) for k in a.kinds.split(",")]
    if a.json:
        print(json.dumps(results, indent=1))
        return
    for r in results:
        print(f"{r['kind']:4} down --force with both hosts lost: {r['down_s']:6.1f} s (exit {r['exit']}); "
              f"before: {r['failures_before']} failed copies, mirrored step {r['mirrored_before']}, "
              f"problem {r['problem_before']}; down names step {r['named_step']}")
        for line in r["mirror_lines"]:
            print(f"       {line}")


if __name__ == "__main__":
    main()
