"""The benchmark runs and reports every method; CUDA tests run where a GPU is present."""

from __future__ import annotations

import pytest
import torch

from gemma4enc.dev.bench import bench, random_tower, workload
from gemma4enc.dev.e2e import e2e
from gemma4enc.media.patches import patchify

from .helpers import close, hf_image_features, reference

pytestmark = pytest.mark.slow  # `make test` leaves these out; `make test-all` and CI run them

cuda = pytest.mark.cuda  # skipped where torch sees no CUDA device (conftest.py)


def test_bench_reports_every_method():
    report = bench(size="e2b", layers=1, device="cpu", workloads=("mixed",), count=4, repeats=1, log=lambda s: None)
    rows = report["workloads"]["mixed"]["methods"]
    assert set(rows) == {"hf-padded", "serial", "bucket", "pack"}
    assert rows["serial"]["vs_serial"] == 1.0
    for r in rows.values():
        assert r["items_per_s"] > 0 and r["seconds"] > 0
        assert r["vs_hf_padded"] == rows["hf-padded"]["seconds"] / r["seconds"]
    workload = report["workloads"]["mixed"]
    assert workload["default"] == "serial"  # --batching auto on the CPU
    assert workload["default_vs_hf_padded"] == rows["serial"]["vs_hf_padded"]


def test_e2e_bench_generates_real_kinds_once_and_reports_each(tmp_path, monkeypatch):
    """bench --e2e on the generated set, shrunk: every kind measured, cached for the next run."""
    from gemma4enc.dev import benchmedia

    monkeypatch.setenv("GEMMA4ENC_BENCH_MEDIA", str(tmp_path / "media"))
    monkeypatch.setenv("GEMMA4ENC_BENCH_SCALE", "0.03")
    lines = []
    report = e2e(size="e2b", layers=1, device="cpu", workers=1, repeats=1, image_tokens=70, frames=2, log=lines.append)
    expected = {k for k in benchmedia.plan() if not benchmedia.missing_encoder(k)}
    assert set(report["kinds"]) == expected and {"jpeg-12mp", "h264-1080p-60s"} <= expected
    for kind, entry in report["kinds"].items():
        assert entry["per_core"] > 0 and entry["peak_rss_per_worker_bytes"] > 0
        assert entry["cores_to_feed"] == report["tower_patches_per_s"] / entry["patches_per_core_s"]
        assert entry["frames"] == (2 if benchmedia.is_video(kind) else max(8, entry["files"]))
    assert report["generation_cpu_s"] > 0 and any("generating" in line for line in lines)
    assert set(report["items_per_s"]) == {"decode-only", "encode-only", "end-to-end"}
    slowest = min(report["items_per_s"]["decode-only"], report["items_per_s"]["encode-only"])
    assert report["overlap"] == report["items_per_s"]["end-to-end"] / slowest
    made = sorted(p.stat().st_mtime_ns for p in benchmedia.cache_dir().iterdir())
    again = e2e(size="e2b", layers=1, device="cpu", workers=1, repeats=1, tower_rate=370, image_tokens=70, frames=2,
                log=lambda s: None)
    assert again["generation_cpu_s"] == 0 and sorted(p.stat().st_mtime_ns for p in benchmedia.cache_dir().iterdir()) == made
    assert again["tower_patches_per_s"] == 370 * 70 * 9


def test_e2e_bench_samples_a_folder_by_kind(tmp_path, photos):

    for i, image in enumerate(photos[:3]):
        image.save(tmp_path / f"p{i}.jpg")
    photos[3].save(tmp_path / "s.png")
    (tmp_path / "notes.txt").write_text("not media")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)  # a bad file is left out, said
    lines = []
    report = e2e(size="e2b", layers=1, device="cpu", count=2, workers=1, repeats=1, folder=tmp_path, image_tokens=70,
                 log=lines.append)
    assert {k: v["files"] for k, v in report["kinds"].items()} == {"image-jpg": 2, "image-png": 1}
    assert report["kinds"]["image-png"]["left_out"] == [str(tmp_path / "broken.png")]
    assert sum("left out" in line and "broken.png" in line for line in lines) == 1
    assert report["files"] == 3 and report["source"] == str(tmp_path)


@cuda
def test_cuda_pack_and_bucket_match_serial_in_bfloat16():
    tower = random_tower("e2b", 4, torch.device("cuda"), torch.bfloat16)
    items = workload("mixed", 16)
    serial = [tower.encode([p])[0].float() for p in items]
    for pack in (False, True):
        outs = tower.encode(items, pack=True) if pack else [tower.encode([p])[0] for p in items]
        for got, want in zip(outs, serial):
            assert (got.float() - want).abs().max() <= 0.08 * want.abs().max()


@cuda
def test_cuda_bfloat16_matches_reference(ckpt_sharded, photos):
    from gemma4enc.model.load import load_tower

    tower = load_tower(str(ckpt_sharded), "bfloat16", "cuda")
    ref = reference(ckpt_sharded, torch.bfloat16)
    for image in photos[:4]:
        got = tower.encode([patchify(image, 280)], pack=True)[0].cpu()
        assert close(got, hf_image_features(ref, image), 0.08)


@cuda
def test_cuda_memory_model_predicts_the_peak_within_20_percent():
    from gemma4enc.dev.bench import PeakMemory
    from gemma4enc.model.batching import Unit, batches, measure_memory

    tower = random_tower("e2b", 4, torch.device("cuda"), torch.bfloat16)
    for mode in ("pack", "bucket"):
        model = measure_memory(tower, pack=mode == "pack")
        items = workload("photos", 24) + workload("video", 1)
        for batch in batches([Unit(i, 0, p) for i, p in enumerate(items)], mode, 40_000)[:4]:
            sizes = [u.patches.n for u in batch]
            with PeakMemory(tower.device) as mem:
                tower.encode([u.patches for u in batch], pack=mode == "pack")
            assert 0.8 <= mem.peak / model.peak(sizes) <= 1.2, (mode, sizes[:3], mem.peak, model.peak(sizes))


def test_bench_folder_needs_e2e_and_media(tmp_path):
    from typer.testing import CliRunner

    from gemma4enc.commands.cli import app

    run = CliRunner()
    without = run.invoke(app, ["bench", str(tmp_path)])
    empty = run.invoke(app, ["bench", "--e2e", "--device", "cpu", str(tmp_path)])
    assert (without.exit_code, empty.exit_code) == (2, 2)
    assert "--e2e" in without.output and "no images or videos" in empty.output
