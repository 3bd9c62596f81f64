"""Our pixels against transformers' default (torchvision) processors, `Gemma4ImageProcessor` and
`Gemma4VideoProcessor`, where torchvision imports. gemma4enc reproduces the PIL processor bit
for bit (test_tower.py, test_resize.py); the torchvision resize (antialiased bicubic on
tensors) rounds differently, so this measures and prints how far apart they are: the same
patch grid and token counts, pixel values within a few levels, and the tokens they give.

The torchvision wheels served here are CUDA builds that do not load beside the CPU torch
(`operator torchvision::nms does not exist`), so on those machines this module is skipped;
scripts/gpu_check.sh runs it on a CUDA machine and keeps the printed figures in its log.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gemma4enc.dev.demo import barcode_frame
from gemma4enc.media.patches import patchify

from .helpers import close, hf_image_features

try:
    import torchvision  # noqa: F401
    from transformers.models.gemma4.image_processing_gemma4 import Gemma4ImageProcessor
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor
except Exception as e:  # a broken torchvision raises RuntimeError, not ImportError
    pytestmark = pytest.mark.skip(reason=f"torchvision does not import here ({type(e).__name__}: "
                                         f"{str(e).splitlines()[0][:80]}); scripts/gpu_check.sh runs this")


def levels(theirs: torch.Tensor, n: int, ours) -> np.ndarray:
    """|their pixel − ours| in 8-bit levels over the n real patches (theirs: a float tensor in [0, 1])."""
    return np.abs(theirs[:n].double().numpy() * 255 - ours.pixels.astype(np.float64))


def test_image_processor_difference(photos):
    proc = Gemma4ImageProcessor(max_soft_tokens=280)
    worst = []
    for image in photos:
        feats = proc(images=[image], return_tensors="pt")
        ours = patchify(image, 280)
        assert int(feats["num_soft_tokens_per_image"][0]) == ours.soft_tokens
        assert (feats["image_position_ids"][0, : ours.n].numpy() == ours.positions).all()  # the same grid
        diff = levels(feats["pixel_values"][0], ours.n, ours)
        worst.append(diff.max())
        print(f"Gemma4ImageProcessor vs ours {image.size}: max {diff.max():.0f} levels, mean {diff.mean():.3f}, "
              f"{(diff > 0.5).mean():.2%} of values differ")
        assert diff.mean() < 1.0
    print(f"Gemma4ImageProcessor vs ours: worst {max(worst):.0f} levels over {len(photos)} images")


def test_video_processor_difference():
    frames = np.stack([barcode_frame(i, 640, 360) for i in range(8)])
    proc = Gemma4VideoProcessor(max_soft_tokens=70)
    feats = proc(videos=[frames], do_sample_frames=False, return_tensors="pt")
    assert int(feats["num_frames_per_video"][0]) == len(frames)
    for i, frame in enumerate(frames):
        ours = patchify(frame, 70)
        assert (feats["video_position_ids"][i, : ours.n].numpy() == ours.positions).all()
        diff = levels(feats["pixel_values_videos"][i], ours.n, ours)
        print(f"Gemma4VideoProcessor vs ours, frame {i}: max {diff.max():.0f} levels, mean {diff.mean():.3f}")
        assert diff.mean() < 1.0


def test_tokens_from_either_processor(ckpt_sharded, ref_sharded, photos):
    """What the resize difference does to the soft tokens (float32, same tower)."""
    from gemma4enc.model.load import load_tower

    tower = load_tower(str(ckpt_sharded), "float32", "cpu")
    proc = Gemma4ImageProcessor(max_soft_tokens=280)
    for image in photos[:4]:
        feats = proc(images=[image], return_tensors="pt")
        with torch.no_grad():
            theirs = ref_sharded.model.get_image_features(feats["pixel_values"], image_position_ids=feats[
                "image_position_ids"]).pooler_output[0]
        (ours,) = tower.encode([patchify(image, 280)])
        rel = (ours - theirs).abs().max().item() / theirs.abs().max().item()
        print(f"tokens, torchvision processor vs ours {image.size}: max diff {rel:.2e} × scale")
        assert close(ours, hf_image_features(ref_sharded, image), 1e-4)  # the PIL reference still holds
        assert rel < 0.05
