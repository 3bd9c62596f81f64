"""A Row from the pipeline through a real shard and the manifest, and back out of both readers."""

from __future__ import annotations

import torch

import gemma4enc
from gemma4enc.media.kinds import Item
from gemma4enc.output.ledger import Ledger
from gemma4enc.output.repair import mark_lost
from gemma4enc.output.shards import ShardWriter
from gemma4enc.rows import Row, Status
from gemma4enc.output.opening import open_out


def test_a_row_goes_through_a_real_shard_and_back(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    item = Item(str(tmp_path / "a.jpg"), "image", 123, 456, root=str(tmp_path), rel="a.jpg")
    row = Row(item.path, item.kind, item.size, item.mtime_ns, Status.OK, tokens=6, frames=2, root=item.root,
              rel=item.rel, frame_tokens=[4, 2], width=64, height=48, video={"fps": 25.0}, sha256="ab" * 32,
              extra={"note": "kept"})
    failed = Row.failed(Item(str(tmp_path / "b.mp4"), "video", 9, 9), Status.DECODE_ERROR, "cut short")
    frames = [torch.randn(4, 8), torch.randn(2, 8)]
    writer = ShardWriter(open_out(out), "float32", {})
    writer.add(row, frames)
    writer.add(failed)
    writer.close()

    emb, arrays = gemma4enc.open(out), gemma4enc.open(out, framework="numpy")
    back = emb.row(item.path)
    assert isinstance(back, Row) and isinstance(arrays.row(item.path), Row)
    assert back == row.replace(shard=back.shard, index=0) and back.shard.startswith("shard-")
    assert back["status"] == "ok" and back["fps"] == 25.0 and back.get("note") == "kept" and "sha256" in back
    assert emb.row(failed.path) == failed and emb.row(failed.path)["error"] == "cut short"
    assert torch.equal(emb[item.path], torch.cat(frames))

    ledger = Ledger.load(out)
    mark_lost(open_out(out), {back.shard}, ledger)
    lost = gemma4enc.open(out).row(item.path)
    assert isinstance(lost, Row) and lost.status == Status.SHARD_LOST and lost.shard is None and lost.tokens == 0
    assert (lost.frame_tokens, lost.sha256, lost.extra) == (row.frame_tokens, row.sha256, row.extra)
