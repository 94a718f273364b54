"""Apply a code sync on a host: `python -c <this> ROOT` with a JSON document on stdin.

The document is `{"delete": [relative path, ...], "tar": base64 tar.gz or ""}`: the
files to delete (only inside ROOT), then the files to write, each written beside its
place and renamed over it. Standard library only.
"""

import base64
import io
import json
import os
import sys
import tarfile


def apply(root, doc):
    os.makedirs(root, exist_ok=True)
    for rel in doc["delete"]:
        p = os.path.join(root, rel)
        if os.path.commonpath([os.path.realpath(p), os.path.realpath(root)]) == os.path.realpath(root):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
    if not doc["tar"]:
        return
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(doc["tar"])), mode="r:gz") as tar:
        for m in tar.getmembers():
            if not m.isfile() or m.name.startswith("/") or ".." in m.name.split("/"):
                sys.exit("unsafe member " + m.name)
        for m in tar.getmembers():
            dest = os.path.join(root, m.name)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            tmp = dest + ".eltctl-tmp"
            with open(tmp, "wb") as fh:
                fh.write(tar.extractfile(m).read())
            os.chmod(tmp, m.mode & 0o700)  # private, as everything of the job on a host
            os.replace(tmp, dest)


def main(argv):
    apply(argv[0], json.loads(sys.stdin.read()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
