"""What a run did, counted as its rows land: `Summary`, what `encode --json` reports. Apart from the
pipeline (which imports torch) so that a run with nothing to do reports one without it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import TooManyFailures
from ..rows import Row, Status


@dataclass
class Summary:
    files: int = 0
    ok: int = 0
    failed: int = 0
    frames: int = 0
    patches: int = 0
    tokens: int = 0
    seconds: float = 0.0
    decode_wait: float = (
        0.0  # seconds the towers' feeder waited for decoded files (decode-bound when large)
    )
    # seconds it waited for files that came back with no pixels for want of time or of the file
    # (timeout, not_found, unreadable): more workers would not have made those come sooner
    stalled_wait: float = 0.0
    by_status: dict[str, int] = field(default_factory=dict)
    device_patches: list[int] = field(default_factory=list)  # patches each tower encoded
    where: dict = field(
        default_factory=dict
    )  # what the engine ran on (device, dtype, actors …), for the report

    def record(self, rows: list[Row], patches: int) -> None:
        """Count finished files by their manifest rows, and the patches they took."""
        for r in rows:
            status = str(r.status)
            self.files += 1
            self.by_status[status] = self.by_status.get(status, 0) + 1
            if status == Status.OK:
                self.ok += 1
                self.frames += r.frames
            else:
                self.failed += 1
            self.tokens += r.tokens or 0
        self.patches += patches

    def check(self, max_failures: int | None) -> None:
        """--max-failures: raise TooManyFailures once more files than that have failed."""
        if max_failures is not None and self.failed > max_failures:
            raise TooManyFailures(f"{self.failed} files failed, more than --max-failures {max_failures}")


NOTHING_TIMED = {
    "tower_waited_share": None,
    "decode_files_per_s_per_worker": None,
}  # a run that decoded nothing
