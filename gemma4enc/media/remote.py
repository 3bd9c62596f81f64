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


# The client for requests gemma4enc retries itself (output/store.py, reach): one attempt each.
# botocore retries inside every call and s3fs retries botocore's call in rounds; with ours on top a
# store that went down cost 8 × 5 × 5 attempts, minutes, where our own backoff alone bounds it.
ONE_TRY = {"s3": {"config_kwargs": {"retries": {"total_max_attempts": 1}}}}
ONE_TRY["s3a"] = ONE_TRY["s3"]


def filesystem(url: str, one_try: bool = False):
    """(fsspec filesystem, its path for `url`); a protocol whose package is missing is a usage error.
    `one_try`: a client of its own that does not retry (the caller does, with a bound)."""
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise UsageError(f"{url}: reading URLs needs fsspec: pip install 'gemma4enc[s3]'") from None
    options = ONE_TRY.get(url.split("://", 1)[0], {}) if one_try else {}
    try:
        fs, path = url_to_fs(url, **options)
        if options:
            fs.retries = 1  # s3fs's rounds (an attribute, not an argument; this instance is ours)
        return fs, path
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
    except Exception as e:  # noqa: BLE001 - each protocol names its failures its own way
        line = refusal(e, url) or (unreached_line(e, url) if unreached(e) else first_line(e))
        raise UsageError(f"{url}: {line}") from None
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
    """A whole object (a --files-from list); its store's no is an OSError, as a local file's, in
    words that name what to fix."""
    fs, path = filesystem(url)
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - each protocol names its failures its own way
        line = refusal(e, url) or (unreached_line(e, url) if unreached(e) else first_line(e))
        raise OSError(line) from None


def open_url(url: str):
    """A seekable binary file object for `url` (fsspec's, read ahead in blocks)."""
    fs, path = filesystem(url)
    return fs.open(path, "rb")


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    return fs.exists(path)


# ── a store's answers that retrying cannot change ──────────────────────────────────────────────

# what to set, per protocol, for credentials and for the endpoint
_KEYS = {
    "s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS (or gcloud auth application-default login)",
}
_KEYS |= {"s3a": _KEYS["s3"], "gcs": _KEYS["gs"]}
_ENDPOINT = {"s3": "AWS_ENDPOINT_URL", "s3a": "AWS_ENDPOINT_URL"}
# the store's codes for keys it does not know or cannot check (not: keys it knows that may not)
_BAD_KEYS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
             "TokenRefreshRequired", "AuthorizationHeaderMalformed", "InvalidClientTokenId"}
# a connection that never got an answer: refused, a name that does not resolve, a connect timeout
_UNREACHED = ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError",
              "ClientConnectorDNSError", "ConnectionRefusedError", "gaierror", "ServerTimeoutError")


def _names(e: BaseException) -> set[str]:
    """The class names of `e` and of what it wraps (s3fs keeps botocore's error as the cause)."""
    names, seen = set(), 0
    while e is not None and seen < 5:
        names |= {c.__name__ for c in type(e).__mro__}
        e, seen = e.__cause__ or e.__context__, seen + 1
    return names


def _code(e: BaseException) -> str | None:
    for inner in (e, e.__cause__, e.__context__):
        code = getattr(inner, "response", {}).get("Error", {}).get("Code") if inner is not None else None
        if code:
            return str(code)
    return None


def refusal(e: BaseException, url: str) -> str | None:
    """For an error no retry can mend, one line naming what to fix: no credentials, keys the store
    refuses, access denied. None for anything else (a 503, a dropped connection: worth a retry)."""
    protocol = url.split("://", 1)[0]
    keys = _KEYS.get(protocol, f"the credentials {protocol}:// uses")
    names = _names(e)
    if any("Credentials" in n or n in ("NoAuthTokenError", "TokenRetrievalError") for n in names):
        return f"no credentials for {protocol}:// were found: set {keys}"
    if isinstance(e, PermissionError) or "PermissionError" in names:
        code, said = _code(e), first_line(e)
        if code in _BAD_KEYS:
            return f"the store does not accept these credentials ({said}): check {keys}"
        return (f"access denied ({said}): check {keys}, and that they may use {url}")
    return None


def unreached(e: BaseException) -> bool:
    """Whether `e` says no connection was made at all (refused, no such host, a connect timeout)."""
    return bool(_names(e) & set(_UNREACHED))


def unreached_line(e: BaseException, url: str) -> str:
    """One line for a store that never answered, naming the endpoint and what sets it."""
    import os
    import re

    protocol = url.split("://", 1)[0]
    found = re.search(r'(https?://[^/"\s]+)', str(e))
    endpoint = found.group(1) if found else os.environ.get(_ENDPOINT.get(protocol, ""), "")
    setting = _ENDPOINT.get(protocol)
    where = f" at {endpoint}" if endpoint else ""
    hint = f"check {setting} (now {os.environ[setting]!r}) or that the store is up" if setting and \
        os.environ.get(setting) else "check the network, or that the store is up"
    return f"cannot reach the store{where} ({type(e).__name__}): {hint}"


def first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def reach(url: str) -> None:
    """Ask the store once about `url` before a run depends on it: credentials it lacks or refuses,
    or an endpoint that does not answer, is a UsageError (exit 2) naming what to fix. A path that
    is not there is the caller's to say."""
    fs, path = filesystem(url, one_try=True)
    try:
        fs.info(path)
    except FileNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001 - each protocol names its failures its own way
        line = refusal(e, url) or (unreached_line(e, url) if unreached(e) else None)
        if line:
            raise UsageError(f"{url}: {line}") from None
