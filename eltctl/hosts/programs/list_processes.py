"""List a job's processes on a host: `python -c <this> JOB HOST [CONTROL]`.

Prints one JSON line `[[pid, command line], ...]`: every process whose environment
holds `ELTCTL_JOB=<JOB>` and, when it has `ELTCTL_HOST`, names HOST (several
inventory hosts may share a machine) and, when it has `ELTCTL_CONTROL` and CONTROL
is given, names CONTROL (another control machine's job of the same name is not
ours). Read from /proc. Standard library only.
"""

import json
import os
import sys


def job_processes(job, host, control=b""):
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open("/proc/%s/environ" % name, "rb") as f:
                env = f.read().split(b"\0")
            with open("/proc/%s/cmdline" % name, "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            continue
        if b"ELTCTL_JOB=" + job not in env:
            continue
        hosts = [e[len(b"ELTCTL_HOST="):] for e in env if e.startswith(b"ELTCTL_HOST=")]
        if hosts and hosts[0] != host:
            continue  # another inventory host sharing this machine
        controls = [e[len(b"ELTCTL_CONTROL="):] for e in env if e.startswith(b"ELTCTL_CONTROL=")]
        if control and controls and controls[0] != control:
            continue  # the same job name run from another control machine
        out.append([int(name), cmd])
    return out


def main(argv):
    print(json.dumps(job_processes(argv[0].encode(), argv[1].encode(), argv[2].encode() if len(argv) > 2 else b"")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
