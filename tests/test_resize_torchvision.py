"""--resize torchvision where torchvision is absent (the main venv): recorded, encoded by torch
alone, tokens equal to transformers' on the same pixel values. The pixels themselves are held
equal to the torchvision processors' in tests/test_torchvision_pixels.py (`make test-torchvision`)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import torch

from gemma4enc.dev.demo import write_video
from gemma4enc.media.patches import DIVIDE, MULTIPLY, patchify
from gemma4enc.model.tower import _UNIT

from .helpers import BASE, by_name, close, encode, flags, photo, shard_tokens


def values(p) -> torch.Tensor:
    """The float32 pixel values the tower feeds its patch embedder for these patches."""
    return _UNIT[torch.from_numpy(p.pixels).long() + 256 * p.unit]


def test_scaling_tables_are_the_processors_arithmetic():
    x = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(_UNIT[:256], x.to(torch.float32) / 255)  # PIL processor, torchvision video processor
    assert torch.equal(_UNIT[256:], x * (1 / 255))  # the torchvision image processor's `image * rescale_factor`
    assert not torch.equal(_UNIT[:256], _UNIT[256:])  # 126 of them are 1 ulp apart: the difference is real


def test_same_grid_as_pil_and_a_different_resize():
    for i, (h, w) in enumerate([(480, 640), (3000, 90), (37, 41), (1080, 1920)]):
        image = photo(h, w, seed=i)
        ours, pil = patchify(image, 280, "torchvision", MULTIPLY), patchify(image, 280)
        assert (ours.positions == pil.positions).all() and ours.unit == MULTIPLY
        diff = np.abs(ours.pixels.astype(int) - pil.pixels.astype(int))
        assert diff.mean() < 1.0 and diff.max() > 0, (h, w, diff.max())  # two bicubics, a few levels apart


def test_encode_records_the_mode_and_matches_transformers(tmp_path, ckpt):
    from transformers import Gemma4ForConditionalGeneration

    media = tmp_path / "media"
    media.mkdir()
    for i, (h, w) in enumerate([(240, 320), (90, 400)]):
        photo(h, w, seed=i).save(media / f"p{i}.png")
    write_video(media / "clip.mp4", frames=12)
    out = tmp_path / "out"
    result = encode([media, "-o", out, "--model", ckpt, *flags(resize="torchvision")])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "settings.json").read_text())["resize"] == "torchvision"
    # a run with another mode is refused, as for any setting that changes the output
    assert encode([media, "-o", out, "--model", ckpt, *BASE]).exit_code == 2

    ref = Gemma4ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    rows, tokens = shard_tokens(out)
    named = by_name(out)
    for name in ("p0.png", "p1.png"):
        from PIL import Image

        p = patchify(np.asarray(Image.open(media / name).convert("RGB")), 280, "torchvision", MULTIPLY)
        with torch.no_grad():
            theirs = ref.model.get_image_features(values(p)[None], image_position_ids=torch.from_numpy(
                p.positions)[None]).pooler_output[0]
        assert close(tokens[named[name]["path"]], theirs, 1e-4)
    # video frames: the video processor's x / 255
    import av

    row = named["clip.mp4"]
    with av.open(str(media / "clip.mp4")) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    ps = [patchify(frames[i], 70, "torchvision", DIVIDE) for i in row["frame_indices"]]
    with torch.no_grad():
        theirs = ref.model.get_video_features(
            torch.stack([values(p) for p in ps]), torch.stack([torch.from_numpy(p.positions) for p in ps]),
            num_frames_per_video=torch.tensor([len(ps)])).pooler_output[0]
    assert close(tokens[row["path"]], theirs, 1e-4)


def test_the_mode_never_imports_torchvision(tmp_path):
    code = ("import sys, numpy as np; from gemma4enc.media.patches import patchify;"
            "patchify(np.zeros((100, 200, 3), np.uint8), 70, 'torchvision');"
            "print('torchvision' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr
