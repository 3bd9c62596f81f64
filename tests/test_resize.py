"""--resize fast against exact on real-size photos: the same grid, ≥ 45 dB, the right way up, recorded."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open
from transformers.models.gemma4.image_processing_pil_gemma4 import (
    Gemma4ImageProcessorPil,
)

from gemma4enc.dev.camera import camera_photo, save_photo
from gemma4enc.media.decode import DecodeError, decode_image
from gemma4enc.media.patches import patchify

from .helpers import encode

MAX = 89_478_485
FLOOR_DB = 45.0  # the fidelity floor for the fast path, patch pixels against exact


@pytest.fixture(scope="session")
def big_photos(tmp_path_factory):
    """12 MP phone JPEGs: a landscape, and portraits stored 4032×3024 under EXIF 6 and 8; a 4 MP PNG."""
    folder = tmp_path_factory.mktemp("big-photos")
    made = {}
    for i, orientation in enumerate((1, 6, 8)):
        w, h = (4032, 3024) if orientation == 1 else (3024, 4032)  # upright, as the phone was held
        made[f"o{orientation}.jpg"] = save_photo(camera_photo(w, h, seed=i), folder / f"o{orientation}.jpg",
                                                 orientation)
    made["screen.png"] = save_photo(camera_photo(2400, 1800, seed=9), folder / "screen.png")
    return made


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def picture(p) -> np.ndarray:
    """Patches back to the (h, w, 3) picture they were cut from."""
    pw, ph = p.positions.max(0) + 1
    return p.pixels.reshape(ph, pw, 16, 16, 3).transpose(0, 2, 1, 3, 4).reshape(ph * 16, pw * 16, 3)


def both(path, budget: int = 280):
    exact = patchify(decode_image(str(path), MAX).images[0], budget)
    fast = decode_image(str(path), MAX, fit=budget)
    return exact, fast, patchify(fast.images[0], budget)


@pytest.mark.slow
def test_fast_is_within_45_db_of_exact_with_the_same_grid(big_photos):
    scores = {}
    for name, path in big_photos.items():
        budget = 70 if name.endswith(".png") else 280  # the PNG: 2400 px is ≥ 2× its 70-token target
        exact, fast, patches = both(path, budget)
        assert patches.n == exact.n and (patches.positions == exact.positions).all(), name
        scores[name] = psnr(patches.pixels, exact.pixels)
        full = fast.info["width"] * fast.info["height"]
        decoded = fast.info["decoded"][0] * fast.info["decoded"][1]
        if name.endswith(".jpg"):  # a reduced decode, no full-size buffer: 1/2 scale, as 1/4 would
            assert decoded * 4 == full, (name, fast.info)  # be 1.1× the target, under DRAFT_MARGIN
    worst = min(scores.values())
    summary = f"PSNR mean {np.mean(list(scores.values())):.1f} dB, worst {worst:.1f} dB: {scores}"
    assert worst >= FLOOR_DB, summary


@pytest.mark.parametrize("name", ["o6.jpg", "o8.jpg"])
def test_fast_turns_photos_upright_as_exact_does(big_photos, name):
    exact, fast, patches = both(big_photos[name])
    assert Image.open(big_photos[name]).size == (4032, 3024)  # stored as the sensor reads
    assert (fast.info["width"], fast.info["height"]) == (3024, 4032)  # upright: portrait
    assert fast.images[0].image.size == (672, 912)
    assert patches.n == exact.n and (patches.positions == exact.positions).all()
    upright, ours = picture(exact), picture(patches)
    assert psnr(ours, upright) >= FLOOR_DB
    assert psnr(ours, upright[::-1, ::-1]) < 25  # the check tells a half-turn apart (6 from 8)


def test_exact_is_bit_identical_to_the_pil_processor(big_photos):
    from transformers.image_utils import load_image

    proc = Gemma4ImageProcessorPil()
    for name in ("o1.jpg", "o6.jpg"):
        feats = proc(images=[load_image(str(big_photos[name]))], return_tensors="np")
        mine = patchify(decode_image(str(big_photos[name]), MAX).images[0], 280)
        n = mine.n
        assert (feats["image_position_ids"][0, :n] == mine.positions).all()
        assert (feats["pixel_values"][0, :n] == (mine.pixels.astype("float64") * (1 / 255)).astype("float32")).all()


def test_fast_keeps_the_bomb_check_on_the_full_size(big_photos):
    with pytest.raises(DecodeError) as e:
        decode_image(str(big_photos["o1.jpg"]), 4032 * 3024 // 2, fit=280)  # the 1/2 decode would fit
    assert e.value.status == "too_large"


def test_small_images_are_the_same_either_way(tmp_path):
    """Nothing to shrink (under 2× the target): fast is exact, bit for bit."""
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 500, 3), dtype=np.uint8)).save(tmp_path / "s.png")
    exact, _, fast = both(tmp_path / "s.png")
    assert np.array_equal(exact.pixels, fast.pixels)


def test_the_mode_is_recorded_and_a_change_is_refused(big_photos, ckpt, tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    (media / "p.jpg").write_bytes(big_photos["o6.jpg"].read_bytes())
    out = tmp_path / "out"
    args = [media, "-o", out, "--model", ckpt, "--device", "cpu", "--dtype", "float32", "--json", "-q"]
    assert encode(args).exit_code == 0
    assert json.loads((out / "settings.json").read_text())["resize"] == "fast"  # the default
    with safe_open(str(next(out.glob("shard-*"))), framework="pt") as f:
        assert f.metadata()["resize"] == "fast"
    refused = encode([*args, "--resize", "exact"])
    assert refused.exit_code == 2 and "resize" in refused.output and "--overwrite" in refused.output
    again = encode([*args, "--resize", "exact", "--overwrite"])
    assert again.exit_code == 0 and json.loads(again.stdout)["encoded"] == 1
    assert json.loads((out / "settings.json").read_text())["resize"] == "exact"
    with safe_open(str(next(out.glob("shard-*"))), framework="pt") as f:
        assert f.metadata()["resize"] == "exact"
    assert encode([*args, "--resize", "sideways"]).exit_code == 2


@pytest.mark.slow
def test_decode_benchmark_measures_a_folder(tmp_path):
    """benchmarks/decode.py DIR end to end on tiny files: every method of every kind, side by side."""
    import subprocess
    import sys
    from pathlib import Path

    from gemma4enc.dev.demo import write_video

    folder = tmp_path / "mine"
    save_photo(camera_photo(640, 480, seed=1), folder / "a.jpg", orientation=6)
    save_photo(camera_photo(300, 200, seed=2), folder / "b.png")
    write_video(folder / "c.mp4", frames=12)
    script = Path(__file__).parents[1] / "benchmarks" / "decode.py"
    out = tmp_path / "report.json"
    run = subprocess.run([sys.executable, str(script), str(folder), "--rounds", "1", "--min-files", "1",
                          "--frames", "4", "--tower-rate", "100", "--json", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    kinds = json.loads(out.read_text())["kinds"]
    assert set(kinds) == {"image-jpg", "image-png", "video-mp4"}
    jpg = kinds["image-jpg"]
    assert set(jpg["methods"]) == {"fast", "exact", "transformers"} and jpg["psnr_db"]["worst"] >= FLOOR_DB
    fast = jpg["methods"]["fast"]
    assert fast["cores_to_feed"] == pytest.approx(100 / fast["per_core"]) and fast["peak_rss_mb"] > 10
    assert {"auto", "pyav"} <= set(kinds["video-mp4"]["methods"]) and "fast vs exact" in run.stderr
