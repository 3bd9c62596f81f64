"""The Gemma 4 vision tower, decomposed: patch_embedder → encoder → pooler → standardize → embed_vision.

Every step calls the modules of vision.py (transformers' arithmetic, op for op); what we add
is the batching around them: a *stack* of items with the same patch count (no padding, no
mask), or a *pack* of items of any size in one sequence with attention kept inside each item
(attention.py), pooled in one vectorised step. `Tower.encode(items) -> per-item soft tokens`
is the whole interface.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import one_line
from ..media.patches import DIVIDE, POOL, Patches

# uint8 → float32 as the processors compute it, a table keeps it exact: rows 0-255 for DIVIDE
# (x / 255 correctly rounded: the PIL processor's float64 product rounded, the torchvision video
# processor's float32 division), rows 256-511 for MULTIPLY (the torchvision image processor's
# x · float32(1/255)); media/patches.py says which processor is which
_UNIT = torch.cat(
    [
        (torch.arange(256, dtype=torch.float64) * (1 / 255)).to(torch.float32),
        torch.arange(256, dtype=torch.uint8) * (1 / 255),  # uint8 · Python float: float32 arithmetic
    ]
)


@dataclass(frozen=True)
class Batch:
    """Items on their way to the device, concatenated: (Σ n_i, 768) pixels, (Σ n_i, 2) positions."""

    items: list[Patches]

    @property
    def lengths(self) -> list[int]:
        return [p.n for p in self.items]


class Tower:
    """The vision tower and projection of one checkpoint on one device."""

    attention = True  # items are kept apart by the batching (stacks or per-item attention in packs)

    def __init__(self, vision, embed, device: torch.device, dtype: torch.dtype, checkpoint=None):
        self.vision, self.embed = vision, embed
        self.checkpoint = checkpoint  # model.Checkpoint it came from (name, revision), if any
        self.device, self.dtype = device, dtype
        self.config = vision.config  # vision.VisionConfig
        self.hidden = self.config.hidden_size  # D, the tower's width
        self.out_dim = embed.embedding_projection.out_features  # T, the language model's width
        self._unit = _UNIT.to(device)
        self._root = self.hidden**0.5
        self._compiled = None  # the encoder's layers through torch.compile, for stacks (see compile())

    def compile(self) -> "Tower":
        """--compile: same-size stacks (serial, bucket) go through torch.compile'd layers. The
        layers are alike, so one graph serves all of them and every patch count (dynamic shapes):
        seconds of compiling, small beside a long run. On a CPU with AMX it fuses the bfloat16
        elementwise steps, a large share of the time there (figures in docs/benchmarks/tower.md).
        Packs stay eager: their per-item attention would be a graph break in every layer."""
        self._compiled = [torch.compile(layer, dynamic=True) for layer in self.vision.encoder.layers]
        return self

    # ---- the five stages -------------------------------------------------------------------

    def embed_patches(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(..., n, 768) uint8 (int16 with MULTIPLY rows) + (..., n, 2) → (..., n, D): scaled on the
        device, no padding rows."""
        values = self._unit[pixels.long()]  # (..., n, 768) float32 in [0, 1]
        return self.vision.patch_embedder(values, positions)

    def encode_stack(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, n, D) → (B, n, D): same-length items, no mask needed."""
        if self._compiled is not None:
            try:
                return self._compiled_stack(x, positions)
            except torch.OutOfMemoryError:
                raise
            except (
                Exception
            ) as e:  # no C++ compiler, an unsupported op…: the eager path is the reference anyway
                self._compiled = None
                warnings.warn(f"--compile failed ({one_line(e)}); going on without it")
        return self.vision.encoder(x, positions)

    def _compiled_stack(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What the encoder's forward does, through the compiled layers."""
        cos, sin = self.vision.encoder.rotary_emb(positions, x.dtype)
        for layer in self._compiled:
            x = layer(x, cos, sin)
        return x

    def encode_packed(
        self, x: torch.Tensor, positions: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        """(1, N, D) → (1, N, D): items concatenated, attention restricted to each item."""
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        segments = list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
        cu = torch.tensor(bounds, dtype=torch.int32, device=x.device)
        return self.vision.encoder(x, positions, segments=(segments, cu, max(lengths)))

    def pool_stack(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, n, D) → (B·n/9, D) float32 with the pooler's own arithmetic (per row, as it does)."""
        pooled = self.vision.pool(h, positions, h.shape[1] // (POOL * POOL))
        return pooled.reshape(-1, pooled.shape[-1])  # (B * n/9, D)

    def pool_packed(self, h: torch.Tensor, slots: torch.Tensor, n_slots: int) -> torch.Tensor:
        """(N, D) → (n_slots, D) float32: every item's k×k average in one scatter-add.

        Same arithmetic as transformers' pooler (each patch × 1/k² in float32, summed, rounded
        back to the working dtype, then × sqrt(D) in float32); only the summation order differs.
        """
        weighted = h.float() * (1.0 / (POOL * POOL))  # (N, D)
        pooled = torch.zeros((n_slots, h.shape[-1]), dtype=torch.float32, device=h.device)
        pooled.index_add_(0, slots, weighted)  # (n_slots, D)
        return pooled.to(h.dtype).float() * self._root

    def standardize(self, pooled: torch.Tensor) -> torch.Tensor:
        """float32 (S, D) → working dtype, with std_bias/std_scale where the checkpoint has them."""
        if self.config.standardize:
            pooled = (pooled - self.vision.std_bias.float()) * self.vision.std_scale.float()
        return pooled.to(self.dtype)

    def project(self, soft: torch.Tensor) -> torch.Tensor:
        """(S, D) → (S, T): embed_vision once over every soft token of a batch."""
        return self.embed(soft)

    # ---- batches ---------------------------------------------------------------------------

    def _to_device(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        pixels = torch.from_numpy(np.concatenate([p.pixels for p in batch.items]))  # (N, 768) uint8
        if any(p.unit != DIVIDE for p in batch.items):  # index the table's MULTIPLY rows for those items
            units = np.repeat([256 * p.unit for p in batch.items], batch.lengths).astype(np.int16)
            pixels = pixels.to(torch.int16) + torch.from_numpy(units)[:, None]
        positions = torch.from_numpy(np.concatenate([p.positions for p in batch.items]))  # (N, 2)
        if self.device.type == "cuda":
            pixels, positions = pixels.pin_memory(), positions.pin_memory()
        return (pixels.to(self.device, non_blocking=True), positions.to(self.device, non_blocking=True))

    @torch.inference_mode()
    def encode(self, items: list[Patches], pack: bool = False) -> list[torch.Tensor]:
        """Soft tokens per item, (n_i/9, T) each. Without `pack` all items must share n."""
        batch = Batch(items)
        pixels, positions = self._to_device(batch)
        if pack:
            pooled = self._pooled_packed(batch, pixels, positions)
        else:
            pooled = self._pooled_stack(batch, pixels, positions)
        tokens = self.project(self.standardize(pooled))  # (Σ n_i/9, T)
        return list(torch.split(tokens, [n // (POOL * POOL) for n in batch.lengths]))

    def _pooled_stack(self, batch: Batch, pixels, positions) -> torch.Tensor:
        lengths = set(batch.lengths)
        if len(lengths) != 1:
            raise ValueError(f"a stacked batch needs one patch count, got {sorted(lengths)}")
        b, n = len(batch.items), lengths.pop()
        pixels, positions = pixels.view(b, n, -1), positions.view(b, n, 2)  # (B, n, 768), (B, n, 2)
        h = self.encode_stack(self.embed_patches(pixels, positions), positions)  # (B, n, D)
        return self.pool_stack(h, positions)

    def _pooled_packed(self, batch: Batch, pixels, positions) -> torch.Tensor:
        slots, n_slots = pool_slots(batch.items)
        x = self.embed_patches(pixels, positions).unsqueeze(0)  # (1, N, D)
        h = self.encode_packed(x, positions.unsqueeze(0), batch.lengths)[0]  # (N, D)
        return self.pool_packed(h, slots.to(self.device, non_blocking=True), n_slots)


def pool_slots(items: list[Patches]) -> tuple[torch.Tensor, int]:
    """For each patch of a pack, the soft-token row it averages into (row-major per item)."""
    slots, offset = [], 0
    for p in items:
        x, y = p.positions[:, 0], p.positions[:, 1]
        width = (int(x.max()) + 1) // POOL  # pooled grid width of this item
        slots.append(offset + x // POOL + width * (y // POOL))
        offset += p.soft_tokens
    return torch.from_numpy(np.concatenate(slots)), offset
