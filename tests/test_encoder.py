"""The in-memory encoder (run/encoder.py), the library's core: files → (row, tokens), nothing written.

Its tokens are `gemma4enc encode`'s, bit for bit (the local engine is this encoder plus a shard
writer), and transformers' get_image_features per item; a search query OUT lacks is encoded by it
with OUT's settings, its vector the one OUT would hold, and no temp OUT is made."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
import torch

import gemma4enc
from gemma4enc.options import Options, Sampling
from gemma4enc.rows import Status
from gemma4enc.run import search as search_module

from .helpers import encode, flags, folder_with_history, photo, reference

F32 = dict(dtype="float32", out_dtype="float32", device="cpu", workers=0, sampling=Sampling(frames=3))


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    from gemma4enc.dev.demo import write_video

    root = tmp_path_factory.mktemp("encoder-media")
    photo(200, 300, seed=1).save(root / "a.png")
    photo(300, 200, seed=2).save(root / "b.jpg", quality=95)
    write_video(root / "clip.mp4", frames=12)
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not a picture")
    return root


def test_the_encoders_tokens_are_encodes_bit_for_bit(media, ckpt, tmp_path):
    with gemma4enc.Encoder(Options(model=str(ckpt), resize="exact", **F32)) as enc:
        got = {os.path.basename(row.path): (row, frames) for row, frames in enc.encode([media])}
    assert sorted(got) == ["a.png", "b.jpg", "broken.png", "clip.mp4"]
    assert got["broken.png"][0].status == Status.DECODE_ERROR and got["broken.png"][1] is None
    assert len(got["clip.mp4"][1]) == 3 and got["clip.mp4"][0].frames == 3
    out = tmp_path / "out"
    assert encode([media, "-o", out, "--model", ckpt, *flags(frames=3, json=False), "--workers", "0"]).exit_code == 1
    emb = gemma4enc.open(out)
    for name in ("a.png", "b.jpg", "clip.mp4"):
        row, frames = got[name]
        stored = emb.frames(str(media / name))
        assert row.status == Status.OK and frames[0].dtype == torch.float32
        assert len(stored) == len(frames) and all(torch.equal(s, f) for s, f in zip(stored, frames)), name


def test_an_image_is_get_image_features(media, ckpt):
    """Against transformers itself, per item (float32, 1e-4 of scale)."""
    from PIL import Image
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    ref = reference(ckpt)
    image = Image.open(media / "b.jpg").convert("RGB")
    feats = Gemma4ImageProcessorPil(max_soft_tokens=280)(images=[image], return_tensors="pt")
    with torch.no_grad():
        want = ref.model.get_image_features(feats["pixel_values"], feats["image_position_ids"]).pooler_output[0]
    with gemma4enc.Encoder(model=str(ckpt), resize="exact", image_tokens=280, **F32) as enc:
        ((row, frames),) = list(enc.encode([media / "b.jpg"]))
    assert frames[0].shape == want.shape
    assert (frames[0] - want).abs().max() <= 1e-4 * want.abs().max()


def test_the_model_is_loaded_once_for_many_calls(media, ckpt, monkeypatch):
    from gemma4enc.run import encoder as encoder_module

    opened = []
    real = encoder_module.open_towers
    monkeypatch.setattr(encoder_module, "open_towers", lambda *a, **k: opened.append(1) or real(*a, **k))
    with gemma4enc.Encoder(model=str(ckpt), **F32) as enc:
        first = list(enc.encode([media / "a.png"]))
        second = list(enc.encode([media / "a.png"]))
    assert len(opened) == 1 and torch.equal(first[0][1][0], second[0][1][0])


@pytest.fixture(scope="module")
def folder(ckpt, tmp_path_factory):
    return folder_with_history(tmp_path_factory.mktemp("encoder-search"), ckpt)


@pytest.mark.parametrize("name", ["p1.png", "clip.mp4"])
def test_a_search_query_is_encoded_in_memory_as_out_holds_it(folder, tmp_path, monkeypatch, name):
    """A copy of a file OUT holds, encoded as a query: exactly OUT's pooled vector (bfloat16 stored),
    and no folder is made for it (search made and fsynced a temp OUT before)."""
    media, out = folder
    copy = tmp_path / f"elsewhere-{name}"
    copy.write_bytes((media / name).read_bytes())
    made = []
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(a or k) or pytest.fail("a temp folder"))
    found = search_module.encode_files(gemma4enc.open(out).out, [str(copy)], "cpu")
    vector = found[str(copy)]
    assert isinstance(vector, np.ndarray) and vector.dtype == np.float32
    assert np.array_equal(vector, gemma4enc.open(out, framework="numpy").pooled(str(media / name)))
    assert not made


def test_a_query_that_fails_says_why(folder, tmp_path):
    media, out = folder
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n no")
    found = search_module.encode_files(gemma4enc.open(out).out, [str(bad)], "cpu")
    assert found[str(bad)].startswith("status decode_error: ")
