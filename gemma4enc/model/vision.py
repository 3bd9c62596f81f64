"""The Gemma 4 vision tower and its projection (`embed_vision`) in plain torch.

The same modules, tensor names and arithmetic as transformers' Gemma4VisionModel and
Gemma4MultimodalEmbedder, op for op: tests/test_vision.py holds every output bit-equal to
theirs, in float32 and bfloat16. We keep our own copy so that encoding needs no `import
transformers`: that import (and its config classes) is most of a short run's start-up, and
the tower is all a run needs of it (docs/benchmarks/photos.md). What differs is only what our
batching needs (no padding: our calls carry none; attention over a whole stack or kept inside
each item of a pack, `segments`), clip bounds read once as Python floats, and a few steps done
in place on tensors the step itself made (the same arithmetic, fewer large temporaries).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError
from .attention import packed_attention

# hidden_activation → the function transformers' ACT2FN gives for it, in place (on the gate's own output)
ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
    "gelu": lambda x: torch.ops.aten.gelu_(x),
}
BOUNDS = ("input_min", "input_max", "output_min", "output_max")


@dataclass(frozen=True)
class VisionConfig:
    """config.json's `vision_config`, with Gemma4VisionConfig's defaults for what it leaves out."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    pooling_kernel_size: int = 3
    patch_size: int = 16
    position_embedding_size: int = 10 * 1024
    use_clipped_linears: bool = False
    standardize: bool = False
    rope_theta: float = 100.0  # rope_parameters["rope_theta"]; the rope type is always axial
    output_proj_dims: int | None = None  # embed_vision's input width, where a config sets one

    @classmethod
    def from_dict(cls, raw: dict, name: str = "config.json") -> "VisionConfig":
        values = {f.name: raw[f.name] for f in fields(cls) if raw.get(f.name) is not None}
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") not in (
            "axial",
            "default",
        ):  # released configs say "default": axial
            raise UsageError(
                f"{name}: vision rope_type {rope['rope_type']!r}; Gemma 4's vision tower uses axial rope"
            )
        values["rope_theta"] = rope.get("rope_theta", raw.get("rope_theta", cls.rope_theta))
        config = cls(**values)
        if config.hidden_activation not in ACTIVATIONS:
            raise UsageError(
                f"{name}: vision hidden_activation {config.hidden_activation!r} is not one Gemma 4 uses "
                f"({', '.join(ACTIVATIONS)})"
            )
        if config.head_dim % 4:
            raise UsageError(
                f"{name}: vision head_dim {config.head_dim} is not a multiple of 4 (2-D rope halves it twice)"
            )
        return config


class TextConfig:
    """The one thing read of `text_config`: the language model's width, what embed_vision projects to."""

    def __init__(self, raw: dict):
        self.hidden_size = raw.get("hidden_size", 2304)  # Gemma4TextConfig's default


class Config:
    """A gemma4 checkpoint's config.json as gemma4enc reads it: attribute access like transformers'
    config (`vision_config`, `text_config`, `model_type`, and any top-level key such as
    `quantization_config`), without importing transformers."""

    def __init__(self, raw: dict, name: str = "config.json"):
        self.raw = raw
        self.model_type = raw["model_type"]
        self.vision_config = VisionConfig.from_dict(raw["vision_config"], name)
        self.text_config = TextConfig(raw.get("text_config") or {})

    def __getattr__(self, key: str):
        try:
            return self.__dict__["raw"][key]
        except KeyError:
            raise AttributeError(key) from None


# ---- the modules, named as transformers names them (the checkpoint's tensor names) -------------


class ClippableLinear(nn.Module):
    """A bias-free Linear whose input and output are clamped to bounds the checkpoint holds."""

    def __init__(self, config: VisionConfig, fan_in: int, fan_out: int):
        super().__init__()
        self.linear = nn.Linear(fan_in, fan_out, bias=False)
        self.clipped = config.use_clipped_linears
        if self.clipped:
            for name, value in zip(BOUNDS, (-math.inf, math.inf, -math.inf, math.inf)):
                self.register_buffer(name, torch.tensor(value))
        self.bounds: tuple[float, ...] | None = None

    def read_bounds(self) -> None:
        """The bounds as Python floats, read once after loading and casting (the buffers' own values):
        on the CPU a clamp with 0-dim tensor bounds is several times slower (docs/benchmarks/tower.md)."""
        if self.clipped:
            self.bounds = tuple(float(getattr(self, name)) for name in BOUNDS)

    def forward(self, h: torch.Tensor, own_input: bool = False) -> torch.Tensor:
        """own_input: h is a temporary nobody else reads, so its input clamp may be in place."""
        if not self.clipped:
            return self.linear(h)
        if (
            torch.compiler.is_compiling() or self.bounds is None
        ):  # compiling first: no guard on the floats
            # traced (--compile): tensor bounds are graph inputs, so one graph serves every layer
            h = torch.clamp(h, self.input_min, self.input_max)
            return torch.clamp(self.linear(h), self.output_min, self.output_max)
        lo, hi, out_lo, out_hi = self.bounds
        if lo > -math.inf or hi < math.inf:
            # else not in place: h is also the residual or another projection's input
            h = h.clamp_(lo, hi) if own_input else torch.clamp(h, lo, hi)
        h = self.linear(h)
        return h.clamp_(out_lo, out_hi) if out_lo > -math.inf or out_hi < math.inf else h


class RMSNorm(nn.Module):
    """Gemma4RMSNorm: in float32, x · (mean(x²) + eps)^-0.5 (a pow, as transformers has it), × weight."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.float()
        x = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            x.mul_(self.weight.float())  # in place: x is the product just made, this norm's own
        return x.type_as(h)


class PatchEmbedder(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.input_proj = nn.Linear(3 * config.patch_size**2, config.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(
            torch.ones(2, config.position_embedding_size, config.hidden_size)
        )

    def forward(self, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(..., n, 768) float32 in [0, 1] + (..., n, 2) (x, y) → (..., n, D): x and y embeddings added."""
        values = 2 * (values - 0.5)
        if self.input_proj.weight.dtype.is_floating_point:
            values = values.to(self.input_proj.weight.dtype)
        table = self.position_embedding_table
        position = F.embedding(positions[..., 0], table[0]) + F.embedding(positions[..., 1], table[1])
        return self.input_proj(values) + position


class Rotary(nn.Module):
    """Axial 2-D rope: the same frequencies for x and y over head_dim/2 channels each."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        spatial = config.head_dim // 2
        # float32, computed on the CPU as transformers does, in every dtype and on every device: a
        # plain attribute, not a buffer, so that casting the tower leaves it alone
        steps = torch.arange(0, spatial, 2, dtype=torch.float, device="cpu") / spatial
        self.inv_freq = 1.0 / (config.rope_theta**steps)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, n, 2) → cos, sin of (B, n, head_dim), laid out x, x, y, y as transformers recomposes them."""
        freqs = positions[..., None].float() * self.inv_freq.to(
            positions.device
        )  # (B, n, 2, head_dim/4)

        def recompose(f):
            return torch.cat([f[:, :, 0], f[:, :, 0], f[:, :, 1], f[:, :, 1]], dim=-1).to(dtype)

        return recompose(freqs.cos()), recompose(freqs.sin())


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(B, n, heads, hd): apply_multidimensional_rope in one pass. Its two halves (x's channels, y's)
    are each rotated within themselves, so the rotation of the whole is the four quarters as
    (-x2, x1, -y2, y1), and every element sees the same multiply-add as in transformers."""
    x1, x2, y1, y2 = x.chunk(4, dim=-1)
    turned = torch.cat((-x2, x1, -y2, y1), dim=-1)
    return (x * cos.unsqueeze(2)) + (turned * sin.unsqueeze(2))


class Attention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        heads, kv, hd, d = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.hidden_size,
        )
        self.head_dim, self.gqa = hd, kv != heads
        self.q_proj = ClippableLinear(config, d, heads * hd)
        self.k_proj = ClippableLinear(config, d, kv * hd)
        self.v_proj = ClippableLinear(config, d, kv * hd)
        self.o_proj = ClippableLinear(config, heads * hd, d)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.v_norm = RMSNorm(hd, config.rms_norm_eps, with_scale=False)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments=None
    ) -> torch.Tensor:
        shape = (*h.shape[:-1], -1, self.head_dim)  # (B, n, heads, hd)
        q = rope(self.q_norm(self.q_proj(h).view(shape)), cos, sin).transpose(1, 2)
        k = rope(self.k_norm(self.k_proj(h).view(shape)), cos, sin).transpose(1, 2)
        v = self.v_norm(self.v_proj(h).view(shape)).transpose(1, 2)  # (B, heads, n, hd)
        if segments is None:
            # scale 1: q and k are RMS-normed; no mask: a stack carries no padding
            out = (
                F.scaled_dot_product_attention(q, k, v, scale=1.0, enable_gqa=self.gqa)
                .transpose(1, 2)
                .contiguous()
            )
        else:
            out = packed_attention(q[0], k[0], v[0], *segments, self.gqa).unsqueeze(0)
        return self.o_proj(out.reshape(*h.shape[:-1], -1))


class MLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        d, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = ClippableLinear(config, d, inner)
        self.up_proj = ClippableLinear(config, d, inner)
        self.down_proj = ClippableLinear(config, inner, d)
        self.act = ACTIVATIONS[config.hidden_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the gate's output is fresh: the activation and the product go into it, and down_proj may clamp it in place
        return self.down_proj(self.act(self.gate_proj(x)).mul_(self.up_proj(x)), own_input=True)


class EncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments=None
    ) -> torch.Tensor:
        h = h + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(h), cos, sin, segments)
        )
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Encoder(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.rotary_emb = Rotary(config)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, h: torch.Tensor, positions: torch.Tensor, segments=None) -> torch.Tensor:
        """(B, n, D) + (B, n, 2) → (B, n, D); `segments` (a pack, B = 1): attention inside each item."""
        cos, sin = self.rotary_emb(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, segments)
        return h


class VisionModel(nn.Module):
    """The tower (`vision_tower.*`): patch embedder, encoder, the pooler's arithmetic, std buffers."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embedder = PatchEmbedder(config)
        self.encoder = Encoder(config)
        if config.standardize:
            self.register_buffer("std_bias", torch.empty(config.hidden_size))
            self.register_buffer("std_scale", torch.empty(config.hidden_size))

    def pool(self, h: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
        """(B, n, D) → (B, length, D) float32: Gemma4VisionPooler without padding: each k×k block of
        patches averaged (a one-hot matmul in float32, as transformers does it), rounded back to
        the working dtype, then × sqrt(D) in float32."""
        k = int((h.shape[1] // length) ** 0.5)
        width = positions[..., 0].max(dim=-1, keepdim=True)[0] + 1
        cell = torch.div(positions, k, rounding_mode="floor")
        cell = cell[..., 0] + (width // k) * cell[..., 1]
        weights = F.one_hot(cell.long(), length).float() / (k * k)  # (B, n, length)
        pooled = (weights.transpose(1, 2) @ h.float()).to(h.dtype)
        return pooled.float() * self.config.hidden_size**0.5

    def place(self, device: torch.device, dtype: torch.dtype) -> "VisionModel":
        """To the device and dtype, inference only, with the clip bounds read as floats."""
        placed = self.to(device=device, dtype=dtype).eval().requires_grad_(False)
        for m in placed.modules():
            if isinstance(m, ClippableLinear):
                m.read_bounds()
        return placed


class Embedder(nn.Module):
    """`embed_vision.*`: RMS-normed (no scale) soft tokens projected to the language model's width."""

    def __init__(self, config: VisionConfig, text_hidden: int):
        super().__init__()
        width = config.output_proj_dims or config.hidden_size
        self.embedding_projection = nn.Linear(width, text_hidden, bias=False)
        self.embedding_pre_projection_norm = RMSNorm(width, config.rms_norm_eps, with_scale=False)

    def forward(self, soft: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(soft))
