"""The probe's look at a host's shared claims directory, and what it refuses there.

The claims directory (runtime/claims.py: `/tmp/eltctl-gpus`, mode 1777) is shared by
every account on a host, so whatever the probe prints from it is written by anyone
(issue 49). The probe's two sections here (`claims_section`, `demand_section`, POSIX
sh run inside eltctl/probe.py's script) therefore print only names in the strict set
(`SAFE_CHARS`; any other name prints as `!odd` with its owner and in hex, never itself), each
entry with its owner (`stat -c '%u %U'`), read without blocking or following a link
(`dd iflag=nonblock,nofollow`), content on one line after the name: nothing echoed
can start a line, and the sections' marker is random per probe (eltctl/probe.py).

The parser (`parse_claims`, `parse_demands`) applies runtime/claims.py's one rule
(`judge`, as the host daemon does) to each entry with the owner the probe printed:
what it refuses is kept (`Refusal`: file, owner, reason) for `eltctl probe --json`,
`eltctl lab` and status. `refused_of_state` reads the same from a daemon's state
document. Pure, but for the script text.
"""

from __future__ import annotations

from typing import Any, Iterable

from eltctl_runtime.claims import (ALTERNATES, DEFAULT_DIR, ENV, SAFE_CHARS, Claim, Refusal, dir_problem, judge,
                                   is_legacy, json_object, judge_owner, parse_name, shown_name)
from eltctl.demand import Demand

_SH_SAFE = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._@~-"  # SAFE_CHARS, locale-free
assert SAFE_CHARS == "A-Za-z0-9._@~-"

# Shell helpers both sections use: `own F` (uid and account of F's owner, itself, not a
# link's target), `hex S` (S's first 120 bytes in hex: a name outside the strict set
# travels so, never as itself), `rd F N` (at most N bytes of F on one line, never
# blocking on a FIFO).
HELPERS = f"""\
cdir="${{{ENV}:-{DEFAULT_DIR}}}"
safe='{_SH_SAFE}'
own() {{ stat -c '%u %U' -- "$1" 2>/dev/null || echo '? ?'; }}
hex() {{ printf '%s' "$1" | head -c 120 | od -An -v -tx1 2>/dev/null | tr -d ' \n'; }}
if command -v timeout >/dev/null 2>&1; then t2="timeout -k 1 2"; else t2=""; fi
if dd if=/dev/null of=/dev/null count=0 iflag=nonblock,nofollow 2>/dev/null; then
  rd() {{ $t2 dd if="$1" bs="$2" count=1 iflag=nonblock,nofollow 2>/dev/null | tr -d '\\n\\r'; }}
else
  rd() {{ [ -h "$1" ] || $t2 head -c "$2" -- "$1" 2>/dev/null | tr -d '\\n\\r'; }}
fi
"""


def claims_section() -> str:
    """The script's `claims` section: first `!dir MYUID UID ACCOUNT MODEHEX` (the directory's
    owner and st_mode, `!dir -` when it is missing), then per claim file of the strict set
    `NAME UID ACCOUNT HELD PIDOK CONTENT` (HELD: 1 a lock is held, 0 not, 2 unknown: no
    `flock`; PIDOK: 1 when the content's pid is a live process of the file's owner;
    CONTENT only for a held file), `!odd UID ACCOUNT HEX` for another name, `!notfile NAME UID
    ACCOUNT` for a link, FIFO, directory... The lock is tried in a child shell under
    `timeout` (a file swapped for a FIFO after the check blocks only that child, 2 s),
    opening without O_CREAT (a file gone meanwhile is never made under another's name)."""
    return f"""\
echo "${{m}}claims"
{HELPERS}if [ -d "$cdir" ]; then echo "!dir $(id -u) $(stat -c '%u %U %f' -- "$cdir" 2>/dev/null)"; else echo "!dir -"; fi
for f in "$cdir"/gpu* "$cdir"/cpu*; do
  [ -e "$f" ] || [ -h "$f" ] || continue
  n=${{f##*/}}
  case "$n" in *[!$safe]*) echo "!odd $(own "$f") $(hex "$n")"; continue ;; esac
  if [ -h "$f" ] || [ ! -f "$f" ]; then echo "!notfile $n $(own "$f")"; continue; fi
  o=$(own "$f")
  h=2
  if command -v flock >/dev/null 2>&1; then
    h=0
    $t2 sh -c 'exec 9<"$1" && flock -n -s -E 75 9' _ "$f" 2>/dev/null
    [ $? -eq 75 ] && h=1
  fi
  c=""; p=0
  if [ "$h" != 0 ]; then
    c=$(rd "$f" 2000)
    cpid=$(printf '%s' "$c" | sed -n 's/.*"pid": *\\([0-9][0-9]*\\).*/\\1/p')
    if [ -n "$cpid" ] && [ "$(stat -c %u "/proc/$cpid" 2>/dev/null)" = "${{o%% *}}" ]; then p=1; fi
  fi
  echo "$n $o $h $p $c"
done
"""


def demand_section() -> str:
    """The script's `demand` section: the host's clock, then (when the fifth argument, this
    job's demand as JSON, is given) that demand written atomically to
    `<claims dir>/demand.<user>.<job>` with `user` and `time` added (a name another account
    holds is reported, `!squatted NAME UID ACCOUNT`, and its alternates `~1`..`~3` are
    used), then `NAME UID ACCOUNT CONTENT` for every demand file of the strict set there
    (`!odd`/`!notfile` as in `claims_section`)."""
    alts = " ".join(['""'] + [f'"~{i}"' for i in range(1, ALTERNATES + 1)])
    return f"""\
echo "${{m}}demand"
now=$(date +%s)
echo "$now"
{HELPERS}if [ -n "$5" ]; then
  [ -d "$cdir" ] || {{ mkdir -m 1777 "$cdir" 2>/dev/null && chmod 1777 "$cdir" 2>/dev/null; }}
  u=$(id -un 2>/dev/null)
  dn="demand.$u.$1"
  w=""
  for a in {alts}; do
    d="$cdir/$dn$a"
    if [ -e "$d" ] || [ -h "$d" ]; then
      if [ -h "$d" ] || [ ! -f "$d" ] || [ ! -O "$d" ]; then echo "!squatted $dn$a $(own "$d")"; continue; fi
    fi
    dt=$(mktemp "$cdir/.demand.XXXXXXXX" 2>/dev/null) || break
    if printf '{{"user": "%s", "time": %s, %s\\n' "$u" "$now" "${{5#?}}" >"$dt" 2>/dev/null \\
       && chmod 644 "$dt" && mv -f "$dt" "$d" 2>/dev/null; then w=1; else rm -f "$dt"; fi
    break
  done
  [ -n "$w" ] || echo "!cannot write $cdir/$dn"
fi
for f in "$cdir"/demand.*; do
  [ -e "$f" ] || [ -h "$f" ] || continue
  n=${{f##*/}}
  case "$n" in *[!$safe]*) echo "!odd $(own "$f") $(hex "$n")"; continue ;; esac
  if [ -h "$f" ] || [ ! -f "$f" ]; then echo "!notfile $n $(own "$f")"; continue; fi
  echo "$n $(own "$f") $(rd "$f" 4000)"
done
"""


# --------------------------------------------------------------------------- parsing (pure)

def _bang(line: str, refused: list[Refusal]) -> bool:
    """Whether `line` is a `!` line of the listing (a refused entry); its refusal, if
    it names one, is added to `refused`."""
    if not line.startswith("!"):
        return False
    r = _refusal_of_bang(line)
    refused.extend([r] if r else [])
    return True


def _refusal_of_bang(line: str) -> Refusal | None:
    """`!odd UID ACCOUNT HEX`, `!notfile NAME UID ACCOUNT`, `!squatted NAME UID ACCOUNT`."""
    parts = line[1:].split()
    if not parts:
        return None
    if parts[0] == "odd":
        owner = parts[2] if len(parts) >= 3 else "?"
        return Refusal(odd_name(parts[3] if len(parts) >= 4 else ""), owner, "a name outside eltctl's strict set")
    if parts[0] in ("notfile", "squatted") and len(parts) >= 2:
        name = parts[1] if parse_name(parts[1]) is not None else "(a name outside eltctl's strict set)"
        owner = parts[3] if len(parts) >= 4 else "?"
        reason = "not a regular file" if parts[0] == "notfile" else f"squatted: {owner} holds this job's name"
        return Refusal(name, owner, reason)
    return None


def odd_name(hexed: str) -> str:
    """A name outside the strict set, as the probe sent it (hex), shown escaped (`shown_name`)."""
    try:
        return shown_name(bytes.fromhex(hexed).decode("utf-8", errors="replace")) if hexed else "(unreadable name)"
    except ValueError:
        return "(unreadable name)"


def parse_dir(line: str) -> tuple[bool, Refusal | None]:
    """The `!dir` line: (whether the directory's entries may be believed, its problem)."""
    parts = line.split()
    if len(parts) < 2 or parts[1] == "-":
        return True, None  # missing: nothing in it
    try:
        me, uid, owner, mode = int(parts[1]), int(parts[2]), parts[3], int(parts[4], 16)
    except (IndexError, ValueError):
        return False, Refusal("(the claims directory)", "?", "its owner and mode could not be read")
    found = dir_problem(uid, mode, me, owner)
    if found is None:
        return True, None
    why, usable = found
    return usable, Refusal("(the claims directory)", owner, f"the directory is {why}"
                           + ("" if usable else ": nothing in it is believed"))


def parse_claims(lines: Iterable[str], host_now: float | None) -> tuple[tuple[tuple[str, Claim], ...],
                                                                         tuple[Refusal, ...], bool]:
    """The `claims` section: ((claim file name, holder) of the held, believed claims;
    the refused entries; whether the directory is trusted)."""
    out, refused, trusted = [], [], True
    for line in lines:
        line = line.strip()
        if line.startswith("!dir"):
            trusted, problem = parse_dir(line)
            refused += [problem] if problem else []
            continue
        if _bang(line, refused):
            continue
        parts = line.split(" ", 5)
        legacy = len(parts) >= 5 and is_legacy(parts[0])
        if len(parts) < 5 or not legacy and (parse_name(parts[0]) is None or parse_name(parts[0]).kind == "demand"):
            continue
        name, owner, held, pid_ok = parts[0], parts[2], parts[3], parts[4] == "1"
        content = parts[5] if len(parts) > 5 else ""
        # held: a lock is held; without `flock` on the host, its pid is a live process of its owner
        is_held = held == "1" or (held == "2" and pid_ok)
        if is_held:
            why = judge(name, owner, json_object(content), host_now, alive=pid_ok)
        else:  # no claim; a squat is still named
            why = None if legacy else judge_owner(name, owner)
        if why is not None:
            refused.append(Refusal(name, owner, why))
        elif is_held:
            out.append((name, Claim.from_json(content)))
    if not trusted:
        out = []
    return tuple(sorted(out)), tuple(refused), trusted


def parse_demands(lines: Iterable[str], trusted: bool = True) -> dict:
    """The `demand` section: the host's clock, the believed fresh entries, a write failure
    and the refused entries (HostProbe's fields)."""
    host_time, out, error, refused = None, [], "", []
    for i, line in enumerate(lines):
        line = line.strip()
        if i == 0:
            try:
                host_time = float(line)
            except ValueError:
                pass
            continue
        if line.startswith("!cannot"):
            error = line[1:]
            continue
        if _bang(line, refused):
            continue
        parts = line.split(" ", 3)
        if len(parts) < 3 or not parts[0].startswith("demand."):
            continue
        name, owner, content = parts[0], parts[2], parts[3] if len(parts) > 3 else ""
        doc = json_object(content)
        why = judge(name, owner, doc, host_time)
        if why is not None:
            refused.append(Refusal(name, owner, why))
            continue
        d = Demand.from_dict(doc)
        if d is not None and d.fresh(host_time) and trusted:
            out.append(d)
    return {"host_time": host_time, "demands": tuple(sorted(out, key=lambda d: d.key)), "demand_error": error,
            "refused": tuple(refused)}


def refused_of_state(state: Any) -> list[Refusal]:
    """The refused entries a host daemon's state document carries (`refused`: runtime/claims.py
    `refusal_doc`); [] when none or malformed."""
    doc = state.get("refused") if isinstance(state, dict) else None
    entries = doc.get("entries") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        return []
    return [r for r in map(Refusal.from_dict, entries) if r is not None]


def refused_summary(refused: Iterable[Refusal]) -> dict | None:
    """status.json's and `eltctl probe --json`'s `refused`: {"count", "entries": [{"file",
    "owner", "reason"}]}; None when nothing was refused."""
    refused = list(dict.fromkeys(refused))
    if not refused:
        return None
    return {"count": len(refused), "entries": [r.to_dict() for r in refused[:20]]}


__all__ = ["claims_section", "demand_section", "parse_claims", "parse_demands", "parse_dir", "refused_of_state",
           "refused_summary"]
