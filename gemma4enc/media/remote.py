"""Inputs by URL (s3://, gs://, file://, any protocol fsspec knows): the walk, a file's size and
mtime from the listing, its first bytes, and a file object to decode from.

fsspec is imported only when a URL is given: a run over local folders never loads it. Credentials
and endpoints are the protocol's own (s3fs reads AWS_* variables, AWS_ENDPOINT_URL, profiles, the
instance role), so there is nothing of ours to configure.
"""

from __future__ import annotations

import re
from typing import Iterable

from ..errors import UsageError

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# the package each protocol's filesystem comes in, for the line that says what to install
EXTRA = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}


def is_url(path: str) -> bool:
    """Whether `path` names a file through fsspec; absolute local paths are ruled out by their first byte."""
    return path[:1] != "/" and _URL.match(path) is not None


def filesystem(url: str):
    """(fsspec filesystem, its path for `url`); a protocol whose package is missing is a usage error."""
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise UsageError(f"{url}: reading URLs needs fsspec: pip install 'gemma4enc[s3]'") from None
    try:
        return url_to_fs(url)
    except ImportError as e:
        protocol = url.split("://", 1)[0]
        if protocol in EXTRA:
            package, extra = EXTRA[protocol]
            raise UsageError(
                f"{url}: {protocol}:// needs {package}: pip install 'gemma4enc[{extra}]'"
            ) from None
        raise UsageError(f"{url}: {str(e).splitlines()[0]}") from None  # fsspec's words name the package
    except ValueError as e:  # an unknown protocol
        raise UsageError(f"{url}: {e}") from None


def join(fs, path: str) -> str:
    """The URL of a filesystem path: how items are keyed in the manifest."""
    return fs.unstrip_protocol(path)


def stamp(info: dict) -> int:
    """A file's mtime in ns from its listing; where the store keeps none, a number made from its ETag
    (it changes whenever the content does), so that a re-run compares it like an mtime."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "modified", "created", "time"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):  # a datetime
            return int(value.timestamp() * 1e9)
        if isinstance(value, (int, float)):
            return int(value * 1e9) if value < 1e12 else int(value)
        if isinstance(value, str):
            from datetime import datetime

            try:
                return int(datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() * 1e9)
            except ValueError:
                continue
    tag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("checksum")
    if tag:
        import hashlib

        return int.from_bytes(hashlib.sha256(str(tag).strip('"').encode()).digest()[:7], "big")
    return 0


def _is_file(info: dict) -> bool:
    return info.get("type") != "directory"


def walk(
    url: str, hidden: bool = False, errors: list | None = None
) -> Iterable[tuple[str, str, str, dict]]:
    """(url, its part past the root, root url, listing info) for every file under `url`, one folder's
    listing at a time; `url` itself when it is a file. Hidden names (a leading dot) are skipped as
    locally; a folder that cannot be listed goes to `errors`."""
    fs, top = filesystem(url)
    top = top.rstrip("/")
    try:
        info = fs.info(top)
    except FileNotFoundError:
        raise UsageError(f"{url}: no such file or folder") from None
    except OSError as e:
        raise UsageError(f"{url}: {e}") from None
    root = join(fs, top)
    if _is_file(info):
        yield root, root.rsplit("/", 1)[-1], None, info
        return
    cut = len(top) + 1
    try:
        for folder, dirs, files in fs.walk(top, detail=True):
            if not hidden:
                for name in [d for d in dirs if d.startswith(".")]:
                    del dirs[name]
            for name in sorted(files):
                if hidden or not name.startswith("."):
                    entry = files[name]
                    path = entry.get("name") or f"{folder}/{name}"
                    yield join(fs, path), path[cut:], root, entry
    except OSError as e:
        if errors is None:
            raise
        errors.append((root, str(e)))


def head(url: str, n: int) -> tuple[int, int, bytes | None]:
    """(size, mtime_ns, first n bytes) of one URL; n=0 reads nothing (None)."""
    fs, path = filesystem(url)
    info = fs.info(path)
    size = int(info.get("size") or 0)
    return size, stamp(info), (fs.cat_file(path, start=0, end=n) if n and size else b"" if n else None)


def first_bytes(url: str, n: int) -> bytes:
    fs, path = filesystem(url)
    return fs.cat_file(path, start=0, end=n)


def read_bytes(url: str) -> bytes:
    """A whole object (a --files-from list); its store's no is an OSError, as a local file's."""
    fs, path = filesystem(url)
    try:
        return fs.cat_file(path)
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - each protocol names its failures its own way
        raise OSError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def open_url(url: str):
    """A seekable binary file object for `url` (fsspec's, read ahead in blocks)."""
    fs, path = filesystem(url)
    return fs.open(path, "rb")


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    return fs.exists(path)
