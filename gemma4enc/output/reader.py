"""Read an output folder as torch tensors: `gemma4enc.open(OUT)`. Only the manifest is read up front
(npreader.Rows); each lookup opens one shard and slices its rows."""

from __future__ import annotations


import torch
from safetensors import safe_open

from ..rows import Row
from .npreader import Rows
from .out import Out


class Embeddings(Rows):
    """Read an output folder: `emb[path]` → (tokens, D) tensor, `emb.frames(path)` → per frame.

    Only the manifest is read up front; each lookup opens one shard and slices its rows.
    """

    def __init__(self, out: Out):
        self._open(out)

    def __getitem__(self, path) -> torch.Tensor:
        row = self.ok_row(path)
        with safe_open(str(self.out.shard_path(row["shard"])), framework="pt") as f:
            if "tokens" not in f.keys():
                raise KeyError(no_tokens(path, self.out))
            lo, hi = f.get_slice("item_offsets")[_index(row, f) : row["index"] + 2].tolist()
            return f.get_slice("tokens")[lo:hi]

    def frames(self, path) -> list[torch.Tensor]:
        """A video's tokens split per sampled frame (an image: one frame)."""
        row = self.row(path)
        tokens = self[path]
        with safe_open(str(self.out.shard_path(row["shard"])), framework="pt") as f:
            a, b = f.get_slice("item_frames")[_index(row, f) : row["index"] + 2].tolist()
            offsets = f.get_slice("frame_offsets")[a : b + 1]
        return list(torch.split(tokens, (offsets[1:] - offsets[:-1]).tolist()))

    def pooled(self, path) -> torch.Tensor:
        row = self.ok_row(path)
        with safe_open(str(self.out.shard_path(row["shard"])), framework="pt") as f:
            if "pooled" not in f.keys():
                raise KeyError(
                    f"{path}: {row['shard']} holds no pooled tokens (encoded with --no-pooled)"
                )
            return f.get_slice("pooled")[_index(row, f) : row["index"] + 1][0]

    def mm_encoder_outputs(self, paths, device=None, dtype=None, model=None):
        """What Gemma 4's `generate` takes in place of pixels, and what its prompt needs (gemma.py)."""
        from .gemma import model_inputs

        return model_inputs(self, paths, device, dtype, model)

    def pooled_matrix(self, per_frame: bool = False):
        """(paths, (N, D) float32 array) of every file's latest pooled vector (retrieval.py)."""
        from .retrieval import pooled_matrix

        return pooled_matrix(self, per_frame)


def no_tokens(path, out) -> str:
    return (
        f"{path}: {out} was encoded with --store pooled: it keeps the pooled vectors (pooled, "
        "pooled_matrix), not the tokens"
    )


def _index(row: Row, f) -> int:
    """The row's index, checked against its shard (0 <= index < items): a wrong one is refused in
    one line, never read as another file's tokens (a negative index would count from the end)."""
    i, items = row["index"], f.get_slice("item_offsets").get_shape()[0] - 1
    if not (type(i) is int and 0 <= i < items):
        from ..errors import UsageError

        raise UsageError(f"{row['path']}: its row's index {i} is not one of the {items} items of {row['shard']}; "
                         "`gemma4enc verify OUT --repair` finds and mends it")
    return i
