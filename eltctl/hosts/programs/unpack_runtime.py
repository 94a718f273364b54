"""Unpack the runtime on a host: `python -c <this> TARGET` with a base64 tar.gz on stdin.

The files are written into a temporary directory beside TARGET (as
TARGET/eltctl_runtime/<relative path>, subdirectories created) and the directory is
renamed into place: a half-sent runtime is never used. An existing TARGET is kept
(the hash in its name says it holds the same files). Standard library only.

stdin is read to its end first, even when TARGET exists: two controllers ship the
same runtime to a host at once (two jobs on one lab), and the one that finds TARGET
made meanwhile must not exit before the sender is done. Over SSH, a command that
ends (and closes its channel) before the sender writes its input fails the sender
with "Channel not open for sending", counted as a failure of the host.
"""

import base64
import io
import os
import shutil
import sys
import tarfile
import tempfile

PACKAGE = "eltctl_runtime"


def unpack(data, root):
    """Write every member of the tar.gz `data` under `root`; refuse anything but plain files."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = tar.getmembers()
        for m in members:
            if not m.isfile() or m.name.startswith("/") or ".." in m.name.split("/"):
                sys.exit("unsafe member " + m.name)
        for m in members:
            dest = os.path.join(root, *m.name.split("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "wb") as fh:
                fh.write(tar.extractfile(m).read())
            os.chmod(dest, 0o644)


def main(argv):
    target = argv[0]
    data = sys.stdin.read()  # all of it, before any early exit (the module docstring)
    if os.path.isdir(target):
        return 0
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".incoming-")
    unpack(base64.b64decode(data), os.path.join(tmp, PACKAGE))
    try:
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another controller was faster
        if not os.path.isdir(target):
            raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
