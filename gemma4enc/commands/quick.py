"""`gemma4enc search OUT FILE... [-k N] [--files-from LIST] [--json] [-q]` answered without building
the Typer app, and the answer both ways (`answer`).

Why: a cached query over a million files is mostly the start of its process, and Typer's share
of that (the other commands' modules imported to register them, and its parsing, which builds a
pydantic adapter for every parameter) was as much as the search itself (docs/benchmarks.md). So
console() hands the plainest form of the command here first. Only that form: any other flag,
`--opt=value`, a flag given twice, -k that is not a number, --help, goes to Typer as before, so
Typer stays the one source of usage messages; what this path runs after parsing is what the
command runs (`answer`), and its errors end as the command's do (app.ended).
"""

from __future__ import annotations

import json
import sys

VALUED = {"-k": "k", "--top": "k", "--files-from": "files_from"}
SWITCHES = {"-q": "quiet", "--quiet": "quiet", "--json": "json_out"}


def plain_search(argv: list[str]) -> dict | None:
    """The parameters of a plain `search` command line, or None for any other (Typer's to parse)."""
    if not argv or argv[0] != "search":
        return None
    got: dict = {"k": 10, "files_from": None, "quiet": False, "json_out": False}
    seen, positional, rest, i = set(), [], False, 1
    while i < len(argv):
        arg = argv[i]
        i += 1
        if rest or arg == "-" or not arg.startswith("-"):
            positional.append(arg)
        elif arg == "--":
            rest = True
        elif arg in VALUED and i < len(argv):
            key = VALUED[arg]
            if key in seen:
                return None
            seen.add(key)
            got[key] = argv[i]
            i += 1
        elif arg in SWITCHES:
            got[SWITCHES[arg]] = True
        else:
            return None
    k = str(got["k"])
    if not k.removeprefix("-").isdigit() or not k.isascii():
        return None  # a number as Typer reads it, and only that ("5_0", " 5", "٥" are its to judge)
    got["k"] = int(k)
    if not positional or (len(positional) == 1 and got["files_from"] is None):
        return None  # no OUT, or nothing to search for: Typer's usage errors say so
    return got | {"out": positional[0], "files": positional[1:]}


def run(argv: list[str]) -> int | None:
    """The exit code of a plain search command line, run here; None for any other."""
    got = plain_search(argv)
    if got is None:
        return None
    from ..run.search import query_files
    from .log import Sink, forwarded

    try:
        with forwarded(Sink(got["quiet"])):
            wanted = query_files(got["files"], got["files_from"])
            return answer(got["out"], wanted, got["k"], "auto", got["json_out"], got["quiet"])
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - as Command.invoke: every way out gets its code and line
        from .app import ended

        return ended(e, "search", got["json_out"])


def echo(text: str, err: bool = False) -> None:
    """One line of ours, flushed, without importing Typer. Names in it are shown escaped on a terminal
    and in every message on stderr (errors.shown: a file name's escape codes never drive a terminal);
    on stdout into a pipe they are written exactly, so a script gets the real path (click's echo would
    strip what looks like an ANSI code out of a name)."""
    from ..errors import shown

    stream = sys.stderr if err else sys.stdout
    if err or stream.isatty():
        text = shown(text)
    stream.write(text + "\n")
    stream.flush()


def answer(out: str, wanted: list[str], k: int, device: str, json_out: bool, quiet: bool) -> int:
    """search's FILES form, printed: the nearest of each, or the JSON report; 1 when one failed."""
    from ..errors import UsageError
    from ..run.search import Searcher
    from .log import Bar

    if not wanted:
        raise UsageError("no file to search for: the folders and --files-from listed none")
    say = (lambda m: None) if quiet else (lambda m: echo(f"gemma4enc: {m}", err=True))
    with Searcher(out, device, log=say) as searcher:
        report = searcher.query(wanted, k, bar=lambda n: Bar(n, True)) | {"out": str(out)}
    if json_out:
        echo(json.dumps(report, indent=2))
    else:
        for result in report["results"]:
            if len(report["results"]) + len(report["failed"]) > 1:  # a tar's members too
                echo(f"{result['file']}:")
            echo("\n".join(f"{hit['score']:.4f}  {hit['path']}" for hit in result["hits"]))
    for failure in report["failed"]:
        say(f"{failure['file']}: {failure['error']}")
    return 1 if report["failed"] else 0
