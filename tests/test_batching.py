"""model/batching.py on its own: grouping images and frames into tower calls, and the memory model that
sizes those calls. No tower runs here; when one of these fails, batching or its budget broke."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gemma4enc.model.batching as batching
from gemma4enc.media.patches import Patches
from gemma4enc.model.batching import (
    CPU_PATCHES,
    PROBES,
    MemoryModel,
    Unit,
    batches,
    budget_patches,
    fit_memory,
    largest_item,
    probe_items,
    resolve_batching,
)
from gemma4enc.options import Options


def units(*sizes: int) -> list[Unit]:
    return [Unit(i, 0, Patches(np.zeros((n, 768), np.uint8), np.zeros((n, 2), np.int64))) for i, n in enumerate(sizes)]


def files(groups: list[list[Unit]]) -> list[list[int]]:
    return [[u.file for u in g] for g in groups]


def test_serial_is_one_call_per_unit_in_order():
    assert files(batches(units(9, 18, 9), "serial", 10**6)) == [[0], [1], [2]]


def test_bucket_stacks_equal_sizes_up_to_the_budget():
    # n=9: 27 // 9 = 3 per call; n=18: 27 // 18 = 1; n=36 is over the budget: alone
    assert files(batches(units(9, 18, 9, 9, 18, 36, 9), "bucket", 27)) == [[0, 2, 3], [6], [1], [4], [5]]


def test_pack_fills_calls_biggest_first():
    # sorted 45, 36, 18, 18, 9, 9, 9 into calls of ≤ 54: [45] [36 18] [18 9 9 9]
    assert files(batches(units(9, 18, 9, 9, 18, 36, 45), "pack", 54)) == [[6], [5, 1], [4, 0, 2, 3]]
    assert files(batches(units(100, 9), "pack", 54)) == [[0], [1]]  # bigger than the budget: alone
    assert batches([], "pack", 54) == []


@pytest.mark.parametrize("mode", ["serial", "bucket", "pack"])
def test_every_unit_goes_to_exactly_one_call_within_the_budget(mode):
    rng = np.random.default_rng(7)
    sizes = [int(9 * k) for k in rng.integers(1, 120, 300)]
    limit = 2000
    groups = batches(units(*sizes), mode, limit)
    assert sorted(u.file for g in groups for u in g) == list(range(len(sizes)))
    for g in groups:
        total = sum(u.patches.n for u in g)
        assert len(g) == 1 or total <= limit, (mode, [u.patches.n for u in g])
        if mode == "bucket":
            assert len({u.patches.n for u in g}) == 1


def test_an_unknown_batching_names_the_choices():
    with pytest.raises(ValueError, match="unknown batching 'fast': use one of auto, serial, bucket, pack"):
        batches(units(9), "fast", 100)


def test_auto_batching_is_serial_on_the_cpu_and_packs_elsewhere():
    assert resolve_batching("auto", torch.device("cpu")) == "serial"
    assert resolve_batching("auto", torch.device("cuda")) == "pack"
    assert resolve_batching("bucket", torch.device("cuda")) == "bucket"


def test_probe_items_are_grids_of_the_asked_size():
    for n, count in PROBES:
        items = probe_items(n, count)
        assert [p.n for p in items] == [n] * count  # the probe sizes are squares of whole 3×3 pools
        grid = {tuple(xy) for xy in items[0].positions}
        assert len(grid) == n and max(x for x, _ in grid) == max(y for _, y in grid) == int(n**0.5) - 1


def test_the_memory_model_adds_its_terms():
    model = MemoryModel(fixed=100.0, per_patch=2.0, per_patch_sq=0.5)
    assert model.peak([3, 4]) == 100 + 2 * 7 + 0.5 * (9 + 16)
    # (1000 - 100) / (2 + 0.5 × 10) = 128.57: 128 patches of items ≤ 10 peak at ≤ 996, 129 could reach 1003
    assert model.max_patches(1000.0, largest=10) == 128


def test_the_fit_recovers_exact_terms_and_drops_a_negative_one():
    calls = [[p.n for p in probe_items(n, k)] for n, k in PROBES]
    truth = MemoryModel(3e8, 9e4, 40.0)
    model = fit_memory(calls, [truth.peak(c) for c in calls])
    assert model.fixed == pytest.approx(3e8, rel=1e-6) and model.per_patch == pytest.approx(9e4, rel=1e-6)
    assert model.per_patch_sq == pytest.approx(40.0, rel=1e-6)
    # a device whose peak grows less than linearly shows no quadratic term: it is dropped, not negative
    sub = [3e8 + 9e4 * sum(c) - 5.0 * sum(n * n for n in c) for c in calls]
    assert fit_memory(calls, sub).per_patch_sq == 0.0


def test_memory_model_fit_and_budget_hold_for_any_token_budget():
    """The fit recovers a device's linear and quadratic terms from the probe shapes, and the
    patches it allows keep every planned pack under the budget, from 70 to 1120 tokens per item."""
    calls = [[p.n for p in probe_items(n, k)] for n, k in PROBES]
    for truth in ((3e8, 9e4, 40.0), (3e8, 9e4, 0.0)):  # scores materialised (eager) or not (varlen)
        fixed, a, b = truth
        peaks = [fixed + a * sum(c) + b * sum(n * n for n in c) for c in calls]
        model = fit_memory(calls, [p * (1 + 0.01 * (-1) ** i) for i, p in enumerate(peaks)])  # 1% noise
        assert abs(model.per_patch - a) / a < 0.15 and abs(model.per_patch_sq - b) <= 0.15 * b + 1e-3
        budget = 16e9 * 0.7  # a 16 GB card
        for tokens in (70, 140, 280, 560, 1120):
            largest = largest_item(Options(image_tokens=tokens, video_tokens=70))
            limit = max(largest, model.max_patches(budget, largest))
            sizes = [largest] * 3 + [largest // 4] * 40 + [630] * 64
            for batch in batches(units(*sizes), "pack", limit):
                assert fixed + a * sum(u.patches.n for u in batch) + b * sum(u.patches.n ** 2 for u in batch) <= budget


def test_the_largest_item_is_nine_patches_per_soft_token():
    assert largest_item(Options(image_tokens=1120, video_tokens=70)) == 10080
    assert largest_item(Options(image_tokens=70, video_tokens=280)) == 2520


class FakeTower:
    def __init__(self, device: str):
        self.device = torch.device(device)


def test_the_budget_is_the_flag_then_the_cpu_constant_then_the_fit(monkeypatch):
    assert budget_patches(FakeTower("cuda"), Options(max_batch_patches=500), "pack") == 500
    assert budget_patches(FakeTower("cpu"), Options(), "serial") == CPU_PATCHES
    measured = []
    monkeypatch.setattr(batching, "measure_memory", lambda tower, pack: measured.append(pack) or MemoryModel(1e9, 1e5, 10))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (16e9, 80e9))
    # 0.5 × 16e9 free, fixed 1e9, largest 2520 (280 tokens): (8e9 - 1e9) / (1e5 + 10 × 2520) = 55910.5
    assert budget_patches(FakeTower("cuda"), Options(memory_fraction=0.5), "pack") == 55910
    assert measured == [True]
    # a budget that would not hold one largest item still takes one: it is encoded alone anyway
    monkeypatch.setattr(batching, "measure_memory", lambda tower, pack: MemoryModel(7.9e9, 1e5, 10))
    assert budget_patches(FakeTower("cuda"), Options(memory_fraction=0.5), "bucket") == 2520
