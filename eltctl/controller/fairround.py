"""This job's side of fair share, once per pass: its demand, published on its hosts at each
probe (`published`: host -> Demand; withdrawn once the training finished or `down`
began), and fair share's plan over what the probes and daemons report of the other jobs
(`FairShareRound.apply`: the limits with this job's releases, and the cap on new GPUs).
The plan itself is fairshare.py's (pure); this holds what one pass hands the next.
"""

from __future__ import annotations

import getpass
import logging

from eltctl.controller import fairshare
from eltctl.controller import policy as pol
from eltctl.controller import status
from eltctl.demand import Demand
from eltctl_runtime.protocol import EventKind

log = logging.getLogger("eltctl.controller")


class FairShareRound:
    """What fair share carries from pass to pass for the loop.Controller `ctl` (its
    inventory, records, observations, ledger and events)."""

    def __init__(self, ctl) -> None:
        self.ctl = ctl
        self.plan = fairshare.Plan()  # fair share's last plan (controller/fairshare.py)
        self.me = None  # this job's demand as last published (eltctl/demand.py Demand)
        self.published: dict = {}  # host -> this job's demand entry to publish there at the next probe
        self.usage: tuple[float, float] = (-1e18, 0.0)  # (when, recent GPU-hours) from the ledger
        self.released_at = -1e18  # when fair share last released GPUs

    def first_demand(self, now: float) -> dict:
        """The demand entries the first probe publishes (fairshare.first_demand): the jobs
        sharing the hosts learn of this one at its first probe, not its second."""
        ctl = self.ctl
        inv = ctl.inventory
        if ctl.ledger is not None:
            self.usage = (now, ctl.ledger.recent_gpu_hours(now, inv.policy.usage_half_life))
        return fairshare.first_demand(
            job=inv.job.name, user=getpass.getuser(), priority=inv.job.priority, min_workers=inv.job.min_workers,
            max_workers=inv.job.max_workers,
            desired={h.name: ctl.records.get(h.name, pol.HostRecord()).desired for h in inv.hosts},
            hosts=[h.name for h in inv.hosts if h.schedule.enabled
                   and not ctl.records.get(h.name, pol.HostRecord()).removed],
            usage_gpu_h=self.usage[1], every=inv.policy.probe_interval)

    def to_publish(self) -> dict:
        """This job's demand entries for the next probe (host -> Demand): the last measured
        ones; held 0 and wanted 0 once the training finished or `down` began
        (`fairshare.withdrawn`): its last entry would say it holds its GPUs, to the jobs
        sharing its hosts and to `eltctl lab`, until it went stale (issue 50)."""
        ctl = self.ctl
        if not (ctl.stopping or status.training_finished(ctl.outputs.done)):
            return self.published
        inv = ctl.inventory
        me = self.me or Demand(job=inv.job.name, user=getpass.getuser(), priority=inv.job.priority,
                               min_workers=inv.job.min_workers, every=inv.policy.probe_interval)
        return fairshare.withdrawn(me, [h.name for h in inv.hosts if h.schedule.enabled])

    async def apply(self, limits: dict[str, pol.Limit], now: float,
                    cpu_hosts: set[str] | frozenset[str] = frozenset()) -> tuple[dict[str, pol.Limit], int | None]:
        """This job's demand to publish at the next probe, and fair share's plan
        (controller/fairshare.py): the limits with its releases, and the cap on new GPUs.
        `cpu_hosts`: the hosts whose slots are CPU slots (policy.cpu_host), which fair
        share does not count."""
        ctl = self.ctl
        inv = ctl.inventory
        reports = fairshare.with_daemon_demands(ctl.observed.reports,
                                                {n: s.state for n, s in ctl.observed.seen.items()})
        desired = {h.name: ctl.records.get(h.name, pol.HostRecord()).desired for h in inv.hosts}
        usable = [h.name for h in inv.hosts if limits.get(h.name, pol.NO_LIMIT).cap != 0
                  and not ctl.records.get(h.name, pol.HostRecord()).removed]
        if ctl.ledger is not None and now - self.usage[0] >= inv.policy.probe_interval:
            self.usage = (now, ctl.ledger.recent_gpu_hours(now, inv.policy.usage_half_life))
        me, self.published = fairshare.own_demand(
            job=inv.job.name, user=fairshare.own_user(reports, inv.job.name, getpass.getuser()),
            priority=inv.job.priority, min_workers=inv.job.min_workers, max_workers=inv.job.max_workers,
            desired=desired, reports=reports, usable=usable, usage_gpu_h=self.usage[1],
            every=inv.policy.probe_interval, cpu_hosts=cpu_hosts)
        plan = fairshare.plan(me, fairshare.others_seen(reports, inv.job.name),
                              fairshare.holds(desired, reports, inv.job.name, cpu_hosts),
                              free=fairshare.free_gpus(reports, usable), half_life_s=inv.policy.usage_half_life,
                              slack=inv.policy.fairshare_slack, hold_s=inv.policy.fairshare_hold,
                              seen=fairshare.shared_gpus(reports, usable),
                              settling=now - self.released_at < fairshare.settle_s(inv.policy.idle_for,
                                                                                   inv.policy.probe_interval))
        before, self.plan, self.me = self.plan, plan, me
        if plan.release and plan.release != before.release:
            self.released_at = now
            log.info("Fair share: %s.", plan.reason)
            for host, n in plan.release.items():
                await ctl._event(EventKind.FAIRSHARE, host,
                                 f"released {n} GPU{'s' if n != 1 else ''} on {host} to job "
                                 f"{plan.to.split('/', 1)[-1]} (fair share {plan.share} of {plan.pool})")
        if plan.release:
            limits = pol.fair_limits(limits, ctl.records, plan.release, plan.reason)
        return limits, plan.cap
