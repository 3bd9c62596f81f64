"""The benchmark runs and reports every method; CUDA tests run where a GPU is present."""

from __future__ import annotations

import pytest
import torch

from gemma4enc.bench import bench, e2e, random_tower, workload
from gemma4enc.patches import patchify

cuda = pytest.mark.cuda
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_bench_reports_every_method():
    report = bench(size="e2b", layers=1, device="cpu", workloads=("mixed",), count=4, repeats=1, log=lambda s: None)
    rows = report["workloads"]["mixed"]["methods"]
    assert set(rows) == {"hf-padded", "serial", "bucket", "pack"}
    assert rows["serial"]["vs_serial"] == 1.0
    for r in rows.values():
        assert r["items_per_s"] > 0 and r["seconds"] > 0


def test_e2e_bench_reports_decode_encode_and_overlap():
    report = e2e(size="e2b", layers=1, device="cpu", count=3, workers=1, repeats=1, log=lambda s: None)
    assert set(report["items_per_s"]) == {"decode-only", "encode-only", "end-to-end"}
    assert report["files"] == 3 and all(v > 0 for v in report["items_per_s"].values())
    slowest = min(report["items_per_s"]["decode-only"], report["items_per_s"]["encode-only"])
    assert report["overlap"] == report["items_per_s"]["end-to-end"] / slowest


@cuda
@needs_gpu
def test_cuda_pack_and_bucket_match_serial_in_bfloat16():
    tower = random_tower("e2b", 4, torch.device("cuda"), torch.bfloat16)
    items = workload("mixed", 16)
    serial = [tower.encode([p])[0].float() for p in items]
    for pack in (False, True):
        outs = tower.encode(items, pack=True) if pack else [tower.encode([p])[0] for p in items]
        for got, want in zip(outs, serial):
            assert (got.float() - want).abs().max() <= 0.08 * want.abs().max()


@cuda
@needs_gpu
def test_cuda_bfloat16_matches_reference(ckpt_sharded, photos):
    from .conftest import reference
    from .test_tower import close, hf_image_features
    from gemma4enc.tower import load_tower

    tower = load_tower(str(ckpt_sharded), "bfloat16", "cuda")
    ref = reference(ckpt_sharded, torch.bfloat16)
    for image in photos[:4]:
        got = tower.encode([patchify(image, 280)], pack=True)[0].cpu()
        assert close(got, hf_image_features(ref, image), 0.08)
