"""Errors that end a run: before it starts (exit code 2), after too many failures (3), or when its
output cannot be written (4)."""

import re
from pathlib import Path



# userinfo in a URL (scheme://user:secret@host): never stored, exported nor printed (docs/security.md)
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s'\"]*@")


def redact(text: str) -> str:
    """`text` with the userinfo of every URL in it replaced by ***."""
    return _USERINFO.sub(r"\1***@", text)


def shown(text: str, lines: bool = True) -> str:
    """`text` safe to show a person: a name's control characters (escape codes that would drive the
    terminal, a bell, bidirectional overrides) as \\xNN or \\uNNNN, and bytes that are not UTF-8 (lone
    surrogates, as Python reads such names) as \\xNN; line breaks and tabs of the message kept
    (`lines`), or escaped too where the text must stay one line (a field read from a file)."""
    if text.isprintable():
        return text
    out = []
    kept = "\n\t" if lines else ""
    for c in text:
        if c.isprintable() or c in kept:
            out.append(c)
        elif "\udc80" <= c <= "\udcff":
            out.append(f"\\x{ord(c) - 0xDC00:02x}")
        else:
            out.append(f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
    return "".join(out)


def no_credentials(url: str, what: str) -> None:
    """Refuse a URL that carries credentials (they would land in OUT's manifest, its exports and
    every message): one line, exit 2, the secret not echoed."""
    if _USERINFO.match(url):
        raise UsageError(
            f"{what} {redact(url)}: a URL with credentials in it is refused, as they would be stored in "
            "OUT's manifest and printed; give them another way (~/.netrc for http(s)://, the AWS_* "
            "variables or a profile for s3://)"
        )


SAVED = "; the files finished before are saved, re-run to resume"  # what an OutputError mid-run adds (output/store.py); said without it where nothing ran

class UsageError(Exception):
    """A bad flag, model, device or output folder: one line for the user, exit code 2."""


class TooManyFailures(Exception):
    """--max-failures was exceeded: the run stops after saving what it finished (exit 3)."""


class OutputError(Exception):
    """The output folder stopped taking writes mid-run (disk full, permissions): exit code 4."""


def first_lines(messages: list[str], limit: int = 3) -> str:
    """'a; b; c … (N more)' for reports of many failures."""
    shown = "; ".join(messages[:limit])
    more = len(messages) - limit
    return shown + (f" … ({more} more)" if more > 0 else "")


def reason(e: Exception) -> str:
    """An OSError's or a SafetensorError's reason in words. A SafetensorError has no strerror: it
    wraps the OS error in its message ("Error while serializing: I/O error: No space left on device
    (os error 28)")."""
    found = re.search(r'([^:"]+) \(os error \d+\)', str(e))
    return getattr(e, "strerror", None) or (found and found.group(1).strip()) or str(e).splitlines()[0]


def one_line(e: Exception) -> str:
    """An exception in one short line for a warning (compiler and kernel errors run long)."""
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def output_error(what: str, where: Path | str, e: Exception, saved: int | None = None) -> OutputError:
    """`saved`: the files this run saved before, where known; none is said as none, not as 'saved'."""
    if saved == 0:
        then = "no file of this run was saved (what earlier runs saved stays); re-run once it is writable"
    else:
        then = "the files finished before are saved, re-run to resume once it is writable"
    return OutputError(f"cannot write {what} in {where}: {reason(e)}; {then}")
