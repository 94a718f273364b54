#!/usr/bin/env python3
"""A stand-in `nvidia-smi` for simulated hosts: the real CSV query interface,
answered from a JSON state file instead of a driver.

Stand-alone (standard library only, any python3): a host gets it through the
launcher that `eltctl.sim.gpustate.install_nvidia_smi` writes into its bin
directory. The state file (its format is documented in gpustate.py) is found
through the environment variable ELTSIM_STATE and read on every call; the host's
name comes from ELTSIM_HOST.

Supported, as the real tool prints them:
  nvidia-smi --query-gpu=FIELDS --format=csv[,noheader][,nounits] [-i IDS]
      FIELDS from index, uuid, name, memory.used, memory.total, memory.free,
      utilization.gpu, pci.bus_id, driver_version, count
  nvidia-smi --query-compute-apps=FIELDS --format=csv[,noheader][,nounits]
      FIELDS from gpu_uuid, gpu_bus_id, gpu_name, pid, used_memory
      (used_gpu_memory), process_name (name)
  nvidia-smi -L | --list-gpus
  nvidia-smi --version
  nvidia-smi                      (a short summary table)

Every call runs on every probe of every simulated host, so it is kept cheap:
the state is parsed with json's C scanner directly (importing `json` pulls in
`re` and `enum`, which doubled the cost of a call), and /proc is scanned once,
reading only environ files.
"""

import os
import sys

FAILURE = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)

# query field -> (header, unit or None)
GPU_FIELDS = {
    "index": ("index", None),
    "uuid": ("uuid", None),
    "gpu_uuid": ("uuid", None),
    "name": ("name", None),
    "gpu_name": ("name", None),
    "memory.used": ("memory.used [MiB]", "MiB"),
    "memory.total": ("memory.total [MiB]", "MiB"),
    "memory.free": ("memory.free [MiB]", "MiB"),
    "utilization.gpu": ("utilization.gpu [%]", "%"),
    "pci.bus_id": ("pci.bus_id", None),
    "gpu_bus_id": ("pci.bus_id", None),
    "driver_version": ("driver_version", None),
    "count": ("count", None),
}
APP_FIELDS = {
    "gpu_uuid": ("gpu_uuid", None),
    "gpu_bus_id": ("gpu_bus_id", None),
    "gpu_name": ("gpu_name", None),
    "pid": ("pid", None),
    "used_memory": ("used_gpu_memory [MiB]", "MiB"),
    "used_gpu_memory": ("used_gpu_memory [MiB]", "MiB"),
    "process_name": ("process_name", None),
    "name": ("process_name", None),
}
NA = "[N/A]"


class Usage(Exception):
    """A command line the real tool would reject; message and exit status."""

    def __init__(self, message, status=2):
        super().__init__(message)
        self.status = status


def main(argv):
    path = os.environ.get("ELTSIM_STATE")
    try:
        with open(path or "", "rb") as f:
            state = load_json(f.read().decode("utf-8"))
    except (OSError, ValueError):
        # No readable state: as far as a caller can tell, the driver is unreachable.
        sys.stdout.write(FAILURE + "\n\n")
        return 9
    mode = state.get("mode", "ok")
    if mode == "missing":
        sys.stderr.write("nvidia-smi: command not found\n")
        return 127
    if mode == "fail":
        sys.stdout.write(FAILURE + "\n\n")
        return 9
    if mode == "hang":
        return hang(path)
    try:
        out = run(argv, state, mode == "na")
    except Usage as e:
        sys.stdout.write(str(e) + "\n")
        return e.status
    sys.stdout.write(out)
    return 0


class _ScanContext:
    # The attributes json's C scanner reads from a JSONDecoder.
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = float
    memo = None


def load_json(text):
    """json.loads without importing json (see the module docstring)."""
    try:
        import _json
        scan = _json.make_scanner(_ScanContext())
    except (ImportError, AttributeError, TypeError):
        import json
        return json.loads(text)
    start = len(text) - len(text.lstrip())
    try:
        value, end = scan(text, start)
    except StopIteration:
        raise ValueError("empty or invalid state file") from None
    if text[end:].strip():
        raise ValueError("trailing data in state file")
    return value


def hang(path):
    # A wedged driver never answers. Polling for the state file lets a leaked
    # sleeper end together with its test bed even if nobody kills it.
    import time
    while os.path.exists(path):
        time.sleep(1.0)
    return 9


def run(argv, state, na):
    query_gpu = query_apps = fmt = ids = None
    list_gpus = version = False
    args = list(argv)
    while args:
        arg = args.pop(0)
        name, eq, value = arg.partition("=")
        if name in ("--query-gpu", "--query-compute-apps", "--format", "-i", "--id"):
            if not eq:
                if not args:
                    raise Usage(f'Option "{name}" requires a value.')
                value = args.pop(0)
            if name == "--query-gpu":
                query_gpu = value
            elif name == "--query-compute-apps":
                query_apps = value
            elif name == "--format":
                fmt = value
            else:
                ids = value
        elif arg.startswith("-i") and len(arg) > 2:
            ids = arg[2:]
        elif arg in ("-L", "--list-gpus"):
            list_gpus = True
        elif arg in ("--version", "-v"):
            version = True
        elif arg in ("-h", "--help"):
            return "NVIDIA System Management Interface -- (simulated by eltctl)\n"
        else:
            raise Usage(f"Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.")

    gpus = select(state["gpus"], ids)
    if version:
        drv = state.get("driver_version", "535.129.03")
        return (f"NVIDIA-SMI version  : {drv}\nNVML version        : {drv.rsplit('.', 1)[0]}\n"
                f"DRIVER version      : {drv}\nCUDA Version        : {state.get('cuda_version', '12.2')}\n")
    if list_gpus:
        return "".join(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})\n" for g in gpus)
    if query_gpu is not None or query_apps is not None:
        opts = parse_format(fmt)
        procs = processes(state)
        if query_gpu is not None:
            return csv(query_gpu, GPU_FIELDS, [gpu_row(g, state, procs, na, len(gpus)) for g in gpus], opts)
        wanted = {g["index"] for g in gpus}
        return csv(query_apps, APP_FIELDS,
                   [app_row(p, state, na) for p in procs if p["gpu"] in wanted], opts)
    return summary(gpus, state, processes(state), na)


def select(gpus, ids):
    if ids is None:
        return gpus
    chosen = []
    for token in ids.split(","):
        token = token.strip()
        match = [g for g in gpus if str(g["index"]) == token or g["uuid"] == token or g.get("pci_bus_id") == token]
        if not match:
            raise Usage(f"No devices were found", status=6)
        chosen.extend(match)
    return chosen


def parse_format(fmt):
    if fmt is None:
        raise Usage('Option "--format" is required when using a query option.')
    parts = [p.strip() for p in fmt.split(",")]
    if "csv" not in parts or any(p not in ("csv", "noheader", "nounits") for p in parts):
        raise Usage(f'"{fmt}" is not a valid format.')
    return {"header": "noheader" not in parts, "units": "nounits" not in parts}


def csv(query, table, rows, opts):
    fields = [f.strip() for f in query.split(",") if f.strip()]
    for f in fields:
        if f not in table:
            raise Usage(f'Field "{f}" is not a valid field to query.')
    lines = []
    if opts["header"]:
        lines.append(", ".join(table[f][0] for f in fields))
    for row in rows:
        cells = []
        for f in fields:
            value = row[f if f in row else table[f][0]]
            unit = table[f][1]
            if unit and opts["units"] and not (isinstance(value, str) and value.startswith("[")):
                value = f"{value} {unit}"
            cells.append(str(value))
        lines.append(", ".join(cells))
    return "".join(line + "\n" for line in lines)


def total(base, parts, cap):
    # A literal such as "[N/A]" in the base wins: the board does not report it.
    if isinstance(base, str):
        return base
    value = base + sum(p for p in parts if isinstance(p, int))
    return min(value, cap) if cap is not None else value


def gpu_row(g, state, procs, na, count):
    mine = [p for p in procs if p["gpu"] == g["index"]]
    mem_total = g["memory_total_mib"]
    used = total(g.get("memory_used_mib", 0), [p["used_memory_mib"] for p in mine],
                 mem_total if isinstance(mem_total, int) else None)
    util = total(g.get("utilization", 0), [p["utilization"] for p in mine], 100)
    if na:
        util = NA
    free = mem_total - used if isinstance(mem_total, int) and isinstance(used, int) else NA
    return {
        "index": g["index"], "uuid": g["uuid"], "name": g["name"],
        "memory.used": used, "memory.total": mem_total, "memory.free": free,
        "utilization.gpu": util, "pci.bus_id": g.get("pci_bus_id", NA),
        "driver_version": state.get("driver_version", "535.129.03"), "count": count,
    }


def app_row(p, state, na):
    g = next(g for g in state["gpus"] if g["index"] == p["gpu"])
    return {
        "gpu_uuid": g["uuid"], "gpu_bus_id": g.get("pci_bus_id", NA), "gpu_name": g["name"],
        "pid": p["pid"], "used_memory": NA if na else p["used_memory_mib"],
        "process_name": p["name"],
    }


def processes(state):
    """Live processes on this host's GPUs: registered foreign pids, then our workers."""
    by_index = {g["index"]: g["index"] for g in state["gpus"]}
    by_index.update({g["uuid"]: g["index"] for g in state["gpus"]})
    out = []
    for p in state.get("processes", ()):
        start = starttime(p["pid"])
        if start is None or (p.get("starttime") is not None and start != p["starttime"]):
            continue  # dead, a zombie, or the pid now belongs to someone else
        out.append({"pid": p["pid"], "gpu": p["gpu"], "used_memory_mib": p.get("used_memory_mib", 0),
                    "utilization": p.get("utilization", 0), "name": process_name(p["pid"])})
    out.extend(workers(state, by_index))
    return out


def starttime(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if rest[0] in (b"Z", b"X"):
        return None
    return int(rest[19])


def workers(state, by_index):
    host = state.get("host") or os.environ.get("ELTSIM_HOST", "")
    marker = b"\0ELTSIM_HOST=" + host.encode() + b"\0"
    state_path = os.environ.get("ELTSIM_STATE", "").encode()
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if pid == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = b"\0" + f.read()
        except OSError:
            continue
        if marker not in env:
            continue
        cvd = _env_value(env, b"CUDA_VISIBLE_DEVICES")
        if not cvd:
            continue
        other_state = _env_value(env, b"ELTSIM_STATE")
        if other_state is not None and state_path and other_state != state_path:
            continue  # another test bed's host of the same name
        first = cvd.split(b",")[0].strip().decode(errors="replace")
        index = by_index.get(int(first) if first.isdigit() else first)
        if index is None or starttime(pid) is None:
            continue
        found.append({"pid": pid, "gpu": index, "used_memory_mib": state.get("worker_memory_mib", 600),
                      "utilization": state.get("worker_utilization", 0), "name": process_name(pid)})
    return found


def _env_value(env, key):
    start = env.find(b"\0" + key + b"=")
    if start < 0:
        return None
    start += len(key) + 2
    end = env.find(b"\0", start)
    return env[start:end if end >= 0 else len(env)]


def process_name(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0", 1)[0]
    except OSError:
        return NA
    return argv0.decode(errors="replace") or NA


def summary(gpus, state, procs, na):
    drv = state.get("driver_version", "535.129.03")
    lines = [f"NVIDIA-SMI {drv}    Driver Version: {drv}    CUDA Version: {state.get('cuda_version', '12.2')}",
             "GPU  Name                      Bus-Id            Memory-Usage          GPU-Util"]
    for g in gpus:
        r = gpu_row(g, state, procs, na, len(gpus))
        lines.append(f"{r['index']:<4} {r['name']:<25} {r['pci.bus_id']:<17} "
                     f"{r['memory.used']}MiB / {r['memory.total']}MiB   {r['utilization.gpu']}%")
    lines.append("Processes:")
    wanted = {g["index"] for g in gpus}
    shown = [p for p in procs if p["gpu"] in wanted]
    for p in shown:
        lines.append(f"  GPU {p['gpu']}  PID {p['pid']}  {p['name']}  {NA if na else p['used_memory_mib']}MiB")
    if not shown:
        lines.append("  No running processes found")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
