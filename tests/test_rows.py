"""The typed manifest row: one status list, rows written byte for byte as format_version 1 wrote them."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from gemma4enc.media.discover import look
from gemma4enc.media.kinds import Item
from gemma4enc.media.prepare import prepare
from gemma4enc.options import Options
from gemma4enc.output.files import line_of
from gemma4enc.rows import Row, Status

ROOT = Path(__file__).resolve().parent.parent

# rows as format_version 1 writes them (key order included): an ok photo found by walking, an ok
# video with --hash, a failed file named on the command line
OK_PHOTO = ('{"path": "/m/a.jpg", "root": "/m", "rel": "a.jpg", "kind": "image", "size": 10, "mtime_ns": 5, '
            '"status": "ok", "error": null, "shard": "shard-000000.safetensors", "index": 0, "tokens": 280, '
            '"frames": 1, "frame_tokens": [280], "width": 640, "height": 480}\n')
OK_VIDEO = ('{"path": "/v.mp4", "kind": "video", "size": 9, "mtime_ns": 7, "status": "ok", "error": null, '
            '"shard": "shard-000001.safetensors", "index": 3, "tokens": 140, "frames": 2, "frame_tokens": [70, 70], '
            '"width": 64, "height": 48, "frame_indices": [0, 5], "timestamps": [0.0, 0.2], "fps": 25.0, '
            '"duration": 0.4, "total_frames": 10, "backend": "pyav", "sha256": "ab"}\n')
FAILED = ('{"path": "/x.bin", "kind": "unknown", "size": 3, "mtime_ns": 1, "status": "unsupported", '
          '"error": "not an image or video format we know", "shard": null, "index": null, "tokens": 0, "frames": 0}\n')


def test_the_documented_status_list_is_the_enum():
    line = next(l for l in (ROOT / "docs" / "format.md").read_text().splitlines() if l.startswith("| `status` |"))
    documented = set(re.findall(r"`(\w+)`", line.split("|")[2]))
    assert documented == {s.value for s in Status}


def test_rows_read_and_write_back_byte_for_byte():
    for line in (OK_PHOTO, OK_VIDEO, FAILED, FAILED.replace('"frames": 0}', '"frames": 0, "later": [1]}')):
        row = Row.from_json(json.loads(line))
        assert line_of(row.to_json()) == line.encode()
    assert Row.from_json(json.loads(OK_VIDEO)).video["backend"] == "pyav"


def test_a_failed_row_is_built_as_format_version_1_wrote_it():
    item = Item("/x.bin", "unknown", 3, 1)
    assert line_of(Row.failed(item, Status.UNSUPPORTED, "not an image or video format we know").to_json()) == FAILED.encode()


def test_discovery_says_why_it_could_not_look(tmp_path):
    (tmp_path / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    os.mkfifo(tmp_path / "pipe.jpg")
    broken, fifo = look(str(tmp_path / "gone.jpg")), look(str(tmp_path / "pipe.jpg"))
    assert (broken.status, fifo.status) == (Status.NOT_FOUND, Status.UNSUPPORTED)
    # the worker takes discovery's status as it is, whatever the message says
    odd = Item("/a.jpg", "image", 0, 0, error="file not found, they say", status=Status.UNREADABLE)
    assert [prepare(i, Options()).status for i in (broken, fifo, odd)] == ["not_found", "unsupported", "unreadable"]
