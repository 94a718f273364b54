"""List the job's code on a host: `python -c <this> ROOT EXCLUDED_DIRS SUFFIXES`.

Prints one JSON line `{relative path: sha256}` of every file under ROOT, skipping the
directories named in EXCLUDED_DIRS and the files ending in SUFFIXES (both JSON lists).
A missing ROOT lists as `{}`. Standard library only.
"""

import hashlib
import json
import os
import sys


def manifest(root, excluded, suffixes):
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in excluded]
        for f in files:
            if f.endswith(suffixes):
                continue
            p = os.path.join(d, f)
            try:
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
            except OSError:
                pass
    return out


def main(argv):
    root, excluded, suffixes = argv[0], set(json.loads(argv[1])), tuple(json.loads(argv[2]))
    print(json.dumps(manifest(root, excluded, suffixes)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
