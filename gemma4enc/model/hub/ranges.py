"""Byte ranges: each safetensors header read by a Range request, the vision tensors' ranges planned
(neighbours coalesced) and pulled into `model.safetensors.part`, whose `.part.json` records how far
each range got, so a cut connection or a killed run resumes with only the missing bytes."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import UsageError
from ..layouts import SINGLE, is_vision
from .cache import temp_beside
from .client import Hub, Log, header_length

GAP = 64 << 10  # bytes: ranges this close are one request (the gap is read and dropped)


SAVE_EVERY = 16 << 20  # bytes: progress is recorded this often, so a killed run loses at most this much


PROGRESS_SECONDS = 10  # a progress line at most this often while a large fetch runs


RETRIES = 3  # a cut range is asked again for its rest this many times before the run gives up


ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "F4": 0.5,
    "F6_E2M3": 0.75,
    "F6_E3M2": 0.75,
}


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
class RangePlan:
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


def _header(hub: Hub, filename: str) -> tuple[dict, int, int | None, bool]:
    """A safetensors file's header → (entries, where its data starts, file size, Range honoured)."""
    raw, size, ranged = hub.header(filename)
    n = header_length(hub.repo_id, filename, raw)
    try:
        entries = json.loads(raw[8 : 8 + n])
    except ValueError as e:
        raise UsageError(f"{hub.repo_id}: {filename}: unreadable safetensors header ({e})") from None
    return entries, 8 + n, size, ranged


def _check(filename: str, key: str, entry: dict, data_start: int, size: int | None) -> tuple[int, int]:
    """One header entry's sanity → its absolute byte range."""
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    ok = (
        dtype in ITEMSIZE
        and isinstance(shape, list)
        and all(isinstance(d, int) and d >= 0 for d in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    )
    if not ok:
        raise UsageError(f"{filename}: {key}: malformed safetensors entry {entry}")
    if offsets[1] - offsets[0] != math.ceil(math.prod(shape) * ITEMSIZE[dtype]):
        raise UsageError(f"{filename}: {key}: {offsets[1] - offsets[0]} bytes for {dtype} {shape}")
    start, end = data_start + offsets[0], data_start + offsets[1]
    if size is not None and end > size:
        raise UsageError(f"{filename}: {key} ends at byte {end:,}, past the file's {size:,}")
    return start, end


def plan_ranges(hub: Hub, files: list[str], skipped: list[str], metadata: dict) -> RangePlan:
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
        raise UsageError(
            f"{hub.repo_id}: the checkpoint holds no vision_tower.* or embed_vision.* tensors"
        )
    chosen.sort(key=lambda c: (files.index(c[0]), c[3]))  # source order: sequential reads
    layout, offset = {"__metadata__": metadata}, 0
    for filename, key, entry, start, end in chosen:
        layout[key] = {
            "dtype": entry["dtype"],
            "shape": entry["shape"],
            "data_offsets": [offset, offset + end - start],
        }
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
    return RangePlan(header, requests, len(chosen), offset, source_bytes, skipped, unranged)


class RangeProgress:
    """How many bytes of each request are in the .part file, saved beside it as JSON."""

    def __init__(self, part: Path, plan: RangePlan, log: Log):
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
            log(
                f"resuming an earlier fetch: {plan.vision_bytes - self.missing:,} of {plan.vision_bytes:,} bytes "
                "already here"
            )

    def add(self, i: int, n: int) -> None:
        self.done[i] += n
        self.unsaved += n
        if self.unsaved >= SAVE_EVERY:
            self.save()

    def save(self) -> None:
        tmp = temp_beside(self.path)
        try:
            tmp.write_text(json.dumps({"plan": self.plan.key, "done": self.done}))
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
        self.unsaved = 0
        if time.monotonic() - self.said >= PROGRESS_SECONDS and self.missing:
            self.said = time.monotonic()
            self.log(
                f"fetched {self.plan.vision_bytes - self.missing:,} of {self.plan.vision_bytes:,} vision bytes"
            )

    @property
    def missing(self) -> int:
        return sum(r.end - r.start - d for r, d in zip(self.plan.requests, self.done))


def _write(out, request: Request, i: int, pos: int, chunk: bytes, progress: RangeProgress) -> None:
    """Write the part of `chunk` (source bytes from `pos`) that extends request i's done bytes."""
    begin = request.start + progress.done[i]
    lo, hi = max(pos, begin), min(pos + len(chunk), request.end)
    if hi <= lo:
        return
    for piece in request.pieces:
        a, b = max(lo, piece.src), min(hi, piece.src + piece.size)
        if a < b:
            out.seek(piece.dst + a - piece.src)
            out.write(chunk[a - pos : b - pos])
    out.flush()  # the data is in the file before the progress that says so
    progress.add(i, hi - lo)


def _pull(hub: Hub, out, plan: RangePlan, progress: RangeProgress, filename: str) -> None:
    """Fetch one file's missing ranges: a Range request each, or one stream where Range is ignored."""
    from huggingface_hub.utils import hf_raise_for_status

    todo = [
        (i, r)
        for i, r in enumerate(plan.requests)
        if r.file == filename and progress.done[i] < r.end - r.start
    ]
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
            if response.status_code != 206 or (
                said is not None and not said.startswith(f"bytes {pos}-")
            ):
                raise UsageError(
                    f"{hub.repo_id}: {filename}: the server answered a Range request for byte {pos:,} "
                    f"with {response.status_code} {response.headers.get('Content-Range', '')}".rstrip()
                )
            for chunk in response.iter_bytes():
                hub.served += len(chunk)
                _write(out, r, i, pos, chunk, progress)
                pos += len(chunk)


def pull_weights(hub: Hub, folder: Path, plan: RangePlan) -> None:
    """Fill model.safetensors.part, resuming what an earlier try left, then rename it."""
    import httpx2

    part = folder / (SINGLE + ".part")
    progress = RangeProgress(part, plan, hub.log)
    if plan.unranged:
        hub.log(
            f"the hub server ignores Range requests: streaming {', '.join(sorted(plan.unranged))} from the start "
            "and keeping only the vision bytes"
        )
    with open(part, "r+b" if part.is_file() else "w+b") as out:
        out.write(plan.header)
        out.truncate(len(plan.header) + plan.vision_bytes)
        for attempt in range(RETRIES + 1):
            try:
                for filename in dict.fromkeys(r.file for r in plan.requests):
                    _pull(hub, out, plan, progress, filename)
            except (
                httpx2.TransportError,
                httpx2.StreamError,
            ) as e:  # a cut: keep what came, ask for the rest
                progress.save()
                hub.log(
                    f"connection cut ({type(e).__name__}) with {progress.missing:,} vision bytes to go"
                )
            if not progress.missing:
                break
            if attempt < RETRIES:
                hub.log(f"resuming: asking only for the {progress.missing:,} missing bytes")
        progress.save()
        if progress.missing:
            raise UsageError(
                f"{hub.repo_id}: {progress.missing:,} vision bytes did not arrive (the connection broke); "
                "run again to resume"
            )
        out.flush()
        os.fsync(out.fileno())
    _verify(part, plan)
    os.replace(part, folder / SINGLE)
    progress.path.unlink(missing_ok=True)


def _verify(part: Path, plan: RangePlan) -> None:
    """The file we wrote reads back as safetensors holding the planned tensors, at their sizes."""
    from safetensors import safe_open

    with safe_open(str(part), framework="numpy") as f:
        keys = list(f.keys())
    if len(keys) != plan.tensors or part.stat().st_size != len(plan.header) + plan.vision_bytes:
        raise UsageError(f"{part}: the written file does not match its plan; remove it and run again")
