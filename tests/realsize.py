"""Random checkpoints at each released size: the vision part in the exact vision config, the
language model minimal (1 layer, 8-token vocab) but at the real text width, because
embed_vision projects to it. bf16 like the releases, in their file layout: one
`model.safetensors` for E2B/E4B; two shards and an index for 26B-A4B/31B, the vision tensors in
shard 1 (the convert script's sorted order).

Names and shapes come from transformers' Gemma4ForConditionalGeneration built on the meta
device; each tensor is drawn, cast and written on its own (no model in float32 in memory:
31B's vision part is 1.1 GB in bf16).

The configs are those of transformers' convert script (`_ON_DEVICE_VISION_CONFIG`,
`_LARGE_MODEL_VISION_CONFIG`) and the published config.json files, collected in
shared research checkpoints.md; the text widths 1536/2560/2816/5376.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from gemma4enc.dev.demo import random_tensor

ON_DEVICE = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                 num_key_value_heads=12, head_dim=64, use_clipped_linears=True, standardize=False)
LARGE = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
             num_key_value_heads=16, head_dim=72, use_clipped_linears=False, standardize=True)
# every released size: (vision config, text width, files)
RELEASED = {
    "E2B": (ON_DEVICE, 1536, 1),
    "E4B": (ON_DEVICE, 2560, 1),
    "26B-A4B": (LARGE, 2816, 2),
    "31B": (LARGE, 5376, 2),
}
# what every released vision config.json also says (json-only keys included)
COMMON = dict(patch_size=16, pooling_kernel_size=3, position_embedding_size=10240,
              rope_parameters={"rope_type": "default", "rope_theta": 100.0}, default_output_length=280)


def config(size: str):
    from transformers import Gemma4Config
    from transformers.models.gemma4.configuration_gemma4 import (
        Gemma4TextConfig,
        Gemma4VisionConfig,
    )

    vision, width, _ = RELEASED[size]
    vcfg = Gemma4VisionConfig(**vision, **COMMON, global_head_dim=vision["head_dim"])
    tcfg = Gemma4TextConfig(hidden_size=width, num_hidden_layers=1, vocab_size=8, vocab_size_per_layer_input=8,
                            intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            global_head_dim=16, hidden_size_per_layer_input=8 if size.startswith("E") else 0,
                            layer_types=["full_attention"])
    return Gemma4Config(text_config=tcfg.to_dict(), vision_config=vcfg.to_dict(), audio_config=None, dtype="bfloat16")


def vision_params(size: str) -> int:
    """The vision tower's and embed_vision's values (parameters and persistent buffers), from the
    config by formula: per layer q/k/v/o and the 3 MLP matrices, q/k norms, 4 layer norms, 4 clip
    scalars per linear when clipped; the patch projection (3·16² in), the 2-axis position table,
    std_bias/std_scale when standardizing; embed_vision is one D × text matrix (its norm has no weight)."""
    v, width, _ = RELEASED[size]
    d, hd, inner = v["hidden_size"], v["head_dim"], v["intermediate_size"]
    attn = d * v["num_attention_heads"] * hd * 2 + d * v["num_key_value_heads"] * hd * 2
    layer = attn + 3 * d * inner + 2 * hd + 4 * d + (7 * 4 if v["use_clipped_linears"] else 0)
    tower = v["num_hidden_layers"] * layer + 3 * 16 * 16 * d + 2 * 10240 * d + (2 * d if v["standardize"] else 0)
    return tower + d * width


def build(folder: Path, size: str, seed: int = 0) -> dict[str, dict]:
    """Write the checkpoint; return {tensor name: {"shape", "file"}} as written."""
    from transformers import Gemma4ForConditionalGeneration

    folder.mkdir(parents=True, exist_ok=True)
    cfg = config(size)
    with torch.device("meta"):
        model = Gemma4ForConditionalGeneration(cfg)
    shapes = {k: tuple(t.shape) for k, t in model.state_dict().items() if k != "lm_head.weight"}  # tied
    vision = sorted(k for k in shapes if k.startswith(("model.vision_tower.", "model.embed_vision.")))
    rest = sorted(set(shapes) - set(vision))
    files = ({"model.safetensors": vision + rest} if RELEASED[size][2] == 1 else
             {"model-00001-of-00002.safetensors": vision, "model-00002-of-00002.safetensors": rest})
    g = torch.Generator().manual_seed(seed)
    written = {}
    for file, keys in files.items():
        write_safetensors(folder / file, [(k, shapes[k]) for k in keys], g, RELEASED[size][0]["head_dim"])
        written.update({k: {"shape": shapes[k], "file": file} for k in keys})
    if len(files) > 1:
        total = sum(2 * torch.Size(s).numel() for s in shapes.values())
        index = {"metadata": {"total_size": total}, "weight_map": {k: w["file"] for k, w in sorted(written.items())}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg.save_pretrained(folder)
    return written


def write_safetensors(path: Path, tensors: list[tuple[str, tuple]], g: torch.Generator, head_dim: int) -> None:
    """A bf16 safetensors file written one random tensor at a time: the header (names, shapes,
    offsets) first, then each tensor's bytes as soon as it is drawn.

    The vision q/k norm weights are scaled by head_dim^-1/4: Gemma 4's vision attention has no
    1/sqrt(head_dim) (the norms stand in), so with unit norms random logits would have a std of
    sqrt(head_dim) = 8, a saturated softmax that amplifies float32 rounding ~100× over 16 layers
    (the float32 reference itself was 1.8e-2 off float64). Trained towers do not work there."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        size = 2 * torch.Size(shape).numel()
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in tensors:
            value = random_tensor(name.split("model.", 1)[-1], shape, g)
            if "vision_tower" in name and name.endswith(("q_norm.weight", "k_norm.weight")):
                value = value * head_dim**-0.25
            value = value.to(torch.bfloat16)
            f.write(value.view(torch.int16).numpy().tobytes())
