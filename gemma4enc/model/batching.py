"""Images and frames → tower calls: serial, buckets of one patch count, or packs of any size.

A batch holds at most `max_patches` patches; the budget comes from a memory model measured
on the device (bytes per patch at two sizes), not from a constant.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from ..media.patches import POOL, Patches

CPU_PATCHES = (
    8192  # on the CPU batching buys little (see docs/benchmarks/tower.md): keep working sets small
)
BATCHINGS = ("auto", "serial", "bucket", "pack")


@dataclass(frozen=True)
class Unit:
    """One image or video frame on its way through the tower."""

    file: int  # index of its file in the window
    frame: int  # index of the frame within its file
    patches: Patches


def batches(units: list[Unit], mode: str, max_patches: int) -> list[list[Unit]]:
    """Group units into tower calls of at most max_patches patches (a bigger unit goes alone)."""
    if mode == "serial":
        return [[u] for u in units]
    if mode == "bucket":
        groups: dict[int, list[Unit]] = defaultdict(list)
        for u in units:
            groups[u.patches.n].append(u)
        out = []
        for n, group in groups.items():
            step = max(1, max_patches // n)
            out += [group[i : i + step] for i in range(0, len(group), step)]
        return out
    if mode == "pack":
        out, current, size = [], [], 0
        for u in sorted(units, key=lambda u: -u.patches.n):  # big first: packs fill evenly
            if current and size + u.patches.n > max_patches:
                out.append(current)
                current, size = [], 0
            current.append(u)
            size += u.patches.n
        return out + ([current] if current else [])
    raise ValueError(f"unknown batching {mode!r}: use one of {', '.join(BATCHINGS)}")


def resolve_batching(mode: str, device: torch.device, attention: bool = True) -> str:
    """auto: what `gemma4enc bench` measured fastest. On an accelerator, packs (one launch for
    many items, no padding); on the CPU one item per call: batching buys no FLOPs there and
    larger working sets cost cache (serial beat pack and hf-padded, docs/benchmarks/tower.md).
    A tower without attention (the unified model) takes packs everywhere: one call over as many
    patches as the budget allows, nothing to pad or mask."""
    if mode != "auto":
        return mode
    return "serial" if device.type == "cpu" and attention else "pack"


def probe_items(n: int, count: int, seed: int = 0) -> list[Patches]:
    """Random patches shaped like a w×h grid near n patches (for probes and benchmarks)."""
    rng = np.random.default_rng(seed)
    side = max(3, int(round(n**0.5 / 3)) * 3)
    rows = max(3, (n // side) // 3 * 3)
    xs, ys = np.meshgrid(np.arange(side), np.arange(rows), indexing="xy")
    positions = np.stack([xs, ys], -1).reshape(-1, 2).astype(np.int64)
    return [
        Patches(rng.integers(0, 256, (len(positions), 768), dtype=np.uint8), positions)
        for _ in range(count)
    ]


@dataclass(frozen=True)
class MemoryModel:
    """Peak accelerator bytes of one tower call on items of n_i patches:

        fixed + per_patch · Σ n_i + per_patch_sq · Σ n_i²

    The linear term is activations (hidden states, MLP, q/k/v, pooling); the quadratic one is
    attention scores where the kernel materialises them (per item: attention never crosses
    items), ~0 for flash / memory-efficient / varlen kernels. Measured on the device at start.
    """

    fixed: float
    per_patch: float
    per_patch_sq: float

    def peak(self, sizes: list[int]) -> float:
        return self.fixed + self.per_patch * sum(sizes) + self.per_patch_sq * sum(n * n for n in sizes)

    def max_patches(self, budget: float, largest: int) -> int:
        """Patches per call within `budget` when no item exceeds `largest` patches (Σn² ≤ N·largest)."""
        return int((budget - self.fixed) / (self.per_patch + self.per_patch_sq * largest))


# (patches per item, items): Σn equal in the first two, Σn² 4× apart, so both terms are seen
PROBES = ((576, 4), (2304, 1), (2304, 4))


def fit_memory(calls: list[list[int]], peaks: list[float]) -> MemoryModel:
    """Least squares over probe calls; a term the device does not show (negative fit) is dropped."""
    a = np.array([[1.0, sum(c), sum(n * n for n in c)] for c in calls])
    y = np.array(peaks, dtype=float)
    coef = np.linalg.lstsq(a, y, rcond=None)[0]
    if coef[2] < 0:
        coef = np.append(np.linalg.lstsq(a[:, :2], y, rcond=None)[0], 0.0)
    fixed, per_patch, per_patch_sq = coef
    return MemoryModel(max(float(fixed), 0.0), max(float(per_patch), 1.0), float(per_patch_sq))


def measure_memory(tower, pack: bool) -> MemoryModel:
    """Probe calls on the device; each one's peak above what was allocated before it."""
    calls, peaks = [], []
    tower.encode(
        probe_items(PROBES[0][0], 1), pack=pack
    )  # first-call allocations (cuBLAS workspace…) are not per call
    for n, count in PROBES:
        items = probe_items(n, count)
        torch.cuda.synchronize(tower.device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(tower.device)
        torch.cuda.reset_peak_memory_stats(tower.device)
        tower.encode(items, pack=pack)
        torch.cuda.synchronize(tower.device)
        peaks.append(torch.cuda.max_memory_allocated(tower.device) - base)
        calls.append([p.n for p in items])
    return fit_memory(calls, peaks)


def largest_item(options) -> int:
    """Patches of the biggest image or frame this run can meet (9 per soft token)."""
    return POOL * POOL * max(options.image_tokens, options.video_tokens)


def budget_patches(tower, options, mode: str) -> int:
    """--max-batch-patches, else what the measured memory model fits in memory_fraction × free memory.

    Never below one largest item: an item bigger than the budget is encoded alone anyway."""
    if options.max_batch_patches:
        return options.max_batch_patches
    if tower.device.type != "cuda":
        return CPU_PATCHES
    model = measure_memory(tower, pack=mode == "pack")
    free, _ = torch.cuda.mem_get_info(tower.device)
    largest = largest_item(options)
    return max(largest, model.max_patches(options.memory_fraction * free, largest))
