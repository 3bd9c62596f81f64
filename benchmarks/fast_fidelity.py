"""--resize fast against exact on a folder of real files: the worst PSNR at every budget.

    python benchmarks/fast_fidelity.py DIR [DIR ...] [--json out.jsonl]

Each file Pillow (with pillow-heif) decodes is decoded exact and fast at 70, 140, 280, 560 and
1120 soft tokens; the PSNR of fast's patch pixels against exact's is taken per file, and the
worst file per budget is reported with how many fell under 45 dB (a mean would hide them). The
figures of 2026-12-03 in docs/benchmarks.md came from this over ~460 real files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemma4enc.media.frames import DecodeError  # noqa: E402
from gemma4enc.media.image import decode_image  # noqa: E402
from gemma4enc.media.patches import patchify  # noqa: E402
from gemma4enc.options import SOFT_TOKEN_BUDGETS  # noqa: E402

MAX = 89_478_485
FLOOR_DB = 45.0
IDENTICAL_DB = 100.0  # reported for identical pixels (JSON has no infinity)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return IDENTICAL_DB if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def measure(path: Path) -> dict | None:
    """{budget: (PSNR, decoded (w, h))} for one file, or None where exact cannot decode it."""
    try:
        exact = decode_image(str(path), MAX).images[0]
    except (DecodeError, OSError):
        return None
    out = {}
    for budget in SOFT_TOKEN_BUDGETS:
        fast = decode_image(str(path), MAX, fit=budget)
        out[budget] = (round(psnr(patchify(fast.images[0], budget).pixels, patchify(exact, budget).pixels), 2),
                       fast.info["decoded"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+")
    p.add_argument("--json", help="one line per file here")
    args = p.parse_args()
    files = sorted(f for d in args.dirs for f in Path(d).rglob("*") if f.is_file())
    sink = open(args.json, "w") if args.json else None  # noqa: SIM115 - closed below
    results = {}
    for n, path in enumerate(files, 1):
        got = measure(path)
        if got is None:
            continue
        results[path] = got
        if sink:
            sink.write(json.dumps({"file": str(path), **{str(b): v for b, v in got.items()}}) + "\n")
        if n % 25 == 0:
            print(f"{n}/{len(files)} files", file=sys.stderr, flush=True)
    if sink:
        sink.close()
    print(f"{len(results)} of {len(files)} files decoded")
    for budget in SOFT_TOKEN_BUDGETS:
        worst = min(results, key=lambda f: results[f][budget][0])
        under = sum(results[f][budget][0] < FLOOR_DB for f in results)
        print(f"{budget:5d} tokens: worst {results[worst][budget][0]:.2f} dB ({worst.name}), {under} under {FLOOR_DB:g} dB")


if __name__ == "__main__":
    main()
