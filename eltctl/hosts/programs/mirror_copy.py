"""Copy, verify and publish one checkpoint in one run on the host that sees both paths.

This file is not imported on the hosts: `eltctl.mirror` sends its source text with
`python -c` (`eltctl.hosts.programs.command`) to the host that does the copying (the
host holding the checkpoint for a shared-directory mirror; the mirror host after an
ssh:// relay), so it uses the standard library only and works on any Python 3.8+.

    python -c <this file> copy    SRC  PARENT STEPNAME TMPNAME EXPECTED
    python -c <this file> publish -    PARENT STEPNAME TMPNAME EXPECTED
    python -c <this file> sums    DIR  NAME...
    python -c <this file> probe   PARENT TMPNAME

`copy`: if PARENT/STEPNAME already holds a copy whose manifest and files match
EXPECTED, keep it. Otherwise copy every file of SRC into the new directory
PARENT/TMPNAME, hashing each byte as it is written (a hashing thread runs beside the
copy, so the copy costs about max(copy, hash), not their sum), fsync, compare with
EXPECTED, then rename into place: the old PARENT/STEPNAME, if any, is set aside
first and removed after. A reader of PARENT never sees a partial checkpoint.
`publish`: PARENT/TMPNAME was filled by someone else (a tar stream); hash it,
compare, fsync, rename as above.

EXPECTED is JSON: {"files": [[name, size, sha256], ...], "manifest": sha256 of
manifest.json, "manifest_name": "manifest.json"}: what the SOURCE's manifest says,
read by the controller, so the copy is checked against the source, not itself.

`sums`: fsync and hash DIR/NAME for each NAME, printing `sha256  NAME` lines as
`sha256sum` does (a file that cannot be read is left out, which the caller reports
as missing); exit 0.

`probe` (`eltctl doctor`, `eltctl up`: can this host's account use the mirror?): make
PARENT/TMPNAME as a copy would, write a file into it, fsync, rename it there, create
and remove another; the directory is left for the controller, which reads, renames
and removes it. Prints
{"ok", "user", "uid", "problem", "errno"}.

copy and publish print one JSON line: {"ok", "kept", "sums", "problem", "source_gone", "bytes"};
exit 0 when published or kept, 3 when the source is gone, 4 when the copy does not
verify (the temporary directory is then removed). An OS error (permission, no space, a
missing path) is answered, not raised: exit 5 and {"ok": false, "problem", "errno"},
`errno` its name ("EACCES"), from which the controller tells a permanent failure from
one worth retrying.

A group-shared mirror (PARENT group-writable, as docs/checkpoints.md sets one up for
hosts whose accounts differ): what is created is made group-writable (directories
2770, files 0660), so the other accounts of the group can verify, sign, rename and
remove it. Elsewhere the account's umask applies, as before.
"""

import errno
import hashlib
import json
import os
import stat
import queue
import shutil
import sys
import threading
import uuid

CHUNK = 1 << 20
BUFFERS = 4


class Problem(Exception):
    pass


def _hash_pipeline(read_into, write):
    """sha256 of everything `read_into` yields, `write` called on each chunk.

    The hashing runs in a second thread (hashlib releases the GIL on large buffers),
    so reading and writing chunk k+1 overlap hashing chunk k. Returns (hex, bytes)."""
    h = hashlib.sha256()
    free = queue.Queue()
    for _ in range(BUFFERS):
        free.put(bytearray(CHUNK))
    work = queue.Queue()

    def hasher():
        while True:
            item = work.get()
            if item is None:
                return
            buf, n = item
            h.update(memoryview(buf)[:n])
            free.put(buf)

    t = threading.Thread(target=hasher, daemon=True)
    t.start()
    total = 0
    try:
        while True:
            buf = free.get()
            n = read_into(buf)
            if not n:
                free.put(buf)
                break
            if write is not None:
                write(memoryview(buf)[:n])
            total += n
            work.put((buf, n))
    finally:
        work.put(None)
        t.join()
    return h.hexdigest(), total


def hash_file(path, fsync=False):
    with open(path, "rb") as f:
        result = _hash_pipeline(f.readinto, None)
        if fsync:
            os.fsync(f.fileno())
        return result


def group_shared(parent):
    """Whether PARENT is a group-shared mirror directory (group-writable)."""
    try:
        return bool(os.stat(parent).st_mode & stat.S_IWGRP)
    except OSError:
        return False


def make_tmp_dir(parent, tmp):
    """mkdir PARENT/TMP; group-writable (setgid) in a group-shared mirror. True: shared."""
    os.mkdir(tmp)
    shared = group_shared(parent)
    if shared:
        os.chmod(tmp, 0o2770)
    return shared


def copy_file(src, dst, shared=False):
    with open(src, "rb") as f, open(dst, "xb") as g:
        if shared:
            os.fchmod(g.fileno(), 0o660)
        def write(view):
            while view:
                n = g.write(view)
                view = view[n:]
        digest, total = _hash_pipeline(f.readinto, write)
        g.flush()
        os.fsync(g.fileno())
        if os.fstat(g.fileno()).st_size != total:
            raise Problem("%s: short write" % dst)
    return digest, total


def fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory
    finally:
        os.close(fd)


def check(expected, sums, sizes):
    for name, size, sha in expected["files"]:
        if name not in sums:
            return "%s is missing" % name
        if sizes.get(name) != size:
            return "%s has %s bytes, the manifest says %d" % (name, sizes.get(name), size)
        if sums[name] != sha:
            return "%s sha256 %s... differs from the manifest's %s..." % (name, sums[name][:12], sha[:12])
    mname = expected["manifest_name"]
    if sums.get(mname) != expected["manifest"]:
        return "%s of the copy differs from the source's" % mname
    return None


def names_of(expected):
    return [e[0] for e in expected["files"]] + [expected["manifest_name"]]


def verify_dir(path, expected):
    sums, sizes = {}, {}
    for name in names_of(expected):
        try:
            sums[name], sizes[name] = hash_file(os.path.join(path, name))
        except OSError:
            continue  # gone, unreadable or a stale NFS handle: missing, which check() reports
    return sums, sizes, check(expected, sums, sizes)


def publish(parent, stepname, tmp):
    final = os.path.join(parent, stepname)
    aside = os.path.join(parent, ".tmp-replaced-" + uuid.uuid4().hex[:12])
    fsync_dir(tmp)
    try:
        os.rename(final, aside)
    except FileNotFoundError:
        pass  # no copy of this step yet (or it went meanwhile)
    os.rename(tmp, final)
    fsync_dir(parent)
    if os.path.lexists(aside):
        shutil.rmtree(aside, ignore_errors=True)


def run(mode, src, parent, stepname, tmpname, expected):
    out = {"ok": False, "kept": False, "sums": {}, "problem": None, "source_gone": False, "bytes": 0}
    tmp = os.path.join(parent, tmpname)
    final = os.path.join(parent, stepname)
    mname = expected["manifest_name"]
    if mode == "copy":
        if not os.path.isfile(os.path.join(src, mname)):
            out["source_gone"] = True
            out["problem"] = "No such file: %s" % os.path.join(src, mname)
            return out, 3
        os.makedirs(parent, exist_ok=True)
        if os.path.isdir(final):
            sums, sizes, problem = verify_dir(final, expected)
            if problem is None:
                out.update(ok=True, kept=True, sums=sums)
                return out, 0
        shared = make_tmp_dir(parent, tmp)
        sums, sizes = {}, {}
        try:
            for name in names_of(expected):
                try:
                    sums[name], sizes[name] = copy_file(os.path.join(src, name), os.path.join(tmp, name), shared)
                except FileNotFoundError as exc:
                    if exc.filename and exc.filename.startswith(src):
                        out["source_gone"] = True
                        out["problem"] = "No such file: %s" % exc.filename
                        shutil.rmtree(tmp, ignore_errors=True)
                        return out, 3
                    raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    else:
        sums, sizes = {}, {}
        for name in names_of(expected):
            p = os.path.join(tmp, name)
            if os.path.isfile(p):
                sums[name], sizes[name] = hash_file(p, fsync=True)
    out["sums"] = sums
    out["bytes"] = sum(sizes.values())
    problem = check(expected, sums, sizes)
    if problem is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        out["problem"] = problem
        return out, 4
    publish(parent, stepname, tmp)
    out["ok"] = True
    return out, 0


def idle_priority():
    """Run at SCHED_IDLE where Linux has it (before any thread starts: threads inherit
    it): the copy takes CPU training leaves idle, and little else (the command line
    also runs it under `nice -n 19`, and `ionice -c 3` where present)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def print_sums(directory, names):
    for name in names:
        try:
            digest, _size = hash_file(os.path.join(directory, name), fsync=True)
        except OSError:
            continue
        sys.stdout.write("%s  %s\n" % (digest, name))
    return 0


def os_failure(exc):
    """An OSError as the answer's fields: what failed, and the errno's name."""
    return {"ok": False, "problem": "%s: %s" % (type(exc).__name__, exc),
            "errno": errno.errorcode.get(exc.errno) if exc.errno else None}


def probe(parent, tmpname):
    """Can this account use PARENT as a copy does? (see the module's docstring)"""
    out = {"ok": False, "problem": None, "errno": None, "uid": os.getuid(), "user": str(os.getuid())}
    try:
        import pwd
        out["user"] = pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        pass
    tmp = os.path.join(parent, tmpname)
    try:
        shared = make_tmp_dir(parent, tmp)
        with open(os.path.join(tmp, ".probe"), "xb") as g:
            if shared:
                os.fchmod(g.fileno(), 0o660)
            g.write(b"eltctl mirror probe\n")
            g.flush()
            os.fsync(g.fileno())
        os.rename(os.path.join(tmp, ".probe"), os.path.join(tmp, "probe"))
        with open(os.path.join(tmp, ".gone"), "xb"):
            pass
        os.unlink(os.path.join(tmp, ".gone"))  # what a copy removes (a replaced step, a failed copy)
        fsync_dir(tmp)
    except OSError as exc:
        out.update(os_failure(exc))
        return out, 5
    out["ok"] = True
    return out, 0


def main(argv):
    idle_priority()
    if argv[:1] == ["sums"]:
        return print_sums(argv[1], argv[2:])
    if argv[:1] == ["probe"]:
        if len(argv) != 3 or "/" in argv[2] or not argv[2].startswith(".tmp-"):
            sys.exit("usage: probe PARENT .tmp-NAME")
        out, code = probe(argv[1], argv[2])
    else:
        mode, src, parent, stepname, tmpname, expected = argv[:6]
        if mode not in ("copy", "publish"):
            sys.exit("mode must be copy or publish, not %r" % mode)
        if "/" in stepname or "/" in tmpname or not tmpname.startswith(".tmp-"):
            sys.exit("bad names %r %r" % (stepname, tmpname))
        try:
            out, code = run(mode, src, parent, stepname, tmpname, json.loads(expected))
        except OSError as exc:
            out, code = os_failure(exc), 5
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
