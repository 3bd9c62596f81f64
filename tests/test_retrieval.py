"""pooled_matrix: every file's latest pooled vector from a folder of several shards, tokens unread."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import gemma4enc
import gemma4enc.output.retrieval as retrieval
from gemma4enc.commands.cli import app
from gemma4enc.dev.demo import write_video

from .helpers import photo


def encode(media, out, ckpt, *extra):
    args = ["encode", str(media), "-o", str(out), "--model", str(ckpt), "--device", "cpu", "--dtype", "float32",
            "--workers", "0", "--max-soft-tokens", "70", "--frames", "3", "--out-dtype", "float32",
            "--shard-size", "1KB", "-q", *extra]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def folder(ckpt, tmp_path_factory):
    """Five files, one shard each (--shard-size 1KB), then one of them changed and encoded again."""
    root = tmp_path_factory.mktemp("retrieval")
    media = root / "media"
    media.mkdir()
    for i, (h, w) in enumerate([(200, 300), (300, 200), (120, 480), (256, 256)]):
        photo(h, w, seed=i).save(media / f"p{i}.png")
    write_video(media / "clip.mp4", frames=12)
    encode(media, root / "out", ckpt)
    old = gemma4enc.open(root / "out")
    before = {p: old.pooled(p).clone() for p in old}
    photo(210, 330, seed=9).save(media / "p1.png")  # changed: its old row stays in the shards
    encode(media, root / "out", ckpt)
    return root, media, before


class Rows:
    """A tensor slice that records how many rows each read spans."""

    def __init__(self, inner, name, reads):
        self.inner, self.name, self.reads = inner, name, reads

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, index):
        out = self.inner[index]
        self.reads.append((self.name, out.shape[0]))
        return out


def spy(reads):
    """safe_open whose handles only slice (a whole-tensor read fails) and record each slice."""
    real = retrieval.safe_open

    @contextlib.contextmanager
    def opened(path, **kw):
        with real(path, **kw) as f:
            yield SimpleNamespace(keys=f.keys, get_slice=lambda name: Rows(f.get_slice(name), name, reads))

    return opened


def test_latest_rows_of_several_shards_without_the_tokens(folder, monkeypatch):
    root, media, before = folder
    emb = gemma4enc.open(root / "out")
    shards = {emb.row(p)["shard"] for p in emb}
    assert len(shards) == 5 and len(list((root / "out").glob("shard-*.safetensors"))) == 6  # one superseded
    reads = []
    monkeypatch.setattr(retrieval, "safe_open", spy(reads))
    paths, matrix = emb.pooled_matrix()
    assert paths == list(emb) and matrix.shape == (5, 48) and matrix.dtype == np.float32
    assert reads == [("pooled", 1)] * 5  # one row per shard (the one still in use), and no tokens
    for i, path in enumerate(paths):
        assert np.array_equal(matrix[i], emb.pooled(path).float().numpy()), path
    changed = paths.index(str(media / "p1.png"))
    assert not np.allclose(matrix[changed], before[str(media / "p1.png")].numpy())  # the new row, not the old


def test_reads_in_windows_and_per_frame(folder, monkeypatch):
    root, media, _ = folder
    emb = gemma4enc.open(root / "out")
    paths, matrix = emb.pooled_matrix()
    assert np.array_equal(retrieval.pooled_matrix(emb, window=1)[1], matrix)
    reads = []
    monkeypatch.setattr(retrieval, "safe_open", spy(reads))
    keys, frames = emb.pooled_matrix(per_frame=True)
    clip = str(media / "clip.mp4")
    assert keys == [k for p in paths for k in ([(p, 0), (p, 1), (p, 2)] if p == clip else [(p, 0)])]
    want = torch.stack([f.float().mean(0) for f in emb.frames(clip)]).numpy()
    assert np.allclose(frames[[keys.index((clip, k)) for k in range(3)]], want, atol=1e-6)
    image = str(media / "p0.png")
    assert np.array_equal(frames[keys.index((image, 0))], matrix[paths.index(image)])  # images keep their vector
    assert [rows for name, rows in reads if name == "tokens" and rows] == [emb.row(clip)["tokens"]]  # its slice only


def test_without_stored_pooled_vectors_the_means_are_computed(folder, ckpt):
    root, media, _ = folder
    encode(media, root / "bare", ckpt, "--no-pooled")
    paths, matrix = gemma4enc.open(root / "bare").pooled_matrix()
    _, stored = gemma4enc.open(root / "out").pooled_matrix()
    assert np.allclose(matrix, stored, atol=1e-6)


def test_the_numpy_reader_gives_the_same_matrix_and_model_inputs(folder, ckpt, monkeypatch):
    """framework="numpy": pooled_matrix without torch's reader (stored vectors, computed means,
    per frame), and mm_encoder_outputs as the torch reader's, value for value."""
    root, media, _ = folder
    encode(media, root / "bare-np", ckpt, "--no-pooled")
    for out in (root / "out", root / "bare-np"):
        torch_reader, numpy_reader = gemma4enc.open(out), gemma4enc.open(out, framework="numpy")
        for per_frame in (False, True):
            keys, matrix = torch_reader.pooled_matrix(per_frame=per_frame)
            np_keys, np_matrix = numpy_reader.pooled_matrix(per_frame=per_frame)
            assert np_keys == keys and np_matrix.dtype == np.float32 and np.allclose(np_matrix, matrix, atol=1e-6)
        assert numpy_reader.pooled_matrix(window=2)[0] == torch_reader.pooled_matrix()[0]  # rows read two at a time
        assert np.array_equal(numpy_reader.pooled_matrix(window=2)[1], numpy_reader.pooled_matrix()[1])
    paths = [media / "p0.png", media / "clip.mp4"]
    want = gemma4enc.open(root / "out").mm_encoder_outputs(paths)
    got = gemma4enc.open(root / "out", framework="numpy").mm_encoder_outputs(paths)
    assert [(m.path, m.kind, m.frame_tokens, m.timestamps) for m in got.media] == [
        (m.path, m.kind, m.frame_tokens, m.timestamps) for m in want.media]
    for kind in ("image", "video"):
        pairs = zip(got.mm_encoder_outputs[kind].pooler_output, want.mm_encoder_outputs[kind].pooler_output)
        assert all(torch.equal(a, b) for a, b in pairs)
