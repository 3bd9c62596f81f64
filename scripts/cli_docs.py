"""Write docs/cli.md from the `--help` of every command, so the reference cannot drift.

    python scripts/cli_docs.py          # rewrite docs/cli.md
    python scripts/cli_docs.py --check  # exit 1 when docs/cli.md differs (the suite runs this)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
WIDTH = 100  # help text is wrapped to the terminal; a fixed width makes it reproducible


def help_text(args: list[str]) -> str:
    from typer.testing import CliRunner

    from gemma4enc.commands.cli import app

    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": str(WIDTH), "TERM": "dumb", "NO_COLOR": "1"},
                                terminal_width=WIDTH, prog_name="gemma4enc")
    if result.exit_code != 0:
        raise SystemExit(f"gemma4enc {' '.join(args)} --help exited {result.exit_code}: {result.output}")
    return "\n".join(line.rstrip() for line in result.output.strip().splitlines())


def render() -> str:
    import typer

    from gemma4enc.commands.cli import app

    commands = list(typer.main.get_command(app).commands)  # in the order cli.py declares them
    parts = ["# Command-line reference", "",
             "Generated from each command's `--help` by `python scripts/cli_docs.py`; the test suite",
             "checks that it matches, so edit the help texts in `gemma4enc/commands/cli.py`, not this file.", "",
             "```text", help_text([]), "```"]
    for name in commands:
        parts += ["", f"## `gemma4enc {name}`", "", "```text", help_text([name]), "```"]
    return "\n".join(parts) + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is out of date: run python scripts/cli_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("COLUMNS", str(WIDTH))
    sys.exit(main())
