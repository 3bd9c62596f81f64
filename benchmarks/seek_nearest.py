"""CPU per sampled frame for --seek exact, nearest and keyframe on a short-GOP (phone-like) and a
long-GOP clip: 40 s of 854×480 H.264 from benchmedia.write_clip, 32 samples, PyAV, one thread,
the minimum of 3 runs of process time. Figures go to docs/benchmarks.md.

    python benchmarks/seek_nearest.py [--work DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from gemma4enc.dev.benchmedia import write_clip
from gemma4enc.media.decode import decode_video
from gemma4enc.options import Sampling

CLIPS = {"gop30.mp4": {"g": "30", "bf": "0", "sc_threshold": "0"},  # 1 s GOP at 30 fps, as phones write
         "gop250.mp4": {"g": "250", "bf": "3", "sc_threshold": "0"}}  # x264's default GOP, B-frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/gemma4enc-seek-bench"))
    work = parser.parse_args().work
    work.mkdir(parents=True, exist_ok=True)
    for name, options in CLIPS.items():
        if not (work / name).exists():
            write_clip(work / name, "libx264", (854, 480), 40.0, options, log=lambda m: None)
    sampling = Sampling(frames=32)
    for name in CLIPS:
        for seek in ("exact", "nearest", "keyframe"):
            best = float("inf")
            for _ in range(3):
                start = time.process_time()
                got = decode_video(str(work / name), sampling, "pyav", seek=seek)
                best = min(best, time.process_time() - start)
            asked = sampling.indices(got.info["total_frames"])
            moved = sum(a != b for a, b in zip(got.indices, asked)) if len(got.indices) == len(asked) else "-"
            print(f"{name} {seek}: {best * 1000 / len(got.indices):.1f} ms per sample, {len(got.indices)} samples, "
                  f"{moved} moved", flush=True)


if __name__ == "__main__":
    main()
