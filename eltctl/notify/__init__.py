"""Notifications: the controller tells a webhook and/or a command what happened to the job.

`events` (pure) turns the successive status documents the controller writes into
notification events (finished, failed, paused, resumed, stalled, benched, quota,
forged); `bodies` (pure) is what each target receives; `delivery.Notifier` sends them
from a thread of its own, with a timeout and retries, so a dead endpoint never slows
the controller's loop, and records every delivery (notify.json in the job's state
directory; the status document's `notify`). docs/notifications.md is the user's side.
"""

from eltctl.notify.bodies import command_input, webhook_request
from eltctl.notify.delivery import Notifier
from eltctl.notify.events import Watch, notification, watch

__all__ = ["Notifier", "Watch", "command_input", "notification", "watch", "webhook_request"]
