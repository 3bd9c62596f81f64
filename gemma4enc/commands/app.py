"""The Typer app every command registers on, and its one way out: an error becomes its exit code
(EXIT_CODES, the README's table), one line on stderr and, with --json, an {"error", "exit_code"} object."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import traceback
from functools import partial
from typing import Annotated

import typer
from typer.core import TyperCommand

from ..errors import OutputError, TooManyFailures, UsageError, redact, shown
from ..options import Options

DEFAULT = Options()  # every default below is read from here: one place for each


EPILOG = (
    "Exit codes: 0 all ok · 1 some files failed (their rows say why) · 2 usage or preflight error · "
    "3 --max-failures exceeded · 4 the output folder stopped taking writes · 70 a bug (an "
    "internal error: please report it) · 130 interrupted · 141 stdout's reader went away."
)


# plain click help: rich markup would eat the brackets of pip install 'gemma4enc[ray]' and print <bool> on flags
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=EPILOG,
    help="Encode folders of images and videos with the Gemma 4 vision tower.",
)


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"gemma4enc {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_version, help="Print the version and exit."),
    ] = False,
):
    """Encode folders of images and videos with the Gemma 4 vision tower."""


# exit codes; 1 and 0 are the commands' own verdicts (some files failed / all is well)
EXIT_CODES = {UsageError: 2, TooManyFailures: 3, OutputError: 4, KeyboardInterrupt: 130}


EXIT_BUG = 70  # an exception we did not foresee (sysexits' EX_SOFTWARE): a bug to report


DEBUG = "GEMMA4ENC_DEBUG"  # =1: print the traceback of such an exception too
# a write that failed for want of room or a device (stdout or --log-file on a full disk): exit 4
UNWRITABLE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS}


def exit_for(error: BaseException, command: str) -> tuple[int, str, str]:
    """An exception that ends a command → (exit code, what kind of end, the one line that says why)."""
    code = next((c for kind, c in EXIT_CODES.items() if isinstance(error, kind)), EXIT_BUG)
    if code == 130:
        return (
            code,
            "interrupted",
            "finished files are saved, re-run to resume" if command == "encode" else "",
        )
    if code == EXIT_BUG and isinstance(error, OSError) and error.errno in UNWRITABLE:
        where = (
            error.filename or "stdout"
        )  # the report a command prints: stdout is the one without a name
        return 4, "error", f"cannot write to {where}: {error.strerror or error}"
    if code == EXIT_BUG:
        first = (str(error).splitlines() or [""])[0]
        return (
            code,
            "internal error",
            f"{type(error).__name__}: {first} (a bug; {DEBUG}=1 shows the traceback)",
        )
    return code, "aborted" if code == 3 else "error", str(error)


class Command(TyperCommand):
    """A command whose every way out is an exit code, one line on stderr, and a JSON object on
    stdout with --json: click's own usage errors (bad flag syntax) and ours alike."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for param in self.params:
            if param.param_type_name == "argument":
                _plain_argument(param)
        self.epilog = EPILOG

    def make_context(self, info_name, args, parent=None, **extra):
        wants_json = "--json" in args and any(p.name == "json_out" for p in self.params)
        try:
            ctx = super().make_context(info_name, list(args), parent, **extra)
        except typer.TyperException as e:  # click's usage errors, as typer vendors them
            _close_suggestions_only(e)
            _json_error(wants_json, e.format_message(), e.exit_code)
            raise
        ctx.meta["json_errors"] = wants_json
        return ctx

    def invoke(self, ctx):
        from .log import Sink, forwarded

        wants_json = ctx.meta.get("json_errors", False)
        try:
            with forwarded(Sink(ctx.params.get("quiet", False))) as handler:
                ctx.meta["log_handler"] = handler  # encode points it at its own Sink (--log-file)
                return super().invoke(ctx)
        except (typer.Exit, typer.Abort, SystemExit):
            raise  # a verdict the command gave itself (0, or 1: some files failed)
        except typer.TyperException as e:  # a flag's value that typer could not convert
            _json_error(wants_json, e.format_message(), e.exit_code)
            raise
        except BaseException as e:  # noqa: BLE001 - every other way out gets its code and its line
            raise typer.Exit(ended(e, ctx.info_name, wants_json)) from None


def ended(e: BaseException, command: str, wants_json: bool) -> int:
    """The last word on an exception that ends a command (one line on stderr, and the JSON object
    with --json); its exit code. Also the way out of search's quick path (quick.py)."""
    if isinstance(e, BrokenPipeError):  # `search OUT FILE | head -1`: the reader had enough
        _silence(sys.stdout)
        return 141  # as a tool that SIGPIPE ends
    code, kind, message = exit_for(e, command)
    message = shown(redact(message))  # no credentials, no escape codes from a name (docs/security.md)
    if code == EXIT_BUG and os.environ.get(DEBUG) == "1":
        traceback.print_exc()
    _say(lambda: typer.echo(f"gemma4enc: {kind}" + (f": {message}" if message else ""), err=True))
    if isinstance(e, OSError) and code == 4 and not e.filename:
        _silence(sys.stdout)  # stdout is what failed: its JSON cannot be given either
    _json_error(wants_json, f"{kind}: {message}" if code in (70, 130) else message, code)
    return code


def _close_suggestions_only(e) -> None:
    """click suggests any option loosely like a mistyped one (`--bogus`: "did you mean --out?"); only
    a near miss (`--ouput` for `--output`) is worth saying."""
    import difflib

    name, offered = getattr(e, "option_name", None), getattr(e, "possibilities", None)
    if name and offered:
        e.possibilities = [p for p in offered if difflib.SequenceMatcher(None, name, p).ratio() >= 0.8]


def _plain_argument(param) -> None:
    """An argument shown as `OUT` and `ROOTS...` in the help, as man pages do: Typer shows `{out}`
    in the usage line and a Python type (`<list[str]>`) beside it, which mean nothing to a user."""
    name = param.name.upper()
    param.metavar = name
    param.display_type_rich = lambda ctx: None  # its help line says what it takes
    usage = (name if param.required else f"[{name}]") + ("..." if param.nargs != 1 else "")
    param.get_usage_pieces = lambda ctx: [usage]


def _json_error(wanted: bool, message: str, code: int) -> None:
    if wanted:
        _say(lambda: typer.echo(json.dumps({"error": message, "exit_code": code})))


def _say(write) -> None:
    """A last word that may itself not fit (stdout on a full disk): the exit code still tells."""
    try:
        write()
    except OSError:
        _silence(sys.stdout)
        _silence(sys.stderr)


def _silence(stream) -> None:
    """Point a stream that cannot be written at /dev/null: what it still buffers would fail again at exit."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


command = partial(app.command, cls=Command)
