"""The benchmark runs and reports every method; CUDA tests run where a GPU is present."""

from __future__ import annotations

import pytest
import torch

from gemma4enc.bench import bench, e2e, random_tower, workload
from gemma4enc.patches import patchify

from .helpers import close, hf_image_features, reference

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


def test_e2e_bench_reports_decode_encode_and_overlap():
    report = e2e(size="e2b", layers=1, device="cpu", count=3, workers=1, repeats=1, log=lambda s: None)
    assert set(report["items_per_s"]) == {"decode-only", "encode-only", "end-to-end"}
    assert report["files"] == 3 and all(v > 0 for v in report["items_per_s"].values())
    slowest = min(report["items_per_s"]["decode-only"], report["items_per_s"]["encode-only"])
    assert report["overlap"] == report["items_per_s"]["end-to-end"] / slowest


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
    from gemma4enc.model import load_tower

    tower = load_tower(str(ckpt_sharded), "bfloat16", "cuda")
    ref = reference(ckpt_sharded, torch.bfloat16)
    for image in photos[:4]:
        got = tower.encode([patchify(image, 280)], pack=True)[0].cpu()
        assert close(got, hf_image_features(ref, image), 0.08)


@cuda
def test_cuda_memory_model_predicts_the_peak_within_20_percent():
    from gemma4enc.bench import PeakMemory
    from gemma4enc.plan import Unit, batches, measure_memory

    tower = random_tower("e2b", 4, torch.device("cuda"), torch.bfloat16)
    for mode in ("pack", "bucket"):
        model = measure_memory(tower, pack=mode == "pack")
        items = workload("photos", 24) + workload("video", 1)
        for batch in batches([Unit(i, 0, p) for i, p in enumerate(items)], mode, 40_000)[:4]:
            sizes = [u.patches.n for u in batch]
            with PeakMemory(tower.device) as mem:
                tower.encode([u.patches for u in batch], pack=mode == "pack")
            assert 0.8 <= mem.peak / model.peak(sizes) <= 1.2, (mode, sizes[:3], mem.peak, model.peak(sizes))
