"""The shard writer works beside the encoder: add() does not wait for the disk, flush() does."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

import gemma4enc.output.shards as shards
from gemma4enc.errors import OutputError
from gemma4enc.output.reader import Embeddings
from gemma4enc.output.shards import ShardWriter
from gemma4enc.rows import Row, Status
from gemma4enc.output.opening import open_out


def row(i: int) -> Row:
    return Row(f"/media/{i}.jpg", "image", 100, 1, Status.OK, tokens=3, frames=1)


def test_writing_runs_beside_the_caller(tmp_path, monkeypatch):
    """No clock: the first write is held until the test lets it go, and add() must return meanwhile."""
    real = shards.save_file
    writing, release, threads = threading.Event(), threading.Event(), []

    def held(tensors, path, metadata=None):
        threads.append(threading.current_thread())
        writing.set()
        assert release.wait(120), "add() waited for the disk: the write was never let go"
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(shards, "save_file", held)
    writer = ShardWriter(open_out(tmp_path), "float32", {}, shard_bytes=1)
    writer.add(row(0), [torch.ones(3, 4)])  # a full shard: handed to the writing thread
    assert writing.wait(120) and not (tmp_path / "manifest.jsonl").exists()  # returned while the write is held
    release.set()
    writer.add(row(1), [torch.full((3, 4), 2.0)])  # waits for the first, hands over the second
    writer.flush()
    emb = Embeddings(open_out(tmp_path))
    assert torch.equal(emb["/media/1.jpg"], torch.full((3, 4), 2.0))
    assert [emb.row(f"/media/{i}.jpg")["shard"] for i in (0, 1)] == ["shard-000000.safetensors",
                                                                   "shard-000001.safetensors"]
    assert all(t is not threading.main_thread() for t in threads) and len(threads) == 2


def test_a_failed_write_surfaces_at_the_next_call(tmp_path, monkeypatch):
    def full(tensors, path, metadata=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shards, "save_file", full)
    writer = ShardWriter(open_out(tmp_path), "float32", {}, shard_bytes=1)
    writer.add(row(0), [torch.ones(3, 4)])
    with pytest.raises(OutputError, match="No space left"):
        writer.flush()
    assert not list(tmp_path.iterdir())  # nothing half-written, no rows
