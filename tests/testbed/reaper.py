"""The test bed's dead man's switch: cleans up after a test process that died.

`Testbed.start()` runs this script as a separate process (its own session) with
a pipe on stdin that only the test process holds. When the pipe reaches EOF,
because `close()` closed it or because the test process was killed (a pytest
timeout, Ctrl-C, SIGKILL), it kills whatever the test bed left running (the
sshd listeners named in each host's sshd.pid and their connections, every
process whose environment names a state file of this bed, and the foreign
processes registered in the state files) and removes the directory.

Usage: python3 -IS reaper.py BED_DIR   (standard library only)
"""

import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import procs  # noqa: E402  (the sibling module, loaded without the package)


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def sweep(bed_dir):
    bed = bed_dir.rstrip("/") + "/"
    for host in sorted(os.listdir(bed_dir)):
        host_dir = os.path.join(bed_dir, host)
        try:
            with open(os.path.join(host_dir, "sshd.pid")) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            pid = None
        # The pid file may be stale: only a process running this bed's config is ours.
        if pid and bed.encode() in _cmdline(pid):
            procs.kill_pids([*procs.descendants(pid), pid])
        try:
            with open(os.path.join(host_dir, "gpus.json"), encoding="utf-8") as f:
                registered = json.load(f).get("processes", [])
        except (OSError, ValueError):
            registered = []
        for entry in registered:
            start = entry.get("starttime")
            # Same pid and same start time: still the process the test bed started.
            if start is not None and procs.process_starttime(entry["pid"]) == start:
                procs.kill_pids([entry["pid"]])
    procs.kill_host_processes(bed, prefix=True)


def main(argv):
    bed_dir = argv[0]
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except OSError:
        pass
    if os.path.isdir(bed_dir):
        sweep(bed_dir)
        shutil.rmtree(bed_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
