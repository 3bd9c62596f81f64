"""--resize torchvision against the processors it reproduces, `Gemma4ImageProcessor` and
`Gemma4VideoProcessor` (transformers' torchvision backend, the one vLLM uses): the float32 pixel
values the tower sees equal theirs bit for bit, the positions too, and through the decode
workers from files as well.

Runs where torchvision imports: `make test-torchvision` builds such a venv (PyPI's torchvision
does not load beside the CPU torch of the main one); skipped elsewhere, with the reason.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gemma4enc.media.patches import DIVIDE, MULTIPLY, patchify
from gemma4enc.model.tower import _UNIT

from .helpers import SHAPES, photo

try:
    import torchvision  # noqa: F401
    from transformers.models.gemma4.image_processing_gemma4 import Gemma4ImageProcessor
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor
except Exception as e:  # a broken torchvision raises RuntimeError, not ImportError
    pytestmark = pytest.mark.skip(reason=f"torchvision does not import here ({type(e).__name__}: "
                                         f"{str(e).splitlines()[0][:80]}); `make test-torchvision` runs this")


def values(p) -> torch.Tensor:
    return _UNIT[torch.from_numpy(p.pixels).long() + 256 * p.unit]


def same_as(pixel_values: torch.Tensor, positions: torch.Tensor, p) -> None:
    assert torch.equal(pixel_values[: p.n], values(p))  # bit for bit, float32
    assert (pixel_values[p.n:] == 0).all()  # their padding
    assert (positions[: p.n].numpy() == p.positions).all() and (positions[p.n:] == -1).all()


@pytest.mark.parametrize("budget", [70, 280, 1120])
def test_image_pixels_equal_gemma4imageprocessor(budget):
    proc = Gemma4ImageProcessor(max_soft_tokens=budget)
    for i, (h, w) in enumerate(SHAPES):
        image = photo(h, w, seed=i)
        feats = proc(images=[image], return_tensors="pt")
        p = patchify(image, budget, "torchvision", MULTIPLY)
        assert int(feats["num_soft_tokens_per_image"][0]) == p.soft_tokens
        same_as(feats["pixel_values"][0], feats["image_position_ids"][0], p)


def test_video_pixels_equal_gemma4videoprocessor():
    for h, w in [(360, 640), (1080, 1920), (240, 180)]:
        frames = np.stack([np.asarray(photo(h, w, seed=s)) for s in range(4)])
        feats = Gemma4VideoProcessor(max_soft_tokens=70)(videos=[frames], do_sample_frames=False,
                                                         return_tensors="pt")
        for i, frame in enumerate(frames):
            same_as(feats["pixel_values_videos"][i], feats["video_position_ids"][i],
                    patchify(frame, 70, "torchvision", DIVIDE))


def test_through_the_decode_workers(tmp_path):
    """Files → prepare (Pillow's decode, EXIF turn, our sampling) → the processors' pixels
    for the same decoded images and frames."""
    import av
    from PIL import Image, ImageOps

    from gemma4enc.dev.demo import write_video
    from gemma4enc.media.kinds import Item
    from gemma4enc.media.prepare import prepare
    from gemma4enc.options import Options

    photo(300, 500, seed=1).save(tmp_path / "a.jpg", quality=90)
    photo(700, 90, seed=2).save(tmp_path / "b.png")
    write_video(tmp_path / "clip.mp4", frames=20)
    options = Options(resize="torchvision")
    for name in ("a.jpg", "b.png"):
        path = str(tmp_path / name)
        done = prepare(Item(path=path, kind="image", size=1, mtime_ns=0), options)
        assert done.error is None, done.error
        image = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
        feats = Gemma4ImageProcessor()(images=[image], return_tensors="pt")
        same_as(feats["pixel_values"][0], feats["image_position_ids"][0], done.patches[0])
    path = str(tmp_path / "clip.mp4")
    done = prepare(Item(path=path, kind="video", size=1, mtime_ns=0), options)
    assert done.error is None, done.error
    with av.open(path) as c:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    feats = Gemma4VideoProcessor()(videos=[frames[done.video["frame_indices"]]], do_sample_frames=False,
                                   return_tensors="pt")
    for i, p in enumerate(done.patches):
        same_as(feats["pixel_values_videos"][i], feats["video_position_ids"][i], p)
