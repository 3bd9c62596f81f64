"""Errors that end a run: before it starts (exit code 2) or when its output cannot be written (4)."""


class UsageError(Exception):
    """A bad flag, model, device or output folder: one line for the user, exit code 2."""


class OutputError(Exception):
    """The output folder stopped taking writes mid-run (disk full, permissions): exit code 4."""


class TooManyFailures(Exception):
    """--max-failures was exceeded: the run stops after saving what it finished (exit 3)."""


def first_lines(messages: list[str], limit: int = 3) -> str:
    """'a; b; c … (N more)' for reports of many failures."""
    shown = "; ".join(messages[:limit])
    more = len(messages) - limit
    return shown + (f" … ({more} more)" if more > 0 else "")
