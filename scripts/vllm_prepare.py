"""scripts/vllm_check.sh, step 1 (gemma4enc's venv): the checkpoint, media, OUTs and export that
vLLM is then run on (scripts/vllm_check.py, vLLM's venv). Everything goes under W.

  W/demo/tiny-gemma4    `gemma4enc demo`'s checkpoint: the one a user gets, served as it is
  W/media               a.png and b.png (same size, other content), c.png (another aspect), clip.mp4
  W/out32, W/out16      encode --resize torchvision --hash, the tower in float32 / bfloat16
  W/export32            export W/out32 --to vllm --dtype float32
  W/frames/clip.mp4.npy the clip's frames gemma4enc sampled, decoded: vLLM's pixel path gets these
  W/plan.json           what the check reads: paths, the rows, the commands run and their times
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image


def photo(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * 255 // w), (yy * 255 // h), ((xx * (seed + 1) + yy) % 256)], -1)
    return Image.fromarray(np.clip(base + rng.integers(-40, 40, (h, w, 3)), 0, 255).astype(np.uint8))


def run(*args: str) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gemma4enc", *args], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        sys.exit(f"vllm prepare: gemma4enc {' '.join(args)} exited {done.returncode}: {done.stderr.strip()[-400:]}")
    return round(time.perf_counter() - start, 2)


def main(w: Path) -> None:
    from gemma4enc.dev.demo import write_video

    w.mkdir(parents=True, exist_ok=True)
    times = {"demo": run("demo", str(w / "demo"))}
    ckpt = w / "demo" / "tiny-gemma4"
    media = w / "media"
    media.mkdir(exist_ok=True)
    photo(300, 500, 1).save(media / "a.png")
    photo(300, 500, 2).save(media / "b.png")
    photo(720, 480, 3).save(media / "c.png")
    write_video(media / "clip.mp4", frames=40, size=(320, 240))
    common = ["--model", str(ckpt), "--resize", "torchvision", "--hash", "--frames", "4", "--device", "cpu",
              "--workers", "0", "-q"]
    times["encode32"] = run("encode", str(media), "-o", str(w / "out32"), "--dtype", "float32",
                            "--out-dtype", "float32", *common)
    times["encode16"] = run("encode", str(media), "-o", str(w / "out16"), "--dtype", "bfloat16",
                            "--out-dtype", "bfloat16", *common)
    times["export32"] = run("export", str(w / "out32"), str(w / "export32"), "--to", "vllm", "--dtype", "float32",
                            "--overwrite")

    rows = {}  # the latest row of each file, as the manifest has it
    for line in (w / "out32" / "manifest.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[Path(row["path"]).name] = row
    import av

    clip = rows["clip.mp4"]
    with av.open(str(media / "clip.mp4")) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    (w / "frames").mkdir(exist_ok=True)
    np.save(w / "frames" / "clip.mp4.npy", np.stack([frames[i] for i in clip["frame_indices"]]))
    plan = {"ckpt": str(ckpt), "media": str(media), "rows": rows, "times_s": times}
    (w / "plan.json").write_text(json.dumps(plan, indent=2))
    print(f"vllm prepare: {w} ({', '.join(f'{k} {v} s' for k, v in times.items())})")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
