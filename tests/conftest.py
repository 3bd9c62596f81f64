"""Shared fixtures: tiny random checkpoints (saved by transformers) and their reference models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from gemma4enc import demo

torch.set_num_threads(1)  # 2 shared cores: one thread is the steadiest


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """E2B-like: clipped linears, one model.safetensors."""
    folder = tmp_path_factory.mktemp("ckpt-single")
    demo.build(folder, seed=1, clipped=True, standardize=False)
    return folder


@pytest.fixture(scope="session")
def ckpt_sharded(tmp_path_factory):
    """26B-like: standardize (std_bias/std_scale), sharded with an index."""
    folder = tmp_path_factory.mktemp("ckpt-sharded")
    demo.build(folder, seed=2, clipped=True, standardize=True, shard_size="200KB")
    return folder


def reference(folder, dtype=torch.float32):
    """What a transformers user gets: the full model through from_pretrained."""
    from transformers import Gemma4ForConditionalGeneration

    return Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()


@pytest.fixture(scope="session")
def ref_sharded(ckpt_sharded):
    return reference(ckpt_sharded)


# (height, width): 8+ aspect ratios, from panoramas to slivers, tiny to large
SHAPES = [(480, 640), (512, 512), (1080, 1920), (300, 1200), (100, 3000), (3000, 90), (37, 41), (640, 480), (700, 90)]


def photo(h: int, w: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * 255 // max(w, 1)), (yy * 255 // max(h, 1)), ((xx + yy) % 256)], -1)
    noise = rng.integers(-30, 30, (h, w, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


@pytest.fixture(scope="session")
def photos():
    return [photo(h, w, seed=i) for i, (h, w) in enumerate(SHAPES)]
