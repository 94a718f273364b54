"""The data plane's network interface (stdlib only): where gloo and NCCL listen.

The collectives' TCP listeners (gloo's pairs, NCCL's bootstrap and socket transport)
and restart mode's script store follow the host's address of its SSH connection
(ELTCTL_BIND_ADDRESS, which the daemon's start command takes from SSH_CONNECTION),
else the address towards the store (`local_address_towards`). The interface holding
that address is named to the workers as GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME
(a script's init_process_group and NCCL read those, not an address). A host's
`data_interface` in the inventory overrides both: that interface, and its address
as ELTCTL_BIND_ADDRESS. A variable the job's env (or the daemon's own environment)
already sets is left alone.

`choose` is pure (a table of interfaces and their addresses in, a `DataPlane` out):
the daemon builds the table of its host (`addresses`: the SIOCGIFCONF ioctl for IPv4,
/proc/net/if_inet6 for IPv6) and `eltctl probe` from `ip -o addr show`'s output on
the host (`parse_ip_addr`), so both decide the same way.
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from typing import Mapping

LOOPBACK = "lo"
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_IFNAME = "NCCL_SOCKET_IFNAME"
BIND_ADDRESS_ENV = "ELTCTL_BIND_ADDRESS"

_SIOCGIFCONF = 0x8912
_IFREQ = 40  # struct ifreq on 64-bit Linux: 16 bytes of name, 24 of union
_IFREQ_MAX = 256

Table = Mapping[str, tuple[str, ...]]  # interface name -> its addresses (IPv4 and IPv6, as text)


class DataInterfaceError(ValueError):
    """The inventory's data_interface is not an interface of the host."""


@dataclass(frozen=True)
class DataPlane:
    interface: str | None  # None: no interface holds the address (then nothing is named)
    address: str  # where gloo and the script store bind
    source: str  # "inventory" (data_interface), else "address" (the SSH or store-route address)

    def to_json(self) -> dict:
        return {"interface": self.interface, "address": self.address, "source": self.source}


def local_address_towards(host: str, port: int) -> str:
    """The local IP this machine uses to reach `host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _same(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a.split("%", 1)[0]) == ipaddress.ip_address(b.split("%", 1)[0])
    except ValueError:
        return a == b


def interface_holding(address: str, table: Table) -> str | None:
    """The interface whose addresses include `address`; a loopback address (127.0.0.0/8,
    ::1) is the loopback interface's even where only 127.0.0.1 is assigned."""
    for name, addrs in table.items():
        if any(_same(address, a) for a in addrs):
            return name
    if _is_loopback(address):
        return next((n for n, addrs in table.items() if any(_is_loopback(a) for a in addrs)), LOOPBACK)
    return None


def _ipv4_first(addrs: tuple[str, ...]) -> str | None:
    return next((a for a in addrs if ":" not in a), addrs[0] if addrs else None)


def describe(table: Table) -> str:
    return ", ".join(f"{n} ({', '.join(a) or 'no address'})" for n, a in sorted(table.items())) or "none"


def choose(table: Table, *, address: str, interface: str | None = None) -> DataPlane:
    """The data plane: the inventory's `interface` (and its first IPv4 address), else the
    interface holding `address`. Raises DataInterfaceError for an interface the host lacks."""
    if interface:
        addrs = table.get(interface)
        if addrs is None:
            raise DataInterfaceError(f"data_interface {interface!r} is not an interface of this host; it has: "
                                     f"{describe(table)}. Fix the host's data_interface in the inventory")
        chosen = _ipv4_first(addrs)
        if chosen is None:
            raise DataInterfaceError(f"data_interface {interface!r} has no address on this host")
        return DataPlane(interface=interface, address=chosen, source="inventory")
    return DataPlane(interface=interface_holding(address, table), address=address, source="address")


def plane_env(plane: DataPlane, keep: Mapping[str, str]) -> dict[str, str]:
    """The workers' variables for `plane`, leaving out those `keep` (the job's env, the
    daemon's own) already sets: GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME, and with an
    inventory interface ELTCTL_BIND_ADDRESS (which the job's env alone may set instead)."""
    env: dict[str, str] = {}
    if plane.interface:
        for name in (GLOO_IFNAME, NCCL_IFNAME):
            if not keep.get(name):
                env[name] = plane.interface
    if plane.source == "inventory":
        env[BIND_ADDRESS_ENV] = plane.address
    return env


# ---- the table: this host's, or parsed from `ip -o addr show` --------------------------


def addresses() -> dict[str, tuple[str, ...]]:
    """This host's interfaces and their addresses (every interface that is up and has one;
    IPv4 aliases such as eth0:1 count as eth0)."""
    table: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        buf = array.array("B", bytes(_IFREQ * _IFREQ_MAX))
        ifconf = struct.pack("iL", len(buf), buf.buffer_info()[0])
        size, _ = struct.unpack("iL", fcntl.ioctl(s.fileno(), _SIOCGIFCONF, ifconf))
    for off in range(0, size, _IFREQ):
        name = bytes(buf[off:off + 16]).split(b"\0", 1)[0].decode(errors="replace").split(":", 1)[0]
        addr = socket.inet_ntoa(bytes(buf[off + 20:off + 24]))
        table.setdefault(name, []).append(addr)
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6:
                    addr = str(ipaddress.IPv6Address(bytes.fromhex(parts[0])))
                    table.setdefault(parts[5], []).append(addr)
    except (OSError, ValueError):
        pass
    for name in _names():
        table.setdefault(name, [])
    return {n: tuple(a) for n, a in table.items()}


def _names() -> list[str]:
    try:
        return [name for _i, name in socket.if_nameindex()]
    except OSError:
        return sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []


def parse_ip_addr(text: str) -> dict[str, tuple[str, ...]]:
    """The table in `ip -o addr show`'s output (`2: eth0    inet 10.0.0.5/24 ...`)."""
    table: dict[str, list[str]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0].endswith(":") and parts[2] in ("inet", "inet6"):
            name = parts[1].split("@", 1)[0]
            table.setdefault(name, []).append(parts[3].split("/", 1)[0])
    return {n: tuple(a) for n, a in table.items()}


# ---------------------------------------------------------------------------- who connected


@dataclass(frozen=True)
class TcpRow:
    """One row of /proc/net/tcp or tcp6: a socket of this network namespace (any account's)."""

    local: tuple[str, int]
    remote: tuple[str, int]
    state: int  # the kernel's TCP state: 1 established, 10 listening
    uid: int
    inode: int


ESTABLISHED, LISTEN = 0x01, 0x0A


def _hex_address(field: str) -> tuple[str, int]:
    """`0100007F:1F90` -> ("127.0.0.1", 8080): the address is in the kernel's byte order,
    32-bit words of it (four for IPv6) each little-endian on the hosts we run on."""
    addr, port = field.split(":")
    raw = bytes.fromhex(addr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def parse_proc_net_tcp(text: str) -> list[TcpRow]:
    """The rows of /proc/net/tcp or /proc/net/tcp6 (a malformed row is skipped)."""
    rows = []
    for line in text.splitlines()[1:]:
        f = line.split()
        try:
            rows.append(TcpRow(_hex_address(f[1]), _hex_address(f[2]), int(f[3], 16), int(f[7]), int(f[9])))
        except (IndexError, ValueError):
            continue
    return rows


def accepted_connections(rows: list[TcpRow], mine: set[int]) -> list[tuple[str, int, int | None]]:
    """The remote ends of the connections that the sockets `mine` (inodes) accepted on
    their listeners: (address, port, the uid of the account whose socket it is when it
    is on this machine, else None). Pure: `rows` are every socket of the namespace."""
    listening = {r.local for r in rows if r.inode in mine and r.state == LISTEN}
    ports = {port for _, port in listening}
    owner = {(r.local, r.remote): r.uid for r in rows if r.state == ESTABLISHED}
    out = []
    for r in rows:
        if r.inode in mine and r.state == ESTABLISHED and r.local[1] in ports and (
                r.local in listening or ("0.0.0.0", r.local[1]) in listening or ("::", r.local[1]) in listening):
            out.append((r.remote[0], r.remote[1], owner.get((r.remote, r.local))))
    # The same remote end can come twice, once with its owner and once without (a socket
    # that closed and one that took its port between two reads): None sorts first.
    return sorted(out, key=lambda c: (c[0], c[1], -1 if c[2] is None else c[2]))


def connections_to_my_listeners() -> list[tuple[str, int, int | None]]:
    """`accepted_connections` of this process, read from /proc (empty where unreadable):
    who is connected to this worker's data-plane listeners, naming another account of
    this machine by its uid."""
    mine = set()
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                mine.add(int(link[8:-1]))
        rows = []
        for name in ("tcp", "tcp6"):
            try:
                with open(f"/proc/self/net/{name}") as f:
                    rows += parse_proc_net_tcp(f.read())
            except OSError:
                continue
    except OSError:
        return []
    return accepted_connections(rows, mine)
