"""Fetch only a hub checkpoint's vision tensors: its config, each safetensors header (by HTTP
Range requests) and the byte ranges of `vision_tower.*` / `embed_vision.*` (`vision_embedder.*`
for gemma4_unified), kept as a vision-only checkpoint folder in a cache keyed by repo and commit.

E2B ships one ~10 GB `model.safetensors` for ~0.35 GB of vision; 31B's vision sits in a ~50 GB
shard. Everything goes through huggingface_hub's own client (its endpoint, HF_ENDPOINT, token,
gated-repo errors, offline switch and session), so what works for `hf download` works here.

The cached folder (`cache_root()/<org>--<name>/<commit>/`) holds config.json (+ the processor
configs), a `model.safetensors` with only the vision tensors, and `fetch.json` (what was fetched,
written last: a folder without it is unfinished). Until then the weights grow in
`model.safetensors.part` with `model.safetensors.part.json` recording how far each range got,
so a cut connection or a killed run resumes with only the missing bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import UsageError

PARTS = ("vision_tower.", "embed_vision.", "vision_embedder.")  # the last: gemma4_unified's encoder-free vision
PREFIXES = ("model.", "")  # HF layout, and mlx conversions that drop "model."
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SMALL = ("config.json", "preprocessor_config.json", "processor_config.json")  # copied whole when present
SMALL_LIMIT = 4 << 20  # bytes: a "small" config larger than this is skipped, not copied
GAP = 64 << 10  # bytes: ranges this close are one request (the gap is read and dropped)
SAVE_EVERY = 16 << 20  # bytes: progress is recorded this often, so a killed run loses at most this much
PROGRESS_SECONDS = 10  # a progress line at most this often while a large fetch runs
RETRIES = 3  # a cut range is asked again for its rest this many times before the run gives up
MAX_HEADER = 100 << 20  # bytes: safetensors' own limit on a header
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
            "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 0.5, "F6_E2M3": 0.75,
            "F6_E3M2": 0.75}
DONE = "fetch.json"
COMMIT = re.compile(r"[0-9a-f]{40}")  # a full commit hash, as the hub names a snapshot
Log = Callable[[str], None]


def say(message: str) -> None:
    """The default log: an INFO record of `gemma4enc.hub`; the CLI shows it on stderr unless -q (log.forwarded)."""
    import logging

    logging.getLogger("gemma4enc.hub").info(f"gemma4enc: {message}")


def cache_root() -> Path:
    """$GEMMA4ENC_CACHE, else a folder beside huggingface_hub's cache (copying HF_HOME to an
    offline box carries it along)."""
    if os.environ.get("GEMMA4ENC_CACHE"):
        return Path(os.environ["GEMMA4ENC_CACHE"]).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "gemma4enc" / "vision"


def repo_folder(repo_id: str) -> Path:
    return cache_root() / repo_id.replace("/", "--")


def is_vision(key: str) -> bool:
    return any(key.startswith(prefix + part) for prefix in PREFIXES for part in PARTS)


@dataclass
class Piece:
    """One tensor's bytes: where they are in the source file and where they go in ours."""
    src: int  # absolute offset in the source file
    size: int
    dst: int  # absolute offset in the vision-only file


@dataclass
class Request:
    """One Range request: a run of nearby pieces of one source file."""
    file: str
    start: int  # absolute offsets in the source file, end exclusive
    end: int
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class Plan:
    header: bytes  # the vision-only file's 8-byte length + JSON header
    requests: list[Request]
    tensors: int
    vision_bytes: int  # tensor data, without headers
    source_bytes: int  # the weight files' total size, what a whole-file download would move
    skipped: list[str]  # weight files that hold no vision tensor
    unranged: set[str]  # files whose server ignored Range: streamed from the start

    @property
    def key(self) -> str:
        return hashlib.sha256(self.header).hexdigest()


class Hub:
    """The few hub calls we make, through huggingface_hub's session, headers and error types."""

    def __init__(self, repo_id: str, commit: str, log: Log):
        from huggingface_hub.utils import build_hf_headers

        self.repo_id, self.commit, self.log = repo_id, commit, log
        self.headers = build_hf_headers() | {"Accept-Encoding": "identity"}  # sizes and offsets are the file's
        self.served = 0  # body bytes received

    def url(self, filename: str) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(self.repo_id, filename, revision=self.commit)

    def get(self, filename: str) -> bytes:
        from huggingface_hub import constants
        from huggingface_hub.utils import hf_raise_for_status, http_backoff

        response = http_backoff("GET", self.url(filename), headers=self.headers,
                                timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT)
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
        return http_stream_backoff("GET", self.url(filename), headers=headers, retry_on_exceptions=(),
                                   timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT)

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
        n = _header_length(self.repo_id, filename, first)
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
            if len(data) >= 8 and len(data) >= 8 + _header_length(self.repo_id, "", bytes(data[:8])):
                break  # the rest is not read
        self.served += len(data)
        return bytes(data)


def _length(response) -> int | None:
    length = response.headers.get("Content-Length", "")
    return int(length) if length.isdigit() else None


def _header_length(repo_id: str, filename: str, first: bytes) -> int:
    if len(first) < 8:
        raise UsageError(f"{repo_id}: {filename} is too short to be a safetensors file")
    (n,) = struct.unpack("<Q", first[:8])
    if n > MAX_HEADER:
        raise UsageError(f"{repo_id}: {filename} is not a safetensors file (header of {n:,} bytes)")
    return n


def _header(hub: Hub, filename: str) -> tuple[dict, int, int | None, bool]:
    """A safetensors file's header → (entries, where its data starts, file size, Range honoured)."""
    raw, size, ranged = hub.header(filename)
    n = _header_length(hub.repo_id, filename, raw)
    try:
        entries = json.loads(raw[8: 8 + n])
    except ValueError as e:
        raise UsageError(f"{hub.repo_id}: {filename}: unreadable safetensors header ({e})") from None
    return entries, 8 + n, size, ranged


def _check(filename: str, key: str, entry: dict, data_start: int, size: int | None) -> tuple[int, int]:
    """One header entry's sanity → its absolute byte range."""
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    ok = (dtype in ITEMSIZE and isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
          and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
          and 0 <= offsets[0] <= offsets[1])
    if not ok:
        raise UsageError(f"{filename}: {key}: malformed safetensors entry {entry}")
    if offsets[1] - offsets[0] != math.ceil(math.prod(shape) * ITEMSIZE[dtype]):
        raise UsageError(f"{filename}: {key}: {offsets[1] - offsets[0]} bytes for {dtype} {shape}")
    start, end = data_start + offsets[0], data_start + offsets[1]
    if size is not None and end > size:
        raise UsageError(f"{filename}: {key} ends at byte {end:,}, past the file's {size:,}")
    return start, end


def plan(hub: Hub, files: list[str], skipped: list[str], metadata: dict) -> Plan:
    """Read every header, choose the vision tensors, lay out our file and group the reads."""
    chosen, unranged, source_bytes = [], set(), 0  # chosen: (file, key, entry, src start, src end)
    for filename in files:
        entries, data_start, size, ranged = _header(hub, filename)
        if not ranged:
            unranged.add(filename)
        source_bytes += size or 0
        for key, entry in entries.items():
            if key != "__metadata__" and is_vision(key):
                chosen.append((filename, key, entry, *_check(filename, key, entry, data_start, size)))
    if not chosen:
        raise UsageError(f"{hub.repo_id}: the checkpoint holds no vision_tower.* or embed_vision.* tensors")
    chosen.sort(key=lambda c: (files.index(c[0]), c[3]))  # source order: sequential reads
    layout, offset = {"__metadata__": metadata}, 0
    for filename, key, entry, start, end in chosen:
        layout[key] = {"dtype": entry["dtype"], "shape": entry["shape"], "data_offsets": [offset, offset + end - start]}
        offset += end - start
    text = json.dumps(layout, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    header = struct.pack("<Q", len(text)) + text
    requests, dst = [], len(header)
    for filename, key, entry, start, end in chosen:
        last = requests[-1] if requests else None
        if last and last.file == filename and 0 <= start - last.end <= GAP:
            last.end = max(last.end, end)
        else:
            last = Request(filename, start, end)
            requests.append(last)
        last.pieces.append(Piece(start, end - start, dst))
        dst += end - start
    return Plan(header, requests, len(chosen), offset, source_bytes, skipped, unranged)


class Progress:
    """How many bytes of each request are in the .part file, saved beside it as JSON."""

    def __init__(self, part: Path, plan: Plan, log: Log):
        self.path, self.plan, self.log = part.with_name(part.name + ".json"), plan, log
        self.done = [0] * len(plan.requests)
        try:
            saved = json.loads(self.path.read_text())
            if saved.get("plan") == plan.key and len(saved["done"]) == len(self.done) and part.is_file():
                self.done = [min(int(d), r.end - r.start) for d, r in zip(saved["done"], plan.requests)]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # nothing usable: start over
        self.unsaved, self.said = 0, time.monotonic()
        if any(self.done):
            log(f"resuming an earlier fetch: {plan.vision_bytes - self.missing:,} of {plan.vision_bytes:,} bytes "
                "already here")

    def add(self, i: int, n: int) -> None:
        self.done[i] += n
        self.unsaved += n
        if self.unsaved >= SAVE_EVERY:
            self.save()

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"plan": self.plan.key, "done": self.done}))
        os.replace(tmp, self.path)
        self.unsaved = 0
        if time.monotonic() - self.said >= PROGRESS_SECONDS and self.missing:
            self.said = time.monotonic()
            self.log(f"fetched {self.plan.vision_bytes - self.missing:,} of {self.plan.vision_bytes:,} vision bytes")

    @property
    def missing(self) -> int:
        return sum(r.end - r.start - d for r, d in zip(self.plan.requests, self.done))


def _write(out, request: Request, i: int, pos: int, chunk: bytes, progress: Progress) -> None:
    """Write the part of `chunk` (source bytes from `pos`) that extends request i's done bytes."""
    begin = request.start + progress.done[i]
    lo, hi = max(pos, begin), min(pos + len(chunk), request.end)
    if hi <= lo:
        return
    for piece in request.pieces:
        a, b = max(lo, piece.src), min(hi, piece.src + piece.size)
        if a < b:
            out.seek(piece.dst + a - piece.src)
            out.write(chunk[a - pos: b - pos])
    out.flush()  # the data is in the file before the progress that says so
    progress.add(i, hi - lo)


def _pull(hub: Hub, out, plan: Plan, progress: Progress, filename: str) -> None:
    """Fetch one file's missing ranges: a Range request each, or one stream where Range is ignored."""
    from huggingface_hub.utils import hf_raise_for_status

    todo = [(i, r) for i, r in enumerate(plan.requests) if r.file == filename and progress.done[i] < r.end - r.start]
    if not todo:
        return
    if filename in plan.unranged:
        with hub.stream(filename) as response:
            hf_raise_for_status(response)
            pos, last = 0, max(r.end for _, r in todo)
            for chunk in response.iter_bytes():
                hub.served += len(chunk)
                for i, r in todo:
                    _write(out, r, i, pos, chunk, progress)
                pos += len(chunk)
                if pos >= last:
                    break  # the rest of the file holds no vision byte: not read
        return
    for i, r in todo:
        with hub.stream(filename, r.start + progress.done[i], r.end) as response:
            hf_raise_for_status(response)
            pos = r.start + progress.done[i]
            said = response.headers.get("Content-Range")
            if response.status_code != 206 or (said is not None and not said.startswith(f"bytes {pos}-")):
                raise UsageError(f"{hub.repo_id}: {filename}: the server answered a Range request for byte {pos:,} "
                                 f"with {response.status_code} {response.headers.get('Content-Range', '')}".rstrip())
            for chunk in response.iter_bytes():
                hub.served += len(chunk)
                _write(out, r, i, pos, chunk, progress)
                pos += len(chunk)


def _weights(hub: Hub, folder: Path, plan: Plan) -> None:
    """Fill model.safetensors.part, resuming what an earlier try left, then rename it."""
    import httpx2

    part = folder / (SINGLE + ".part")
    progress = Progress(part, plan, hub.log)
    if plan.unranged:
        hub.log(f"the hub server ignores Range requests: streaming {', '.join(sorted(plan.unranged))} from the start "
                "and keeping only the vision bytes")
    with open(part, "r+b" if part.is_file() else "w+b") as out:
        out.write(plan.header)
        out.truncate(len(plan.header) + plan.vision_bytes)
        for attempt in range(RETRIES + 1):
            try:
                for filename in dict.fromkeys(r.file for r in plan.requests):
                    _pull(hub, out, plan, progress, filename)
            except (httpx2.TransportError, httpx2.StreamError) as e:  # a cut: keep what came, ask for the rest
                progress.save()
                hub.log(f"connection cut ({type(e).__name__}) with {progress.missing:,} vision bytes to go")
            if not progress.missing:
                break
            if attempt < RETRIES:
                hub.log(f"resuming: asking only for the {progress.missing:,} missing bytes")
        progress.save()
        if progress.missing:
            raise UsageError(f"{hub.repo_id}: {progress.missing:,} vision bytes did not arrive (the connection broke); "
                             "run again to resume")
        out.flush()
        os.fsync(out.fileno())
    _verify(part, plan)
    os.replace(part, folder / SINGLE)
    progress.path.unlink(missing_ok=True)


def _verify(part: Path, plan: Plan) -> None:
    """The file we wrote reads back as safetensors holding the planned tensors, at their sizes."""
    from safetensors import safe_open

    with safe_open(str(part), framework="numpy") as f:
        keys = list(f.keys())
    if len(keys) != plan.tensors or part.stat().st_size != len(plan.header) + plan.vision_bytes:
        raise UsageError(f"{part}: the written file does not match its plan; remove it and run again")


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _weight_files(hub: Hub, names: set[str] | None) -> tuple[list[str], list[str], dict | None]:
    """→ (the weight files holding a vision tensor, those skipped, the index). `names` None: the
    file list is not known, so the index is asked for and its absence means one file."""
    if names is None or INDEX in names:
        raw = hub.optional(INDEX)
        if raw is not None:
            index = json.loads(raw)
            weight_map = index["weight_map"]
            shards = list(dict.fromkeys(sorted(weight_map.values())))
            files = [f for f in shards if any(is_vision(k) for k, v in weight_map.items() if v == f)]
            return files, [f for f in shards if f not in files], index
    if names is None or SINGLE in names:
        return [SINGLE], [], None
    raise UsageError(f"{hub.repo_id}: no {SINGLE} or {INDEX} at commit {hub.commit}")


def download(repo_id: str, commit: str, names: set[str] | None, log: Log) -> dict:
    """Fetch config + vision bytes at `commit` into the cache; → the record written to fetch.json."""
    from filelock import FileLock

    folder = repo_folder(repo_id) / commit
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if (folder / DONE).is_file():  # another process finished it while we waited
            return _found(repo_id, folder, commit)
        hub = Hub(repo_id, commit, log)
        small = []
        for filename in SMALL:
            if names is None:  # not known: config.json must be there, the others may be
                data = hub.get(filename) if filename == "config.json" else hub.optional(filename)
            else:
                data = hub.get(filename) if filename in names else None
            if data is not None and len(data) <= SMALL_LIMIT:
                _atomic_write(folder / filename, data)
                small.append(filename)
        files, skipped, _ = _weight_files(hub, names)
        the_plan = plan(hub, files, skipped, {"format": "pt", "repo": repo_id, "commit": commit})
        log(f"{repo_id}@{commit[:12]}: fetching {the_plan.tensors} vision tensors ({the_plan.vision_bytes:,} bytes "
            f"in {len(the_plan.requests)} ranges) of {len(files)} file(s), {the_plan.source_bytes:,} bytes in all")
        _weights(hub, folder, the_plan)
        record = {"repo": repo_id, "commit": commit, "folder": str(folder), "files": small + [SINGLE],
                  "tensors": the_plan.tensors, "vision_bytes": the_plan.vision_bytes,
                  "bytes_fetched": hub.served, "source_files": files, "files_skipped": skipped,
                  "source_bytes": the_plan.source_bytes, "ranges": len(the_plan.requests),
                  "range_requests": not the_plan.unranged}
        _atomic_write(folder / DONE, json.dumps(record, indent=2).encode())
    return record


def _remember(repo_id: str, revision: str, commit: str) -> None:
    refs = repo_folder(repo_id) / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    _atomic_write(refs / revision.replace("/", "--"), commit.encode())


def config_file(repo_id: str, revision: str | None = None) -> Path:
    """A hub id's config.json alone: from our vision cache where it holds the revision, else as
    huggingface_hub downloads and caches it (its cache only, offline)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    found = cached(repo_id, revision)
    if found:
        return found[0] / "config.json"
    try:
        return Path(hf_hub_download(repo_id, "config.json", revision=revision,
                                    local_files_only=offline() or not _resolves()))
    except LocalEntryNotFoundError:
        raise UsageError(f"{repo_id}: its config.json is not in the cache and the hub cannot be reached "
                         f"(HF_HUB_OFFLINE, or {_host()} does not resolve)") from None
    except HfHubHTTPError as e:
        raise _hub_error(repo_id, e) from None


def _hub_error(repo_id: str, e: Exception) -> UsageError:
    """huggingface_hub's answer (gated, not found, …) in one line."""
    return UsageError(f"{repo_id}: {type(e).__name__}: {str(e).splitlines()[0]}")


def cached(repo_id: str, revision: str | None) -> tuple[Path, str] | None:
    """Our finished vision folder for this revision (a name we resolved before, or a commit), if any."""
    revision = revision or "main"
    ref = repo_folder(repo_id) / "refs" / revision.replace("/", "--")
    commit = ref.read_text().strip() if ref.is_file() else revision
    folder = repo_folder(repo_id) / commit
    return (folder, commit) if (folder / DONE).is_file() else None


def _snapshot(repo_id: str, revision: str | None, local_only: bool) -> tuple[Path, str | None] | None:
    """A full snapshot the user already has in the HF cache: config, index and every vision shard."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    def fetch(filename: str) -> Path:
        return Path(hf_hub_download(repo_id, filename, revision=revision, local_files_only=local_only))

    try:
        config = fetch("config.json")
        try:
            index = json.loads(fetch(INDEX).read_text())
            files = sorted({f for k, f in index["weight_map"].items() if is_vision(k)})
        except EntryNotFoundError:
            files = [SINGLE]
        for filename in files:
            fetch(filename)
    except (LocalEntryNotFoundError, EntryNotFoundError):
        return None
    return config.parent, config.parent.name if config.parent.parent.name == "snapshots" else None


def _resolve(repo_id: str, revision: str | None) -> tuple[str, set[str] | None]:
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
    meta = get_hf_file_metadata(hf_hub_url(repo_id, "config.json", revision=revision), retry_on_errors=True)
    if not meta.commit_hash:
        raise UsageError(f"{repo_id}: the hub did not say which commit {revision or 'main'} is")
    return meta.commit_hash, None


def _host() -> str:
    from urllib.parse import urlparse

    from huggingface_hub import constants

    return urlparse(constants.ENDPOINT).hostname or ""


def _resolves() -> bool:
    """Whether the hub's host name resolves (a failed lookup is quick; huggingface_hub would retry it)."""
    import socket

    try:
        socket.getaddrinfo(_host(), 443)
    except (OSError, UnicodeError):
        return False
    return True


def offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _local(repo_id: str, revision: str | None, why: str) -> tuple[Path, str | None]:
    """Offline: our vision cache, else a full HF snapshot, else the one-line error."""
    found = cached(repo_id, revision) or _snapshot(repo_id, revision, local_only=True)
    if found:
        return found
    raise UsageError(
        f"{repo_id}: not in the Hugging Face cache and {why}; fetch it first where there is a network "
        f"(`gemma4enc fetch {repo_id}`, or `hf download {repo_id}`) or pass a local checkpoint folder"
    )


def _found(repo_id: str, root: Path, commit: str | None) -> dict:
    """The record of a fetch that found everything here already."""
    record = json.loads((root / DONE).read_text()) if (root / DONE).is_file() else {"repo": repo_id}
    # the folder where it is now: a cache copied to another machine or path has moved
    return {**record, "commit": commit, "folder": str(root), "bytes_fetched": 0, "cached": True}


def fetch(repo_id: str, revision: str | None = None, log: Log = say) -> dict:
    """A hub id → a local vision-only checkpoint folder; → what was done (folder, commit, bytes…)."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
    import httpx2

    pinned = repo_folder(repo_id) / revision if revision and COMMIT.fullmatch(revision) else None
    if pinned and (pinned / DONE).is_file():  # a commit never changes: no need to ask the hub
        return _found(repo_id, pinned, revision)
    if offline():
        return _found(repo_id, *_local(repo_id, revision, "HF_HUB_OFFLINE is set"))
    if not _resolves():  # the cache only, at once: not ~23 s of retries
        why = f"{_host()} cannot be resolved (offline? set HF_HUB_OFFLINE=1 to skip the hub)"
        return _found(repo_id, *_local(repo_id, revision, why))
    try:
        commit, names = _resolve(repo_id, revision)
        folder = repo_folder(repo_id) / commit
        if (folder / DONE).is_file():
            record = _found(repo_id, folder, commit)
        elif snapshot := _snapshot(repo_id, commit, local_only=True):  # a full one the user already has
            record = _found(repo_id, snapshot[0], commit)
        else:
            record = {**download(repo_id, commit, names, log), "cached": False}
        if (revision or "main") != commit:  # only now: offline, the name keeps pointing at a finished folder
            _remember(repo_id, revision or "main", commit)
        return record
    except (httpx2.TransportError, OfflineModeIsEnabled):
        return _found(repo_id, *_local(repo_id, revision, "the hub could not be reached"))
    except HfHubHTTPError as e:
        raise _hub_error(repo_id, e) from None


def hub_files(repo_id: str, revision: str | None = None, log: Log = say) -> tuple[Path, str | None]:
    """What model.find_checkpoint needs: the folder and the commit it holds."""
    record = fetch(repo_id, revision, log)
    return Path(record["folder"]), record["commit"]
