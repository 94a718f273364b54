"""The waits the sharded state and its checkpoints use (member/collectives.py): without an
abort event, and on a peer already gone."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from runtime_cluster import gloo_group as group, run_threads as run_ranks


def test_a_collective_waited_on_without_an_abort_event_waits_for_a_late_peer():
    """checkpoint.restore_chunks and zero's helpers take abort=None outside a generation
    (tests, tools): a peer that comes late (hashing its shard files, here 0.3 s) must be
    waited for, not end the wait with an AttributeError on the missing event."""
    from eltctl_runtime.member import collectives

    store = dist.HashStore()

    def rank(r: int):
        pg = group(store, "late", r, 2)
        if r == 1:
            time.sleep(0.3)
        t = torch.tensor([float(r + 1)])
        collectives.allreduce(pg, t, None)
        b = collectives.broadcast(pg, torch.tensor([float(r)]), 1, None)
        done = collectives.run_abortable(lambda: 7, None, "a call")
        return float(t[0]), float(b[0]), done

    out = run_ranks({f"w{r}": (lambda r=r: rank(r)) for r in range(2)})
    assert out == {"w0": (3.0, 1.0, 7), "w1": (3.0, 1.0, 7)}


PEER_THAT_GOES = """
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, timeout=timedelta(seconds=30))
opts = dist.ProcessGroupGloo._Options()
opts._timeout = timedelta(seconds=30)
opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
pg = dist.ProcessGroupGloo(dist.PrefixStore("gone", store), 1, 2, opts)
pg.send([torch.ones(4)], 0, 0).wait()
os._exit(0)  # its sockets close with it, as a SIGKILLed rank's do
"""


@pytest.mark.parametrize("post", ["send", "recv"])
def test_a_transfer_posted_to_a_peer_already_gone_is_an_abort_with_a_backend_error(post):
    """gloo raises at once when a send or receive is posted on a pair whose peer has
    already closed its end (a rank SIGKILLed before the writer posts the receive of its
    checkpoint shard: the writer then left the job with that RuntimeError, 1 run in 8 of
    test_sharded_job's checkpoint-kill test under load). Posted through
    collectives.send/recv it is an Aborted with backend_error, as a failure in the wait
    is: the caller abandons the transfer and the generation goes on without the peer."""
    import subprocess
    import sys

    from eltctl_runtime.member import collectives

    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    peer = subprocess.Popen([sys.executable, "-c", PEER_THAT_GOES, str(store.port)])
    try:
        pg = group(store, "gone", 0, 2)
        collectives.wait_p2p([collectives.recv(pg, torch.zeros(4), 1)], None, "a first message")  # the pair is up
        assert peer.wait(timeout=30) == 0
        time.sleep(0.3)  # its end of the pair is closed
        with pytest.raises(collectives.Aborted) as got:
            work = (collectives.send(pg, torch.ones(4), 1) if post == "send"
                    else collectives.recv(pg, torch.zeros(4), 1))
            collectives.wait_p2p([work], threading.Event(), "a transfer to a peer gone")
        assert got.value.backend_error, got.value
        assert "Connection closed" in str(got.value) or "closed" in str(got.value).lower(), got.value
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
