"""The usage ledger: what the job used, when, and how each use ended (issue 13).

`<controller state dir>/usage.db`, an SQLite file (WAL) with one writer, the job's
controller (`recorder.UsageRecorder`, fed once per observation), read by
`eltctl usage` and `eltctl status --watch` (`figures`). `db` holds the file's
schema. The recorder imports the controller's observation types; this package's
top level stays light so that the CLI's readers do not load them.
"""

from eltctl.ledger.db import DB_NAME, LedgerError, open_reader, open_writer
from eltctl.ledger.figures import BY_CHOICES, first_seen, gpu_seconds, samples, slot_kinds, timeline, usage

__all__ = ["BY_CHOICES", "DB_NAME", "LedgerError", "first_seen", "gpu_seconds", "open_reader", "open_writer",
           "samples", "slot_kinds", "timeline", "usage"]
