"""A delay line for kernels without `sch_netem`: what one host sends, through user space.

The bed (netns.py) joins a host to its switch by a veth pair, and delays what the
host sends with `netem`. Where the kernel has no netem (CONFIG_NET_SCH_NETEM unset,
as on this machine: its qdiscs are tbf, htb, ingress and fifo), the bed sends what
such a host sends through this process instead:

    host ns: eth0 (veth) --egress, tc mirred redirect--> delay0 (TAP) -> this process
             -> dl<i> (TAP, a bridge port that learns nothing) -> br0 in the switch ns
    br0 -> the host's veth port (a static entry for its MAC) -> eth0: what it receives

What the host sends is held for the link's delay (± jitter, uniform) and dropped with
the link's loss probability, then written to the bridge; what it receives never
leaves the kernel. So every packet crosses user space once, at its sender. The rate
stays the kernel's: `tbf` on delay0 (what the host sends) and on the host's switch
port (what it receives), as on a plain link. TCP, gloo and sshd run over the real
interfaces with a real delay; only the delay's queue is in user space.

Packets keep their order (each leaves at max(its time, the one before's)): an
office switch does not reorder, so jitter here varies the delay without reordering,
where netem's jitter reorders. Both TAPs carry virtio-net headers with the TCP
offloads on (as QEMU's), so the host's 64 KiB TSO packets cross as one read and one
write each: about 2,000 a second at 1 Gbit/s. A link with loss turns TSO off on
delay0, so a loss drops one 1,500-byte frame, not a burst of 44. The process runs at
SCHED_FIFO priority where it may, so a busy machine does not add to the delay. What
the bridge floods to the port (broadcasts) is read and dropped.

Run by the bed: `python delayline.py HOST_NS SWITCH_NS HOST_TAP PORT_TAP DELAY_MS JITTER_MS
LOSS_PCT SEED`; it creates the two TAPs (they vanish when it exits), prints `ready`,
then reads `DELAY_MS JITTER_MS LOSS_PCT` lines on stdin (a reshape) and exits at
stdin's end. Standard library only (ctypes for setns: Python 3.11 has no os.setns).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import random
import select
import struct
import sys
import time
from collections import deque

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TAP, IFF_NO_PI, IFF_VNET_HDR = 0x0002, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
CLONE_NEWNET = 0x40000000
READ_SIZE = 65536 + 64     # a 64 KiB GSO packet, its Ethernet header and the 10-byte virtio header
BATCH = 64                 # reads from one side before the queue is looked at again


class Shape:
    """The link's delay, jitter and loss, and the order-keeping release times. Pure
    but for its random source (seeded)."""

    def __init__(self, delay_ms: float, jitter_ms: float, loss_pct: float, seed: int) -> None:
        self.rng = random.Random(seed)
        self.last = 0.0
        self.set(delay_ms, jitter_ms, loss_pct)

    def set(self, delay_ms: float, jitter_ms: float, loss_pct: float) -> None:
        if min(delay_ms, jitter_ms, loss_pct) < 0 or loss_pct > 100:
            raise ValueError(f"delay {delay_ms} ms, jitter {jitter_ms} ms, loss {loss_pct} %: "
                             "need delay, jitter >= 0 and loss in [0, 100]")
        self.delay, self.jitter, self.loss = delay_ms / 1e3, jitter_ms / 1e3, loss_pct / 100

    def release_at(self, now: float) -> float | None:
        """When a packet the host sent at `now` leaves for the switch; None: it is lost."""
        if self.loss and self.rng.random() < self.loss:
            return None
        t = now + max(0.0, self.delay + (self.rng.uniform(-self.jitter, self.jitter) if self.jitter else 0.0))
        self.last = max(t, self.last)
        return self.last


def _setns(fd: int) -> None:
    """Move this (single-threaded) process into the network namespace `fd` names."""
    if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _tap_in(netns: str, name: str) -> int:
    """A TAP `name` made in the named namespace (this process enters it to make it)."""
    fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        _setns(fd)
    finally:
        os.close(fd)
    return open_tap(name)


def open_tap(name: str) -> int:
    """A TAP named `name` in this process's network namespace, with virtio-net headers."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR))
    return fd


def set_tso(fd: int, on: bool) -> None:
    fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | (TUN_F_TSO4 | TUN_F_TSO6 if on else 0))


def _realtime() -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (OSError, AttributeError):
        pass  # not root, or no RT scheduling: the delay is then as good as the machine is idle


def run(host_fd: int, port_fd: int, ctl: int, shape: Shape) -> None:
    held: deque[tuple[float, bytes]] = deque()
    tso = None
    while True:
        if tso != (shape.loss == 0):
            tso = shape.loss == 0
            set_tso(host_fd, tso)
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
        ready, _, _ = select.select([host_fd, port_fd, ctl], [], [], timeout)
        if ctl in ready:
            line = os.read(ctl, 4096)
            if not line:
                return
            shape.set(*(float(v) for v in line.split()[-3:]))
        if port_fd in ready:  # the bridge's floods towards this port: the host has them through its veth
            for _ in range(BATCH):
                try:
                    os.read(port_fd, READ_SIZE)
                except BlockingIOError:
                    break
        if host_fd in ready:  # what the host sends: held for the delay
            for _ in range(BATCH):
                try:
                    packet = os.read(host_fd, READ_SIZE)
                except BlockingIOError:
                    break
                at = shape.release_at(time.monotonic())
                if at is not None:
                    held.append((at, packet))
        now = time.monotonic()
        while held and held[0][0] <= now:
            try:
                os.write(port_fd, held.popleft()[1])
            except OSError:
                pass  # a packet the bridge refused: dropped, as a wire would


def main(argv: list[str]) -> int:
    host_ns, switch_ns, host_tap, port = argv[:4]
    delay, jitter, loss = (float(v) for v in argv[4:7])
    shape = Shape(delay, jitter, loss, int(argv[7]))
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    host_fd = _tap_in(host_ns, host_tap)
    port_fd = _tap_in(switch_ns, port)
    set_tso(port_fd, True)
    _setns(home)
    os.close(home)
    _realtime()
    print("ready", flush=True)
    run(host_fd, port_fd, sys.stdin.fileno(), shape)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
