"""Output folders made of given pooled vectors (no model, no media): for search's index and
duplicate groups at sizes a real encode would take minutes to reach. Shards as encode writes them
(one soft token a file: tokens, pooled, offsets), rows appended to the manifest as a run does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SETTINGS = {"model": "/vectors/ckpt", "dtype": "float32", "image_tokens": 70, "video_tokens": 70,
            "resize": "fast", "sampling": {"frames": 32, "fps": None, "max_frames": 32}, "seek": "exact",
            "out_dtype": "float32", "pooled": True, "revision": None}


def clustered(n: int, dim: int, clusters: int, copies: int = 0, spread: float = 0.5, seed: int = 0):
    """(vectors, pairs): n unit vectors around `clusters` centres, the last `copies` of them near
    copies (cosine ~0.99) of earlier ones; pairs = (original, copy) ids."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, dim)).astype(np.float32)
    base = centres[rng.integers(0, clusters, n)] + spread * rng.standard_normal((n, dim)).astype(np.float32)
    originals = rng.choice(n - copies, copies, replace=False)
    base[n - copies:] = base[originals] + 0.1 * np.linalg.norm(base[originals], axis=1, keepdims=True) * \
        rng.standard_normal((copies, dim)).astype(np.float32) / np.sqrt(dim)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    return base, list(zip(originals.tolist(), range(n - copies, n)))


def path_of(i: int) -> str:
    return f"/vectors/media/d{i // 1000:04d}/v{i:07d}.jpg"


def append_shard(out: Path, vectors: np.ndarray, ids, status: str = "ok") -> None:
    """One shard of `vectors` (rows for files path_of(ids)) and their manifest rows, appended."""
    import torch
    from safetensors.torch import save_file

    from gemma4enc.output.files import MANIFEST, line_of

    out.mkdir(parents=True, exist_ok=True)
    if not (out / "settings.json").exists():
        (out / "settings.json").write_text(json.dumps(SETTINGS))
    number = len(list(out.glob("shard-*.safetensors")))
    name = f"shard-{number:06d}.safetensors"
    values = torch.from_numpy(np.ascontiguousarray(vectors, np.float32))
    k = torch.arange(len(values) + 1)
    save_file({"tokens": values, "item_offsets": k, "frame_offsets": k.clone(), "item_frames": k.clone(),
               "pooled": values.clone()}, str(out / name),
              metadata={"format_version": "1", "out_dtype": "float32", "hidden_size": str(vectors.shape[1])})
    ids = [int(i) for i in ids]
    with open(out / MANIFEST, "ab") as manifest:
        manifest.write(b"".join(line_of({
            "path": path_of(i), "kind": "image", "size": 1000 + i, "mtime_ns": i + number, "status": status,
            "error": None if status == "ok" else "gone", "shard": name if status == "ok" else None,
            "index": j if status == "ok" else None, "tokens": 1, "frames": 1, "frame_tokens": [1],
            "width": 64, "height": 48}) for j, i in enumerate(ids)))
