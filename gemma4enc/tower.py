"""The Gemma 4 vision tower, decomposed: patch_embedder → encoder → pooler → standardize → embed_vision.

Every step calls the transformers modules themselves; what we add is the batching around
them: a *stack* of items with the same patch count (no padding, no mask), or a *pack* of
items of any size in one sequence with attention kept inside each item (varlen), pooled in
one vectorised step. `Tower.encode(items) -> per-item soft tokens` is the whole interface.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .patches import POOL, Patches

ATTENTION = "gemma4enc_varlen"

# the processor computes float64(u8) * (1/255) then rounds to float32: a table keeps that exact
_UNIT = (torch.arange(256, dtype=torch.float64) * (1 / 255)).to(torch.float32)


def _segment_sdpa(q, k, v, segments, scale, gqa):
    """Attention per item, one SDPA call each. q, k, v: (heads, N, head_dim) → (N, heads, head_dim)."""
    out = torch.empty((q.shape[1], q.shape[0], q.shape[2]), dtype=q.dtype, device=q.device)  # (N, heads, hd)
    for start, end in segments:
        piece = F.scaled_dot_product_attention(
            q[:, start:end].unsqueeze(0), k[:, start:end].unsqueeze(0), v[:, start:end].unsqueeze(0),
            scale=scale, enable_gqa=gqa,
        )  # (1, heads, n, hd)
        out[start:end] = piece[0].transpose(0, 1)
    return out


def _flash_varlen(q, k, v, cu, max_len, scale):
    """A CUDA varlen kernel: flash-attn if installed, else PyTorch's own. (N, heads, head_dim) in and out."""
    try:
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, softmax_scale=scale)
    except ImportError:
        from torch.nn.attention.varlen import varlen_attn

        return call_varlen(varlen_attn, q, k, v, cu, max_len, scale)


def call_varlen(varlen_attn, q, k, v, cu, max_len, scale):
    """PyTorch's varlen_attn across its releases: `scale=` and `enable_gqa=` came in later
    ones. Without `scale`, q is pre-multiplied so that the kernel's 1/sqrt(d) gives `scale`;
    without `enable_gqa`, the key/value heads are repeated as transformers' repeat_kv does."""
    params = inspect.signature(varlen_attn).parameters
    kwargs = {}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if "scale" in params:
        kwargs["scale"] = scale
    else:
        q = q * (scale * q.shape[-1] ** 0.5)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


def _reason(e: Exception) -> str:
    """An exception in one short line for a warning (compiler and kernel errors run long)."""
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


_VARLEN_BROKEN: set[str] = set()  # devices where the varlen kernel failed once: use the loop


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: SDPA, or block-diagonal attention when given `segments`.

    query/key/value: (1, heads, N, head_dim); returns (1, N, heads, head_dim) as every
    transformers attention function does.
    """
    segments = kwargs.pop("segments", None)
    if segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    cu, max_len = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    q, k, v = query[0], key[0], value[0]  # (heads, N, head_dim)
    gqa = q.shape[0] != k.shape[0]
    device = str(q.device)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and device not in _VARLEN_BROKEN:
        try:
            out = _flash_varlen(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), cu, max_len, scaling)
            return out.unsqueeze(0), None
        except (RuntimeError, ImportError, NotImplementedError, TypeError) as e:
            _VARLEN_BROKEN.add(device)  # e.g. an old GPU without flash kernels, an old torch
            warnings.warn(f"varlen attention failed on {device} ({_reason(e)}); packs use one SDPA call per item")
    return _segment_sdpa(q, k, v, segments, scaling, gqa).unsqueeze(0), None


AttentionInterface.register(ATTENTION, varlen_attention)


def _clipped_forward(module, in_lo: float, in_hi: float, out_lo: float, out_hi: float):
    clip_in = in_lo > -float("inf") or in_hi < float("inf")
    clip_out = out_lo > -float("inf") or out_hi < float("inf")
    linear, stock = module.linear, type(module).forward.__get__(module)

    def forward(h: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # traced (--compile): transformers' forward, whose bounds are buffers, i.e. graph
            # inputs; float bounds would be constants, and every layer would need its own graph
            return stock(h)
        if clip_in:
            h = torch.clamp(h, in_lo, in_hi)  # not in place: h is also the residual
        h = linear(h)
        return h.clamp_(out_lo, out_hi) if clip_out else h  # h is the linear's own fresh output

    return forward


class ScalarClips:
    """Gemma4ClippableLinear clamps with 0-dim tensor bounds, a slow path in torch: on the CPU
    a clamp with tensor bounds is several times slower than with float bounds or in place, and
    the clamps were a visible share of the tower's CPU time (docs/benchmarks.md). The same values with the bounds read
    once as Python floats (exact: they are the buffers' own values). `stock()` puts the
    transformers forward back (the benchmark's hf-padded baseline runs the stock modules)."""

    def __init__(self, vision):
        self.modules = [m for m in vision.modules() if getattr(m, "use_clipped_linears", False)
                        and hasattr(m, "input_min")]
        for m in self.modules:
            bounds = (float(m.input_min), float(m.input_max), float(m.output_min), float(m.output_max))
            m.forward = _clipped_forward(m, *bounds)

    @contextlib.contextmanager
    def stock(self):
        fast = [m.__dict__.pop("forward") for m in self.modules]
        try:
            yield
        finally:
            for m, forward in zip(self.modules, fast):
                m.forward = forward


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
        self.config = vision.config
        self.config._attn_implementation = ATTENTION
        self.hidden = self.config.hidden_size  # D, the tower's width
        self.out_dim = embed.embedding_projection.out_features  # T, the language model's width
        self._unit = _UNIT.to(device)
        self._root = self.hidden**0.5
        self.clips = ScalarClips(vision)
        self._compiled = None  # the encoder's layers through torch.compile, for stacks (see compile())

    def compile(self) -> "Tower":
        """--compile: same-size stacks (serial, bucket) go through torch.compile'd layers. The
        layers are alike, so one graph serves all of them and every patch count (dynamic shapes):
        seconds of compiling, small beside a long run. On a CPU with AMX it fuses the bfloat16
        elementwise steps, a large share of the time there (figures in docs/benchmarks.md).
        Packs stay eager: their per-item attention would be a graph break in every layer."""
        self._compiled = [torch.compile(layer, dynamic=True) for layer in self.vision.encoder.layers]
        return self

    # ---- the five stages -------------------------------------------------------------------

    def embed_patches(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(..., n, 768) uint8 + (..., n, 2) → (..., n, D): scaled on the device, no padding rows."""
        values = self._unit[pixels.long()]  # (..., n, 768) float32 in [0, 1]
        no_padding = torch.zeros(positions.shape[:-1], dtype=torch.bool, device=positions.device)
        return self.vision.patch_embedder(values, positions, no_padding)

    def encode_stack(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, n, D) → (B, n, D): same-length items, no mask needed."""
        if self._compiled is not None:
            try:
                return self._compiled_stack(x, positions)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # no C++ compiler, an unsupported op…: the eager path is the reference anyway
                self._compiled = None
                warnings.warn(f"--compile failed ({_reason(e)}); going on without it")
        return self.vision.encoder(inputs_embeds=x, attention_mask=None, pixel_position_ids=positions).last_hidden_state

    def _compiled_stack(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What Gemma4VisionEncoder.forward does without a mask, through the compiled layers."""
        rope = self.vision.encoder.rotary_emb(x, positions)
        for layer in self._compiled:
            x = layer(x, attention_mask=None, position_embeddings=rope, position_ids=positions)
        return x

    def encode_packed(self, x: torch.Tensor, positions: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """(1, N, D) → (1, N, D): items concatenated, attention restricted to each item."""
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        segments = list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
        cu = torch.tensor(bounds, dtype=torch.int32, device=x.device)
        return self.vision.encoder(
            inputs_embeds=x, attention_mask=None, pixel_position_ids=positions,
            segments=segments, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
            max_length_q=max(lengths), max_length_k=max(lengths),
        ).last_hidden_state

    def pool_stack(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, n, D) → (B·n/9, D) float32 with transformers' own pooler (per row, as it does)."""
        b, n, _ = h.shape
        no_padding = torch.zeros((b, n), dtype=torch.bool, device=h.device)
        pooled, _ = self.vision.pooler(h, positions, no_padding, output_length=n // (POOL * POOL))
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

