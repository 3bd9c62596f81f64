"""The 12B unified model (model_type `gemma4_unified`, google/gemma-4-12B-it): no ViT at all.

Its vision is transformers' `Gemma4UnifiedVisionEmbedder` (the model's `embed_vision`): each
48×48-pixel cell, i.e. 3×3 of our 16-pixel patches, becomes one soft token through
LayerNorm → Linear → LayerNorm → + a 2-D position table → LayerNorm → RMSNorm → Linear.
No attention and no pooling: a token depends on its own cell only, so any set of items can
share one call, with no padding and no mask, and the result per item is the same.

The processor (`Gemma4UnifiedImageProcessor` / `…VideoProcessor`) resizes by Gemma 4's rule
(the same `get_aspect_ratio_preserving_size`, the same budgets) and cuts 16-pixel patches as
`Gemma4ImageProcessorPil` does; it then regroups them by cell (`patches_merge`). So decode
workers make the same `Patches` for every model, and `merge()` here does the regrouping.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import UsageError
from ..media.patches import PATCH, POOL, Patches
from . import layouts

PARTS = layouts.UNIFIED_PARTS
_PROJECTION = (
    "embedding_projection."  # the released name; the module has it inside `multimodal_embedder.`
)


def module_state(ckpt) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under Gemma4UnifiedVisionEmbedder's own names."""
    from .checkpoint import read_tensors

    state = {}
    for part in PARTS:
        for key, tensor in read_tensors(ckpt, part).items():
            state["multimodal_embedder." + key if key.startswith(_PROJECTION) else key] = tensor
    return state


def load_embedder(ckpt, dtype: torch.dtype, device: torch.device):
    """Build the embedder on meta and assign the read tensors, strictly (nothing left at its init)."""
    from transformers.models.gemma4_unified.modeling_gemma4_unified import Gemma4UnifiedVisionEmbedder

    with torch.device("meta"):
        embedder = Gemma4UnifiedVisionEmbedder(ckpt.config.vision_config, ckpt.config.text_config)
    state = module_state(
        ckpt
    )  # quantized names were refused with the checkpoint (layouts.refuse_quantized)
    layouts.refuse_integer(state, ckpt.name, ckpt.config, "vision_embedder.")
    for what, keys in (
        ("missing", embedder.state_dict().keys() - state),
        ("unexpected", state - embedder.state_dict().keys()),
    ):
        if keys:
            raise UsageError(
                f"{ckpt.name}: {what} vision_embedder tensor(s) {layouts.first(sorted(keys))}"
            )
    try:
        embedder.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:  # a shape that does not fit the config
        reason = next((line.strip() for line in str(e).splitlines()[1:] if line.strip()), str(e))
        raise UsageError(
            f"{ckpt.name}: vision_embedder tensors do not match the config: {reason}"
        ) from None
    return embedder.to(device=device, dtype=dtype).eval().requires_grad_(False)


def merge(p: Patches) -> tuple[np.ndarray, np.ndarray]:
    """16-pixel patches → the processor's merged cells: (n/9, 48·48·3) uint8, rows of the
    48×48 cell, channels last; (n/9, 2) int64 cell (x, y); cells row-major (as patches_merge)."""
    pw, ph = int(p.positions[:, 0].max()) + 1, int(p.positions[:, 1].max()) + 1
    if pw % POOL or ph % POOL or p.n != pw * ph:
        raise ValueError(f"patches of a {pw}x{ph} grid do not fill whole {POOL}x{POOL} cells")
    grid = np.empty((ph, pw, PATCH * PATCH * 3), np.uint8)
    grid[p.positions[:, 1], p.positions[:, 0]] = (
        p.pixels
    )  # (ph, pw, 768), whatever order the patches came in
    cells = grid.reshape(
        ph // POOL, POOL, pw // POOL, POOL, PATCH, PATCH, 3
    )  # (cy, ky, cx, kx, p, q, c)
    cells = cells.transpose(
        0, 2, 1, 4, 3, 5, 6
    )  # (cy, cx, ky, p, kx, q, c): a cell's pixel rows, in order
    pixels = np.ascontiguousarray(cells.reshape(-1, (POOL * PATCH) ** 2 * 3))  # (n/9, 6912)
    xs, ys = np.meshgrid(np.arange(pw // POOL), np.arange(ph // POOL), indexing="xy")
    return pixels, np.stack([xs, ys], -1).reshape(-1, 2).astype(np.int64)  # (n/9, 2)


class UnifiedTower:
    """The unified model's vision on one device, behind Tower's interface: encode(items) → tokens."""

    attention = False  # tokens never see each other: every grouping of items is the same computation

    def __init__(self, embedder, device: torch.device, dtype: torch.dtype, checkpoint=None):
        self.embedder, self.checkpoint = embedder, checkpoint
        self.device, self.dtype = device, dtype
        self.hidden = embedder.patch_dense.out_features  # mm_embed_dim
        self.out_dim = (
            embedder.multimodal_embedder.embedding_projection.out_features
        )  # T, the language model's width

    def compile(self) -> "UnifiedTower":
        """--compile changes nothing here: one matmul (6912 → mm_embed_dim) is nearly all the work."""
        return self

    @torch.inference_mode()
    def encode(self, items: list[Patches], pack: bool = False) -> list[torch.Tensor]:
        """Soft tokens per item, (n_i/9, T) each, from one embedder call over every cell (`pack` changes nothing)."""
        merged = [merge(p) for p in items]
        pixels = torch.from_numpy(np.concatenate([m[0] for m in merged]))  # (S, 6912) uint8
        positions = torch.from_numpy(np.concatenate([m[1] for m in merged]))  # (S, 2)
        if self.device.type == "cuda":
            pixels, positions = pixels.pin_memory(), positions.pin_memory()
        pixels = pixels.to(self.device, non_blocking=True)
        positions = positions.to(self.device, non_blocking=True)
        # x / 255 in float32, correctly rounded: the video processor's arithmetic (fused rescale and
        # normalize); the image processor's x · float32(1/255) is 1 ulp off on 126 of the 256 values
        values = pixels.to(torch.float32).div_(255)
        out = self.embedder(values.unsqueeze(0), positions.unsqueeze(0))  # (1, S, 6912) → (1, S, T)
        return list(torch.split(out.pooler_output[0], [p.soft_tokens for p in items]))


def load_tower(ckpt, dtype: torch.dtype, device: torch.device) -> UnifiedTower:
    return UnifiedTower(load_embedder(ckpt, dtype, device), device, dtype, checkpoint=ckpt)
