"""Images and frames → tower calls: serial, buckets of one patch count, or packs of any size.

A batch holds at most `max_patches` patches; the budget comes from a memory model measured
on the device (bytes per patch at two sizes), not from a constant.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from .patches import Patches

CPU_PATCHES = 8192  # on the CPU batching buys little (see README, bench): keep working sets small
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
            out += [group[i: i + step] for i in range(0, len(group), step)]
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


def resolve_batching(mode: str, device: torch.device) -> str:
    """auto: what `gemma4enc bench` measured fastest. On an accelerator, packs (one launch for
    many items, no padding); on the CPU one item per call: batching buys no FLOPs there and
    larger working sets cost cache (serial 1.13× pack, 1.75× hf-padded, README)."""
    if mode != "auto":
        return mode
    return "serial" if device.type == "cpu" else "pack"


def probe_items(n: int, count: int, seed: int = 0) -> list[Patches]:
    """Random patches shaped like a w×h grid near n patches (for probes and benchmarks)."""
    rng = np.random.default_rng(seed)
    side = max(3, int(round(n**0.5 / 3)) * 3)
    rows = max(3, (n // side) // 3 * 3)
    xs, ys = np.meshgrid(np.arange(side), np.arange(rows), indexing="xy")
    positions = np.stack([xs, ys], -1).reshape(-1, 2).astype(np.int64)
    return [Patches(rng.integers(0, 256, (len(positions), 768), dtype=np.uint8), positions) for _ in range(count)]


def measure_bytes_per_patch(tower, pack: bool) -> tuple[float, float]:
    """Peak CUDA bytes of a tower call = fixed + per_patch·N, fitted from two probe calls."""
    sizes = (2304, 4 * 2304)
    peaks = []
    for total in sizes:
        items = probe_items(2304, total // 2304)
        torch.cuda.synchronize(tower.device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(tower.device)
        torch.cuda.reset_peak_memory_stats(tower.device)
        tower.encode(items, pack=pack)
        torch.cuda.synchronize(tower.device)
        peaks.append(torch.cuda.max_memory_allocated(tower.device) - base)
    per_patch = max((peaks[1] - peaks[0]) / (sizes[1] - sizes[0]), 1.0)
    fixed = max(peaks[0] - per_patch * sizes[0], 0.0)
    return fixed, per_patch


def budget_patches(tower, options, mode: str) -> int:
    """--max-batch-patches, else memory_fraction × free memory / measured bytes per patch."""
    if options.max_batch_patches:
        return options.max_batch_patches
    if tower.device.type != "cuda":
        return CPU_PATCHES
    fixed, per_patch = measure_bytes_per_patch(tower, pack=mode == "pack")
    free, _ = torch.cuda.mem_get_info(tower.device)
    return max(2520, int((options.memory_fraction * free - fixed) / per_patch))
