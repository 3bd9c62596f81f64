"""gemma4enc: encode folders of images and videos with the Gemma 4 vision tower.

import gemma4enc
emb = gemma4enc.open("embeddings")      # reads only the manifest
tokens = emb["/data/cat.jpg"]           # (soft tokens, hidden) from one shard

with gemma4enc.Encoder(model="path/to/gemma-4") as enc:   # in memory, nothing written
    for row, frames in enc.encode(["cat.jpg"]): ...
"""

from ._version import __version__  # noqa: F401 - the public name


def open(out, framework: str = "pt"):  # noqa: A001 - the reader's natural name, as in safetensors.safe_open
    """An output folder's reader: `emb[path]`, `emb.frames(path)`, `emb.pooled(path)`, `emb.row(path)`,
    `emb.mm_encoder_outputs(paths, model=…)` for Gemma 4, `emb.pooled_matrix()` for search.

    framework="pt": torch tensors in the stored dtype; "numpy": float32 numpy arrays (lookups, frames,
    pooled), no torch needed. `out` may be a URL (s3://…): its manifest is read into a temp folder,
    each shard fetched when first read, all removed when the reader is."""
    from .output.openreader import open_reader

    return open_reader(out, framework)


def __getattr__(name: str):
    """`gemma4enc.Encoder`, imported when first named (the package imports nothing heavy)."""
    if name == "Encoder":
        from .run.encoder import Encoder

        return Encoder
    raise AttributeError(f"module 'gemma4enc' has no attribute {name!r}")
