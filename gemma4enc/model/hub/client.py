"""The few hub calls we make, through huggingface_hub's own client: its endpoint (HF_ENDPOINT), token,
gated-repo errors, offline switch and session, so what works for `hf download` works here."""

from __future__ import annotations

import os
import re
import struct
from typing import Callable

from ...errors import UsageError

COMMIT = re.compile(r"[0-9a-f]{40}")  # a full commit hash, as the hub names a snapshot


MAX_HEADER = 100 << 20  # bytes: safetensors' own limit on a header
Log = Callable[[str], None]


def say(message: str) -> None:
    """The default log: an INFO record of `gemma4enc.model.hub`; the CLI shows it on stderr unless -q (log.forwarded)."""
    import logging

    logging.getLogger("gemma4enc.model.hub").info(f"gemma4enc: {message}")


class Hub:
    """The few hub calls we make, through huggingface_hub's session, headers and error types."""

    def __init__(self, repo_id: str, commit: str, log: Log):
        from huggingface_hub.utils import build_hf_headers

        self.repo_id, self.commit, self.log = repo_id, commit, log
        self.headers = build_hf_headers() | {
            "Accept-Encoding": "identity"
        }  # sizes and offsets are the file's
        self.served = 0  # body bytes received

    def url(self, filename: str) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(self.repo_id, filename, revision=self.commit)

    def get(self, filename: str) -> bytes:
        from huggingface_hub import constants
        from huggingface_hub.utils import hf_raise_for_status, http_backoff

        response = http_backoff(
            "GET", self.url(filename), headers=self.headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT
        )
        hf_raise_for_status(response)
        self.served += len(response.content)
        return response.content

    def optional(self, filename: str) -> bytes | None:
        """A file that may not exist: None for a 404."""
        from huggingface_hub.errors import EntryNotFoundError

        try:
            return self.get(filename)
        except EntryNotFoundError:
            return None

    def stream(self, filename: str, start: int = 0, end: int | None = None):
        """A context manager: the response to a GET of bytes [start, end) (206), or of the whole
        file (200) where the server ignores Range."""
        from huggingface_hub import constants
        from huggingface_hub.utils import http_stream_backoff

        headers = self.headers | ({"Range": f"bytes={start}-{'' if end is None else end - 1}"})
        # a broken body is ours to resume (from where it broke), not theirs to retry from the start
        return http_stream_backoff(
            "GET",
            self.url(filename),
            headers=headers,
            retry_on_exceptions=(),
            timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
        )

    def header(self, filename: str) -> tuple[bytes, int | None, bool]:
        """The file's 8-byte length + JSON header, its size, and whether Range was honoured: two
        Range requests; where the server sends the whole file instead (200), one stream read as
        far as the header's end."""
        from huggingface_hub.utils import hf_raise_for_status

        with self.stream(filename, 0, 8) as response:
            hf_raise_for_status(response)
            if response.status_code != 206:
                return self._head_of(response), _length(response), False
            first = response.read()[:8]
            total = response.headers.get("Content-Range", "").rpartition("/")[2]
        self.served += len(first)
        size = int(total) if total.isdigit() else None
        n = header_length(self.repo_id, filename, first)
        with self.stream(filename, 8, 8 + n) as response:
            hf_raise_for_status(response)
            if response.status_code != 206:
                return self._head_of(response), _length(response), False
            rest = response.read()
        self.served += len(rest)
        return first + rest[:n], size, True

    def _head_of(self, response) -> bytes:
        data = bytearray()
        for chunk in response.iter_bytes():
            data += chunk
            if len(data) >= 8 and len(data) >= 8 + header_length(self.repo_id, "", bytes(data[:8])):
                break  # the rest is not read
        self.served += len(data)
        return bytes(data)


def _length(response) -> int | None:
    length = response.headers.get("Content-Length", "")
    return int(length) if length.isdigit() else None


def hub_error(repo_id: str, e: Exception) -> UsageError:
    """huggingface_hub's answer (gated, not found, …) in one line."""
    return UsageError(f"{repo_id}: {type(e).__name__}: {str(e).splitlines()[0]}")


def resolve(repo_id: str, revision: str | None) -> tuple[str, set[str] | None]:
    """revision → (commit, the repo's file names or None where unknown): through HfApi's model
    info (one small API call); where that endpoint is not served (a mirror that only serves
    files), from the X-Repo-Commit of a HEAD on config.json, as hf_hub_download learns it."""
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError

    try:
        info = HfApi().model_info(repo_id, revision=revision)
        if info.sha:
            return info.sha, {s.rfilename for s in info.siblings} if info.siblings else None
    except GatedRepoError:
        raise
    except HfHubHTTPError:
        pass  # the files' own answers say whether the repo and the revision exist
    meta = get_hf_file_metadata(
        hf_hub_url(repo_id, "config.json", revision=revision), retry_on_errors=True
    )
    if not meta.commit_hash:
        raise UsageError(f"{repo_id}: the hub did not say which commit {revision or 'main'} is")
    return meta.commit_hash, None


def hub_host() -> str:
    from urllib.parse import urlparse

    from huggingface_hub import constants

    return urlparse(constants.ENDPOINT).hostname or ""


def host_resolves() -> bool:
    """Whether the hub's host name resolves (a failed lookup is quick; huggingface_hub would retry it)."""
    import socket

    try:
        socket.getaddrinfo(hub_host(), 443)
    except (OSError, UnicodeError):
        return False
    return True


def offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").lower() in (
        "1",
        "true",
        "yes",
        "on",
    )


def header_length(repo_id: str, filename: str, first: bytes) -> int:
    if len(first) < 8:
        raise UsageError(f"{repo_id}: {filename} is too short to be a safetensors file")
    (n,) = struct.unpack("<Q", first[:8])
    if n > MAX_HEADER:
        raise UsageError(f"{repo_id}: {filename} is not a safetensors file (header of {n:,} bytes)")
    return n
