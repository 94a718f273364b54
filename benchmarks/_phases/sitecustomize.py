"""Per-phase timestamps of a resize pause, for benchmarks/control_plane.py --phases.

Put on PYTHONPATH (as `sitecustomize`) of the workers with ELTCTL_PHASES=<dir>: each
worker appends JSON lines `{"t": time.time(), "pid", "mark", ...}` to <dir>/<pid>.jsonl
at the marks of a membership change. It wraps the runtime's functions from outside, so
the same marks are taken in this tree and in an older checkout (which has no such log):
the older runtime is not modified. Marks (each where present in the tree):

  change        ElasticJob._planned_change entered (a planned change at a boundary)
  dropped       ElasticJob._drop_step: the training thread saw the generation abort
  abort_set     ControlThread._set_abort: the control thread saw a death/hang/abort key
  recover       ElasticJob._recover entered (the roll call)
  decided       membership.decide returned (the next plan is known)
  admitted      await_admission returned (a joiner is named by a plan)
  group_start / group_end   collectives.make_group (the gloo rendezvous over the store)
  pairs_end     collectives.verify_pairs returned (the signed pair handshake)
  sync_start / sync_end     ElasticJob._sync_state (the state agreement and transfer)
  commit        ElasticJob._commit: the first commit of each generation
  store_ops     at group_end: the rendezvous store calls made while the group formed
                (this tree's PgStore only: count and seconds per operation)
"""

import functools
import importlib.abc
import json
import os
import sys
import threading
import time

_DIR = os.environ.get("ELTCTL_PHASES", "")
_LOCK = threading.Lock()
_OPS = {}  # op -> [count, seconds] while a group forms


def _mark(mark, **extra):
    line = json.dumps({"t": time.time(), "pid": os.getpid(), "mark": mark, **extra}) + "\n"
    with _LOCK:
        with open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(line)


def _around(fn, start, end=None):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        if start:
            _mark(start)
        out = fn(*a, **kw)
        if end:
            _mark(end)
        return out
    return wrapper


def _timed_op(name, fn):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            c = _OPS.setdefault(name, [0, 0.0])
            c[0] += 1
            c[1] += time.perf_counter() - t
    return wrapper


def _patch(name, mod):
    if name.endswith(".collectives"):
        mg = mod.make_group

        def make_group(*a, **kw):
            _OPS.clear()
            _mark("group_start")
            pg = mg(*a, **kw)
            _mark("group_end", ops={k: [v[0], round(v[1], 5)] for k, v in _OPS.items()})
            return pg
        mod.make_group = make_group
        for fn in ("release", "bury", "run_abortable"):
            if hasattr(mod, fn):
                setattr(mod, fn, _around(getattr(mod, fn), f"{fn}_start", f"{fn}_end"))
        if hasattr(mod, "verify_pairs"):
            mod.verify_pairs = _around(mod.verify_pairs, "pairs_start", "pairs_end")
    elif name.endswith(".control"):
        cls = mod.ControlThread
        cls.watch = _around(cls.watch, "watch_start", "watch_end")
        if hasattr(cls, "_set_abort"):
            cls._set_abort = _around(cls._set_abort, "abort_set")
    elif name.endswith(".member.plan"):
        mod.decide = _around(mod.decide, None, "decided")
        mod.await_admission = _around(mod.await_admission, None, "admitted")
    elif name.endswith(".pgstore"):
        for op in ("set", "get", "check", "wait", "add", "compare_set", "multi_get", "multi_set"):
            if hasattr(mod.PgStore, op):
                setattr(mod.PgStore, op, _timed_op(op, getattr(mod.PgStore, op)))
    elif name.endswith(".generation") or name.endswith(".job"):
        from eltctl_runtime.member import plan as membership
        for n in ("decide", "await_admission"):
            if hasattr(mod, n):
                setattr(mod, n, getattr(membership, n))
        if name.endswith(".generation"):
            mod.Generations.enter = _around(mod.Generations.enter, "enter")
        if name.endswith(".job"):
            cls = mod.ElasticJob
            # (no `switch` mark: ElasticJob._switch went in 6261e63, before the module paths above
            # existed; entering a generation is Generations.enter, marked `enter`)
            if hasattr(cls, "_before_group"):
                cls._before_group = _around(cls._before_group, "before_group", "before_group_end")
            cls._planned_change = _around(cls._planned_change, "change")
            cls._drop_step = _around(cls._drop_step, "dropped")
            cls._recover = _around(cls._recover, "recover")
            cls._sync_state = _around(cls._sync_state, "sync_start", "sync_end")
            commit = cls._commit

            last = [None]

            def _commit(self, *a, **kw):
                out = commit(self, *a, **kw)
                if self.generation != last[0]:  # the first commit of each generation
                    last[0] = self.generation
                    _mark("commit", generation=self.generation, step=self._step)
                return out
            cls._commit = _commit


_TARGETS = {f"eltctl_runtime.{m}" for m in ("member.collectives", "member.control", "member.plan", "store.pgstore",
                                             "member.generation", "train.job")}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *_: None)(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                exec_module(module)
                _patch(name, module)
        spec.loader = _Loader()
        return spec


if _DIR:
    sys.meta_path.insert(0, _Finder())
