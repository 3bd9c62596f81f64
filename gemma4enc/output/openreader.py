"""`gemma4enc.open`: OUT opened as a reader, a folder or a store alike (the package root's face)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from ..errors import SAVED, OutputError
from .opening import open_out

if TYPE_CHECKING:
    from .npreader import NumpyEmbeddings
    from .reader import Embeddings


def open_reader(where, framework: str = "pt"):
    """An output folder's reader: `emb[path]`, `emb.frames(path)`, `emb.pooled(path)`, `emb.row(path)`,
    `emb.mm_encoder_outputs(paths, model=…)` for Gemma 4, `emb.pooled_matrix()` for search.

    framework="pt": torch tensors in the stored dtype; "numpy": float32 numpy arrays (lookups, frames,
    pooled), no torch needed. `where` may be a URL (s3://…): its manifest is read into a temp folder,
    each shard fetched when first read, all removed when the reader is."""
    if framework not in ("pt", "numpy"):
        raise ValueError(f"framework {framework!r}: use 'pt' or 'numpy'")
    reader: type[NumpyEmbeddings] | type[Embeddings]
    if framework == "numpy":  # no torch imported: the numpy reader is for where it is not installed
        from .npreader import NumpyEmbeddings

        reader = NumpyEmbeddings
    else:
        from .reader import Embeddings

        reader = Embeddings
    try:
        out = open_out(where)
    except OutputError as e:  # keys, endpoint, a store down: said without a run's advice
        raise OutputError(str(e).removesuffix(SAVED)) from None
    try:
        emb = reader(out)  # FileNotFoundError where OUT holds no manifest
    except BaseException:
        out.close()
        raise
    weakref.finalize(emb, out.close)
    return emb
