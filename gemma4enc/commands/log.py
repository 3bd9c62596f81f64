"""What a person reads: messages on stderr (and in --log-file), durations, the summary line, reports.

Progress lines and the summary carry a timestamp, so a cron log says when; the log file
carries one on every line.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time

from ..errors import redact, shown


class Sink:
    """stderr unless quiet, and every line, timestamped, in the --log-file (opened for appending)."""

    def __init__(self, quiet: bool = False, path=None):
        self.quiet, self.path = quiet, path
        try:
            self.file = open(path, "a", encoding="utf-8", errors="backslashreplace") if path else None
        except OSError as e:
            from ..errors import UsageError

            raise UsageError(f"--log-file {path}: {e.strerror or e}") from None

    def __call__(self, text: str, stamp: bool = False, error: bool = False, screen: bool = True) -> None:
        """One line; errors reach stderr even when quiet; screen=False: the log file only."""
        now = time.strftime("%Y-%m-%d %H:%M:%S")
        text = shown(redact(text))  # no credentials, no escape codes from a name (docs/security.md)
        if error or (screen and not self.quiet):
            print(f"{now} {text}" if stamp else text, file=sys.stderr, flush=True)
        if self.file:
            try:
                self.file.write(f"{now} {text}\n")
                self.file.flush()
            except OSError as e:  # a full disk: the run goes on, the log says no more
                self._drop(e)

    def _drop(self, e: OSError) -> None:
        self.close()
        with contextlib.suppress(OSError):
            print(
                f"gemma4enc: warning: --log-file {self.path}: {e.strerror or e}; it gets no more lines",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        file, self.file = self.file, None
        if file:
            with contextlib.suppress(OSError):  # its last lines did not fit: said when they were written
                file.close()


class Forward(logging.Handler):
    """Records of the `gemma4enc.*` loggers (the hub fetch's progress, layouts' skipped tensors) to
    a command's Sink, so that -q and --log-file apply to them as to every other line."""

    def __init__(self, sink: Sink):
        super().__init__(logging.INFO)
        self.sink = sink  # encode swaps in its own (it has --log-file)

    def emit(self, record: logging.LogRecord) -> None:
        self.sink(record.getMessage(), error=record.levelno >= logging.ERROR)


@contextlib.contextmanager
def forwarded(sink: Sink):
    """While a command runs: gemma4enc's log records, INFO and up, go to `sink` (and still propagate,
    to a handler the caller may have; with none, Python would print only WARNING and up, ignoring -q)."""
    logger, handler = logging.getLogger("gemma4enc"), Forward(sink)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def duration(seconds: float) -> str:
    """45 s, 3 min 12 s, 2 h 05 min."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return ""


def summary_line(report: dict, shards: int, shard_bytes: int, seconds: float) -> str:
    """ "1,204 ok, 3 failed (decode_error 2, timeout 1), 2 shards, 412.0 MB, 3 min 12 s"."""
    failed = {k: v for k, v in report["by_status"].items() if k != "ok"}
    why = f" ({', '.join(f'{k} {v:,}' for k, v in sorted(failed.items()))})" if failed else ""
    before = f", {report['done_before']:,} done before" if report["done_before"] else ""
    return (
        f"{report['encoded']:,} ok, {report['failed']:,} failed{why}{before}; OUT holds {shards:,} shard(s), "
        f"{size(shard_bytes)}; {duration(seconds)}"
    )


def _text(value) -> str:
    if value is None or value == [] or value == {}:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, dict):
        return ", ".join(
            f"{k} {_text(v) if not isinstance(v, dict) else '(' + _text(v) + ')'}"
            for k, v in value.items()
        )
    return str(value)


def report_lines(report: dict) -> list[str]:
    """A report as aligned `label  value` lines; a list of strings becomes one indented line each."""
    width = max((len(k) for k in report), default=0)
    lines = []
    for key, value in report.items():
        label = key.replace("_", " ").ljust(width)
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            lines.append(f"{label}  {len(value):,}")
            lines += [f"{'':{width}}    {v}" for v in value]
        else:
            lines.append(f"{label}  {_text(value)}")
    return lines


class Bar:
    """Progress on stderr: a rich bar on a terminal, elsewhere a timestamped line every few seconds
    with elapsed time and ETA (those lines also go to --log-file)."""

    def __init__(self, total: int, quiet: bool, say=None):
        import time

        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.time, self.start, self.last = time, time.perf_counter(), 0.0
        self.total, self.files, self.patches, self.quiet = total, 0, 0, quiet
        self.say = say
        console = Console(stderr=True)
        self.bar = None
        if not quiet and console.is_terminal:
            self.bar = Progress(
                TextColumn("encoding"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeRemainingColumn(),
                console=console,
            )
            self.task = self.bar.add_task("encode", total=total, rate="")
            self.bar.start()

    def advance(self, files: int, patches: int) -> None:
        self.files += files
        self.patches += patches
        elapsed = max(self.time.perf_counter() - self.start, 1e-9)
        rate = f"{self.files / elapsed:.1f} items/s {self.patches / elapsed:,.0f} patches/s"
        if self.bar:
            self.bar.update(self.task, advance=files, rate=rate)
        if (self.say or not self.quiet) and (elapsed - self.last >= 5 or self.files == self.total):
            from .log import duration

            self.last = elapsed
            eta = duration((self.total - self.files) * elapsed / self.files) if self.files else "?"
            line = (
                f"gemma4enc: {self.files:,}/{self.total:,} files ({100 * self.files / max(self.total, 1):.0f}%), "
                f"{rate}, elapsed {duration(elapsed)}, ETA {eta}"
            )
            if self.say:
                self.say(line, stamp=True, screen=self.bar is None)  # the bar shows it on a terminal
            elif not self.bar:
                print(line, file=sys.stderr, flush=True)

    def grow(self, files: int) -> None:
        """More files to do, found while the run went on (a streamed discovery)."""
        self.total += files
        if self.bar:
            self.bar.update(self.task, total=self.total)

    def close(self) -> None:
        if self.bar:
            self.bar.stop()
