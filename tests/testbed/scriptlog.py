"""What rank 0's script printed under restart mode, read from every worker log of a job on
the test bed: the scripts print `step S world W restart R` each step and `resumed at step S
world W restart R` after a restart (examples/ddp_restart.py, hf_trainer.py, lightning_train.py)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.testbed.jobenv import wait_for

STEP = re.compile(r"^step (\d+) world (\d+) restart (\d+)", re.M)
RESUMED = re.compile(r"^resumed at step (\d+) world (\d+) restart (\d+)", re.M)


class ScriptLog:
    steps_wanted = 3  # steps `at` waits for unless told

    def __init__(self, bed_dir: Path, job: str) -> None:
        self.glob = f"*/home/.eltctl/jobs/{job}/*/workers/*.log"
        self.bed_dir = Path(bed_dir)

    def text(self) -> str:
        out = []
        for f in sorted(self.bed_dir.glob(self.glob)):
            try:
                out.append(f.read_text(errors="replace"))
            except OSError:
                pass
        return "\n".join(out)

    def steps(self) -> list[tuple[int, int, int]]:
        return [tuple(map(int, m)) for m in STEP.findall(self.text())]

    def resumed(self) -> dict[int, tuple[int, int]]:
        """restart count -> (step resumed at, world size)."""
        return {int(r): (int(s), int(w)) for s, w, r in RESUMED.findall(self.text())}

    def at(self, world: int, after_restart: int, steps: int | None = None, timeout: float = 180) -> int:
        """Wait for `steps` steps at `world` in a restart after `after_restart`; returns that restart."""
        steps = self.steps_wanted if steps is None else steps

        def ok():
            got = [r for _s, w, r in self.steps() if w == world and r > after_restart]
            return (max(got),) if len(got) >= steps else None  # a tuple: restart 0 (the first start) is falsy
        try:
            return wait_for(ok, timeout, f"{steps} script steps at world size {world} after restart "
                            f"{after_restart}", interval=0.3)[0]
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.text()[-4000:]}") from None
