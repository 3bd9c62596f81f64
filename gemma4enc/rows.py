"""The manifest row, typed: its status list and its fields, in the order manifest.jsonl writes them.

A row is a `Row` from the pipeline that makes it, through the shard writer, `mark_lost` and
adoption, to the manifest, and back out of the readers (`emb.row(path)`); it is a JSON dict only
on disk and between Ray actors and the driver. `Row` is the one place that names its fields,
builds it and reads it back; `row["key"]` and `row.get(key)` read it as the manifest's dict. `to_json` writes the keys in format_version 1's order, so rows are byte for
byte what earlier versions wrote; keys a later version adds survive a read and write in `extra`.
No torch here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields, replace
from typing import Any


class Status(enum.StrEnum):
    """A row's `status`: ok, or the class of error (docs/format.md lists them; a test checks that)."""

    OK = "ok"
    DECODE_ERROR = "decode_error"  # also a decoder that crashed its worker
    UNSUPPORTED = "unsupported"
    EMPTY = "empty"
    TOO_LARGE = "too_large"
    NO_VIDEO_STREAM = "no_video_stream"
    NOT_FOUND = "not_found"
    UNREADABLE = "unreadable"
    TIMEOUT = "timeout"
    OOM = "oom"
    SHARD_LOST = "shard_lost"  # its shard went missing or unreadable: the next run encodes it again
    WORKER_DIED = "worker_died"  # --engine ray: the file killed its actor every time
    ERROR = "error"  # --engine ray: an unexpected exception, its text in `error`
    # not a failure: the file was found under another path (`moved_to`) and that row took its
    # tokens (a moved or remounted root, adopted): this path describes no file any more
    MOVED = "moved"


# written only when set, in this order after `height` (video facts) and at the end (sha256)
VIDEO_KEYS = (
    "frame_indices",
    "timestamps",
    "fps",
    "duration",
    "total_frames",
    "backend",
    "truncated",
    "missing_frames",
    "frames_asked",
    "undecodable_packets",
)


@dataclass(frozen=True)
class Row:
    path: str
    kind: str  # "image" | "video" | "unknown"
    size: int
    mtime_ns: int
    status: str  # a Status (a plain str when read back: Status members compare equal to it)
    error: str | None = None
    shard: str | None = None  # set once the shard holding its tokens is written
    index: int | None = None  # its item in that shard
    tokens: int = 0
    frames: int = 0
    root: str | None = None  # where a walk found it, and the path below: how a moved root is recognised
    rel: str | None = None
    frame_tokens: list[int] | None = None  # ok rows: tokens per frame
    width: int | None = None  # ok rows: decoded size, after orientation
    height: int | None = None
    video: dict[str, Any] = field(default_factory=dict)  # ok video rows: VIDEO_KEYS that were known
    sha256: str | None = None  # --hash
    extra: dict[str, Any] = field(default_factory=dict)  # keys this version does not know, kept as read

    @classmethod
    def failed(cls, item, status: str, message: str) -> Row:
        """A file without tokens: `item` is a discover.Item."""
        return cls(
            item.path,
            item.kind,
            item.size,
            item.mtime_ns,
            Status(status),
            message,
            root=item.root if item.rel else None,
            rel=item.rel,
        )

    def to_json(self) -> dict:
        """The dict manifest.jsonl holds, keys in format_version 1's order."""
        row: dict[str, Any] = {"path": self.path}
        if self.rel:
            row |= {"root": self.root, "rel": self.rel}
        row |= {
            "kind": self.kind,
            "size": self.size,
            "mtime_ns": self.mtime_ns,
            "status": str(self.status),
            "error": self.error,
            "shard": self.shard,
            "index": self.index,
            "tokens": self.tokens,
            "frames": self.frames,
        }
        if self.frame_tokens is not None:
            row |= {"frame_tokens": self.frame_tokens, "width": self.width, "height": self.height}
        row |= self.video
        if self.sha256:
            row["sha256"] = self.sha256
        return row | self.extra

    def __getitem__(self, key: str):
        """The manifest's key, as its dict holds it: a field, a video key, or one kept in `extra`."""
        if key in _FIELDS:
            return str(self.status) if key == "status" else getattr(self, key)
        if key in self.video:
            return self.video[key]
        return self.extra[key]

    def get(self, key: str, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: str) -> bool:
        return key in self.to_json()

    def replace(self, **changes) -> Row:
        """This row with some keys changed; keys Row does not name go to `extra`."""
        known = {k: v for k, v in changes.items() if k in _FIELDS}
        video = {**self.video, **{k: v for k, v in changes.items() if k in VIDEO_KEYS}}
        extra = {
            **self.extra,
            **{k: v for k, v in changes.items() if k not in _FIELDS and k not in VIDEO_KEYS},
        }
        return replace(self, **known, video=video, extra=extra)

    @classmethod
    def from_json(cls, row: dict) -> Row:
        if isinstance(row, Row):
            return row
        kw = {k: v for k, v in row.items() if k in _FIELDS}
        return cls(
            **kw,
            video={k: row[k] for k in VIDEO_KEYS if k in row},
            extra={k: v for k, v in row.items() if k not in _FIELDS and k not in VIDEO_KEYS},
        )


_FIELDS = frozenset(f.name for f in fields(Row)) - {"video", "extra"}
