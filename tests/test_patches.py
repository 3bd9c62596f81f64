"""Our copy of the processor's size rule, held equal to transformers' own function."""

from __future__ import annotations

import numpy as np
import pytest
from transformers.models.gemma4.image_processing_pil_gemma4 import (
    get_aspect_ratio_preserving_size,
)

from gemma4enc.media.patches import PATCH, POOL, target_size
from gemma4enc.options import SOFT_TOKEN_BUDGETS


def theirs(h: int, w: int, budget: int):
    try:
        return get_aspect_ratio_preserving_size(height=h, width=w, patch_size=PATCH,
                                                max_patches=budget * POOL * POOL, pooling_kernel_size=POOL)
    except ValueError:
        return "ValueError"


def ours(h: int, w: int, budget: int):
    try:
        return target_size(h, w, budget)
    except ValueError:
        return "ValueError"


def sides() -> list[int]:
    """1 … 60,000 px: every small side, then log-spaced, each with its ±1 neighbours (rounding edges)."""
    logs = np.unique(np.geomspace(1, 60_000, 140).astype(int))
    return sorted({*range(1, 64), *logs, *(logs + 1), *(logs - 1).clip(1), 4032, 3024, 6000, 4000, 1920, 1080})


@pytest.mark.parametrize("budget", SOFT_TOKEN_BUDGETS)
def test_target_size_equals_the_processors_rule(budget):
    s = sides()
    rng = np.random.default_rng(budget)
    pairs = [(h, w) for h in s for w in s]  # every aspect ratio from 1:60,000 to 60,000:1
    pairs += [tuple(map(int, rng.integers(1, 20_000, 2))) for _ in range(20_000)]
    differ = [(h, w, ours(h, w, budget), theirs(h, w, budget)) for h, w in pairs
              if ours(h, w, budget) != theirs(h, w, budget)]
    assert not differ, f"{len(differ)} of {len(pairs)} sizes differ, e.g. {differ[:5]}"
    assert any(h < 48 or w < 48 for h, w in pairs)  # the slivers' branch was exercised


def test_budget_outside_the_processors_list_is_refused():
    with pytest.raises(ValueError, match="max_soft_tokens"):
        target_size(100, 100, 100)


def test_decode_workers_import_neither_torch_nor_transformers():
    """A worker's imports are its start-up time and its RSS: only Pillow, NumPy and the decoders."""
    import subprocess
    import sys

    code = ("import sys, gemma4enc.media.workers, gemma4enc.media.decode, gemma4enc.media.patches; "
            "print(' '.join(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", out.stdout
