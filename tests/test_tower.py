"""Every tower path against transformers' get_image_features / get_video_features, per item.

Tolerances (max abs difference, outputs of magnitude ~4):
  float32: 1e-4 × max|reference| (measured: ~3e-6 absolute; padding in the reference's batch
           accounts for it — our calls carry no padding);
  bfloat16: 0.08 × max|reference| (measured: random bf16 weights, see docs/architecture.md).
Packing vs serial: float32 1e-5 × scale (only the pooling sum order differs).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma4.image_processing_pil_gemma4 import (
    Gemma4ImageProcessorPil,
)

from gemma4enc.media.patches import patchify
from gemma4enc.model.batching import Unit, batches
from gemma4enc.model.load import load_tower

from .helpers import close, hf_image_features, reference


@pytest.fixture(scope="module")
def tower32(ckpt_sharded):
    return load_tower(str(ckpt_sharded), "float32", "cpu")


def test_patchify_equals_the_processor(photos):
    proc = Gemma4ImageProcessorPil()
    for image in photos:
        feats = proc(images=[image], return_tensors="np")
        mine = patchify(image, 280)
        n = mine.n
        assert (feats["image_position_ids"][0, n:] == -1).all() and (feats["image_position_ids"][0, :n] >= 0).all()
        assert (feats["image_position_ids"][0, :n] == mine.positions).all()
        assert (feats["pixel_values"][0, :n] == (mine.pixels.astype("float64") * (1 / 255)).astype("float32")).all()
        assert feats["num_soft_tokens_per_image"][0] == mine.soft_tokens


@pytest.mark.parametrize("path", ["serial", "bucket", "pack"])
def test_float32_paths_match_get_image_features(tower32, ref_sharded, photos, path):
    items = [patchify(im, 280) for im in photos] + [patchify(photos[0], 280)]  # a repeat: a real bucket
    units = [Unit(i, 0, p) for i, p in enumerate(items)]
    got = {}
    for batch in batches(units, path, max_patches=8000):
        for u, t in zip(batch, tower32.encode([u.patches for u in batch], pack=path == "pack")):
            got[u.file] = t
    assert len(got) == len(items)
    for i, image in enumerate(photos):
        want = hf_image_features(ref_sharded, image)
        assert got[i].shape == want.shape
        assert close(got[i], want, 1e-4), (path, image.size, (got[i] - want).abs().max())


def test_bucket_is_bit_identical_to_serial(tower32, photos):
    same = [patchify(photos[1], 280), patchify(photos[1].rotate(180), 280)]
    stacked = tower32.encode(same)
    for item, tokens in zip(same, stacked):
        assert torch.equal(tower32.encode([item])[0], tokens)


def test_pack_equals_serial_per_item(tower32, photos):
    items = [patchify(im, budget) for im, budget in zip(photos, [70, 140, 280, 560, 70, 280, 1120, 280, 70])]
    packed = tower32.encode(items, pack=True)
    for item, tokens in zip(items, packed):
        assert close(tokens, tower32.encode([item])[0], 1e-5)


def test_bfloat16_matches_reference_in_bfloat16(ckpt_sharded, photos):
    tower = load_tower(str(ckpt_sharded), "bfloat16", "cpu")
    ref = reference(ckpt_sharded, torch.bfloat16)
    items = [patchify(im, 280) for im in photos[:4]]
    for pack in (False, True):
        outs = tower.encode(items, pack=True) if pack else [tower.encode([i])[0] for i in items]
        for image, tokens in zip(photos[:4], outs):
            assert tokens.dtype == torch.bfloat16
            assert close(tokens, hf_image_features(ref, image), 0.08)


def test_video_frames_match_get_video_features(tower32, ref_sharded):
    import numpy as np

    from gemma4enc.dev.demo import barcode_frame

    frames = [barcode_frame(i, 320, 180) for i in range(0, 40, 5)]
    proc = Gemma4ImageProcessorPil(max_soft_tokens=70)  # the video processor's per-frame budget
    feats = proc(images=[f for f in frames], return_tensors="pt")
    with torch.no_grad():
        want = ref_sharded.model.get_video_features(
            feats["pixel_values"], video_position_ids=feats["image_position_ids"],
            num_frames_per_video=torch.tensor([len(frames)])).pooler_output[0]
    items = [patchify(np.ascontiguousarray(f), 70) for f in frames]
    for pack in (False, True):
        got = torch.cat(tower32.encode(items, pack=pack))
        assert got.shape == want.shape
        assert close(got, want, 1e-4)


def test_batched_pooling_equals_transformers_pooler(tower32, photos):
    from gemma4enc.model.tower import pool_slots

    items = [patchify(im, 280) for im in photos[:5]]
    hidden = [torch.randn(p.n, tower32.hidden) for p in items]
    slots, n_slots = pool_slots(items)
    ours = tower32.pool_packed(torch.cat(hidden), slots, n_slots)
    theirs = torch.cat([tower32.pool_stack(h[None], torch.from_numpy(p.positions)[None]) for h, p in zip(hidden, items)])
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() <= 1e-6 * theirs.abs().max()


def test_out_of_memory_halves_the_batch_and_isolates_the_item():
    from gemma4enc.media.patches import Patches
    from gemma4enc.run.pipeline import Encoder

    class FakeTower:
        device = torch.device("cpu")
        calls = []

        def encode(self, items, pack=False):
            self.calls.append(len(items))
            if len(items) > 2 or any(p.n == 999 for p in items):
                raise torch.OutOfMemoryError("fake")
            return [torch.full((p.n // 9, 2), float(p.n)) for p in items]

    def item(n):
        return Patches(torch.zeros(n, 768, dtype=torch.uint8).numpy(), torch.zeros(n, 2, dtype=torch.long).numpy())

    units = [Unit(i, 0, item(n)) for i, n in enumerate([18, 27, 36, 999, 45, 54, 63, 72])]
    tower = FakeTower()
    out, failed = Encoder(tower, "pack", 10_000).run(units)
    assert failed.keys() == {3} and "out of memory" in failed[3]
    assert sorted(f for f, _ in out) == [0, 1, 2, 4, 5, 6, 7]
    for (f, _), t in out.items():
        assert t.shape[0] == units[f].patches.n // 9


def _fake_varlen(kind):
    """Stand-ins for torch's varlen_attn of three releases: (N, H, d) in and out, the kernel's
    default scale 1/sqrt(d), grouped key/value heads only where the release accepts them."""

    def attend(q, k, v, cu, max_len, scale=None, gqa=False):
        assert gqa or q.shape[1] == k.shape[1], "this release needs as many k/v heads as q heads"
        out = torch.empty_like(q)
        bounds = cu.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            piece = torch.nn.functional.scaled_dot_product_attention(
                q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), scale=scale, enable_gqa=gqa)
            out[a:b] = piece.transpose(0, 1)
        return out

    if kind == "oldest":  # no scale, no enable_gqa
        return lambda q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False: attend(q, k, v, cu_q, max_q)
    if kind == "scale":
        return lambda q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None: attend(q, k, v, cu_q, max_q, scale)
    return lambda q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, enable_gqa=False: attend(
        q, k, v, cu_q, max_q, scale, enable_gqa)


@pytest.mark.parametrize("kind", ["oldest", "scale", "scale+gqa"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_varlen_call_adapts_to_each_torch_release(kind, kv_heads):
    """The CUDA pack path calls torch's varlen_attn with Gemma 4's scale of 1.0; every release's
    signature must give block-diagonal attention equal to one SDPA call per item (float32, 1e-5)."""
    from gemma4enc.model.attention import _segment_sdpa, call_varlen

    torch.manual_seed(0)
    lengths = [7, 30, 12]
    n, heads, d = sum(lengths), 4, 16
    q, k, v = torch.randn(n, heads, d), torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
    cu = torch.tensor([0, 7, 37, 49], dtype=torch.int32)
    got = call_varlen(_fake_varlen(kind), q, k, v, cu, max(lengths), 1.0)
    want = _segment_sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), [(0, 7), (7, 37), (37, 49)],
                         1.0, kv_heads != heads)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.slow
def test_compiled_stacks_match_get_image_features(tower32, ref_sharded, photos):
    """--compile: serial and bucket calls through the torch.compile'd layers, one graph for
    every layer and patch count; float32 tolerance as for the eager paths (1e-4 × scale)."""
    import copy

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fast = copy.copy(tower32).compile()
    items = [patchify(im, 280) for im in photos] + [patchify(photos[0], 280)]
    units = [Unit(i, 0, p) for i, p in enumerate(items)]
    got = {}
    for mode in ("serial", "bucket"):
        for batch in batches(units, mode, max_patches=8000):
            for u, t in zip(batch, fast.encode([u.patches for u in batch])):
                got[mode, u.file] = t
    assert fast._compiled is not None  # it ran compiled, not the fallback
    # one graph for calls of one item, one for stacks (dynamo specialises a size of 1), shared by
    # both layers: their clip bounds are graph inputs, not constants (else 4 graphs)
    assert counters["stats"]["unique_graphs"] == 2
    assert tower32._compiled is None  # the copy was compiled, not the shared tower
    for i, image in enumerate(photos):
        want = hf_image_features(ref_sharded, image)
        for mode in ("serial", "bucket"):
            assert close(got[mode, i], want, 1e-4), (mode, image.size)


def test_a_failing_compile_falls_back_to_eager(tower32, photos, monkeypatch):
    import copy

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler\nlong log")

    monkeypatch.setattr(torch, "compile", lambda module, **kw: broken)
    fast = copy.copy(tower32).compile()
    item = patchify(photos[2], 280)
    with pytest.warns(UserWarning, match="--compile failed .RuntimeError: no C.. compiler.; going on without it"):
        tokens = fast.encode([item])[0]
    assert fast._compiled is None and torch.equal(tokens, tower32.encode([item])[0])
