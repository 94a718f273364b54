"""What the controller sends out besides status.json: notifications and metrics.

The loop (`loop.py`) calls `Outputs` at three points, each cheap and none waiting on
the network:

- `observe` after each read of the store: rank 0's end of the job (the `done` key)
  and the resizes among the new events (their pauses, `resizes`);
- `extend` when it makes the status document: adds `done`, `resizes` and `notify`
  (the deliveries' record, notify/delivery.py);
- `published` after status.json was written (about once a second): the notification
  events the document brings (notify/events.py `watch`) are queued on the notifier's
  thread (`Notifier.submit` returns at once), and `[controller] metrics_file` is
  rewritten with the document's figures (eltctl/metrics.py).

`start` and `stop` (by `__main__`) start and stop the notifier's thread; the
constructor does no I/O.
"""

from __future__ import annotations

import logging
import sqlite3
from typing import Any, Iterable

from eltctl.controller.statedir import StateDir
from eltctl.inventory import Inventory
from eltctl.notify import Notifier, Watch, watch
from eltctl_runtime.protocol import Keys

log = logging.getLogger("eltctl.controller")


class Outputs:
    """Notifications and metrics of one controller."""

    def __init__(self, inventory: Inventory, state: StateDir | None) -> None:
        self.inventory = inventory  # replaced by the loop's reload_inventory
        self.state = state
        self.notifier = Notifier(inventory.notify, state.notify_json if state is not None else None)
        self.watch = Watch()
        self.done: dict | None = None  # rank 0's `done` document: the job ended (finished, stop, failed)
        self.resizes: dict[str, Any] = {"count": 0, "pause_s": 0.0, "last_pause_s": None}
        self._last_event: dict | None = None
        self._ledger: sqlite3.Connection | None = None
        self._metrics_problem = ""

    def start(self) -> None:
        self.notifier.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.notifier.stop(timeout)
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    def reload(self, inventory: Inventory) -> None:
        self.inventory = inventory
        self.notifier.settings = inventory.notify

    # ----------------------------------------------------------------- observe

    async def observe(self, store, events: Iterable[dict]) -> None:
        for ev in self._new(events):
            pause = ev.get("pause_s")
            if isinstance(pause, (int, float)) and not isinstance(pause, bool):
                self.resizes["count"] += 1
                self.resizes["pause_s"] = round(self.resizes["pause_s"] + float(pause), 4)
                self.resizes["last_pause_s"] = float(pause)
        try:
            done = await store.get_json(Keys.DONE)
        except Exception:  # noqa: BLE001 - no store now: what was read stays
            return
        self.done = done if isinstance(done, dict) else None

    def _new(self, events: Iterable[dict]) -> list[dict]:
        """The events appended since the last call (the Observer keeps the last EVENTS_KEPT)."""
        items = list(events)
        if self._last_event is not None:
            for i in range(len(items) - 1, -1, -1):
                if items[i] is self._last_event:
                    items = items[i + 1:]
                    break
        if items:
            self._last_event = items[-1]
        return items

    # ----------------------------------------------------------------- the document

    def extend(self, doc: dict[str, Any]) -> dict[str, Any]:
        doc["done"] = dict(self.done) if self.done else None
        doc["resizes"] = dict(self.resizes)
        doc["notify"] = self.notifier.status() if self.inventory.notify.enabled else None
        return doc

    def published(self, doc: dict[str, Any], now: float) -> None:
        """Never raises: the loop writes the status outside its pass's error handling."""
        try:
            self._published(doc, now)
        except Exception:  # noqa: BLE001 - notifications and metrics are advisory; the loop goes on
            log.exception("Notifications or metrics failed on a status document.")

    def _published(self, doc: dict[str, Any], now: float) -> None:
        settings = self.inventory.notify
        if settings.enabled:
            self.watch, events = watch(self.watch, doc, now, settings.stall_after)
            for ev in events:
                log.info("Notification: %s: %s", ev["kind"], ev["detail"])
                self.notifier.submit(ev)
        path = self.inventory.controller.metrics_file
        if path is not None:
            self.write_metrics(path, doc, now)

    def write_metrics(self, path, doc: dict[str, Any], now: float) -> None:
        from eltctl.metrics import ledger_figures, render, write_metrics

        figures = None
        try:
            if self._ledger is None and self.state is not None and self.state.usage_db.exists():
                from eltctl.ledger import open_reader

                self._ledger = open_reader(self.state.usage_db)
            if self._ledger is not None:
                figures = ledger_figures(self._ledger, now, live=True)
        except Exception as exc:  # noqa: BLE001 - the metrics go on without the ledger's figures
            self._say(f"the usage ledger cannot be read for the metrics: {exc}")
        try:
            write_metrics(path, render(doc, figures, controller_alive=True))
        except OSError as exc:
            self._say(f"cannot write [controller] metrics_file {path}: {exc}")
        else:
            self._metrics_problem = ""

    def _say(self, problem: str) -> None:
        if problem != self._metrics_problem:  # once per problem, not every second
            log.warning("%s", problem[0].upper() + problem[1:])
            self._metrics_problem = problem


__all__ = ["Outputs"]
