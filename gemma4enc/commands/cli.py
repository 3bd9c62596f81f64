"""The console script: the app with every command registered (app.py, running.py, folder.py, tools.py).

stdout carries data (--json), stderr carries progress and messages. Every command runs
through `Command.invoke`, the one place where an error becomes its exit code (EXIT_CODES,
the README's exit-code table): one line on stderr, and with --json an {"error", "exit_code"} object.
"""

from __future__ import annotations

import os
import sys

# each registers its commands on the app, in the order --help lists them
from . import running  # noqa: F401 - encode, plan (demo)

# isort: split
from . import folder, tools  # noqa: F401
from .app import app

__all__ = ["app", "main"]


def main() -> None:
    """The console script: every command maps its errors to EXIT_CODES (see Command)."""
    # Before torch loads OpenMP: its threads sleep when they run out of work instead of spinning.
    # On a CPU shared with anything else, a spinning thread takes the core its busy sibling needs,
    # and the tower loses far more than the cores it shares (docs/benchmarks.md). A value already
    # in the environment is kept.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        app()
    except KeyboardInterrupt:  # one that lands past the command's own handling: still exit 130
        sys.exit(130)
