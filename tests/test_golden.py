"""The shard header of format_version 1, byte for byte where it is deterministic.

A shard is written by the real ShardWriter from fixed tokens and the real shard_metadata of
default Options; its safetensors JSON header (tensor names, dtypes, shapes, offsets and the
metadata) must equal tests/golden/shard-header-v1.json. A difference is a format change:
bump shards.FORMAT_VERSION, update docs/format.md and write a new golden file (tests/golden/README.md).
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open

from gemma4enc.options import Options
from gemma4enc.output.shards import FORMAT_VERSION, ShardWriter, shard_metadata
from gemma4enc.rows import Row, Status
from gemma4enc.output.opening import open_out

GOLDEN = Path(__file__).parent / "golden" / "shard-header-v1.json"
ROOT = Path(__file__).parents[1]


def header(path: Path) -> dict:
    """A safetensors file starts with a little-endian u64 n, then n bytes of JSON."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8: 8 + n])


def write_fixed_shard(out: Path, pooled: bool = True) -> Path:
    """Two files in one shard: an image of 3 tokens, a video of 2 frames (2 + 1 tokens); width 4."""
    tower = SimpleNamespace(checkpoint=None, dtype=torch.float32, out_dim=4)  # what shard_metadata reads
    writer = ShardWriter(open_out(out), "bfloat16", shard_metadata(Options(), tower), pooled=pooled)
    image = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    video = [torch.full((2, 4), 0.5), torch.full((1, 4), -2.0)]
    writer.add(Row("/m/a.jpg", "image", 10, 1, Status.OK, tokens=3, frames=1), [image])
    writer.add(Row("/m/b.mp4", "video", 10, 1, Status.OK, tokens=3, frames=2), video)
    writer.close()
    return out / "shard-000000.safetensors"


def test_the_shard_header_is_format_version_1(tmp_path):
    got = header(write_fixed_shard(tmp_path))
    meta = got.pop("__metadata__")
    producer = meta.pop("producer")
    assert re.fullmatch(r"gemma4enc \S+", producer), producer  # the version changes, the key does not
    want = json.loads(GOLDEN.read_text())
    assert meta == want["metadata"] and meta["format_version"] == FORMAT_VERSION == "1"
    assert got == want["tensors"]


def test_the_offsets_say_which_tokens_are_whose(tmp_path):
    with safe_open(str(write_fixed_shard(tmp_path)), framework="pt") as f:
        assert f.get_tensor("item_offsets").tolist() == [0, 3, 6]  # a: tokens 0–2, b: 3–5
        assert f.get_tensor("frame_offsets").tolist() == [0, 3, 5, 6]  # a's one frame, b's two
        assert f.get_tensor("item_frames").tolist() == [0, 1, 3]
        mean_b = torch.tensor((0.5 * 2 - 2.0) / 3).to(torch.bfloat16).item()  # float32 mean, then the out dtype
        assert f.get_tensor("pooled")[1].float().tolist() == [mean_b] * 4


def test_without_pooled_the_header_lacks_only_pooled(tmp_path):
    got = header(write_fixed_shard(tmp_path, pooled=False))
    assert set(got) == set(json.loads(GOLDEN.read_text())["tensors"]) - {"pooled"} | {"__metadata__"}


def test_docs_name_every_header_key():
    """docs/format.md is the format's contract: each metadata key of the golden header is named there."""
    text = (ROOT / "docs" / "format.md").read_text()
    section = text[text.index("## Output format (format_version 1)"):text.index("`OUT/manifest.jsonl`")]
    keys = ["producer", *json.loads(GOLDEN.read_text())["metadata"]]
    assert [k for k in keys if f"`{k}`" not in section] == []
    assert [t for t in json.loads(GOLDEN.read_text())["tensors"] if f"`{t}`" not in section] == []
