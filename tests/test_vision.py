"""vision.py against transformers' own modules: the same weights give bit-equal soft tokens.

Our tower (vision.VisionModel + vision.Embedder) is transformers' Gemma4VisionModel and
Gemma4MultimodalEmbedder rewritten op for op so that encoding needs no transformers import.
Tolerance here: none (torch.equal), in float32 and bfloat16, for stacks; packs differ only in
the pooling sum's order (test_tower.py). The config reader is checked against Gemma4VisionConfig.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers.models.gemma4.configuration_gemma4 import (
    Gemma4TextConfig,
    Gemma4VisionConfig,
)
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4MultimodalEmbedder,
    Gemma4VisionModel,
)

from gemma4enc.dev.demo import randomize_
from gemma4enc.errors import UsageError
from gemma4enc.media.patches import patchify
from gemma4enc.model.tower import Tower
from gemma4enc.model.vision import Embedder, VisionConfig, VisionModel

from .realsize import COMMON, RELEASED

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, head_dim=16)
VARIANTS = {
    "clipped": dict(TINY, use_clipped_linears=True),
    "standardize": dict(TINY, standardize=True),
    "gqa, exact gelu, theta": dict(TINY, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                                   hidden_activation="gelu", rope_parameters={"rope_type": "axial", "rope_theta": 37.0}),
    "head_dim 12 (not a power of 2)": dict(TINY, head_dim=12, use_clipped_linears=True, standardize=True),
}


def stock_and_ours(spec: dict, dtype: torch.dtype, seed: int = 0):
    """Random transformers modules, and ours loaded from their state dicts (strictly)."""
    vcfg = Gemma4VisionConfig(**spec)
    vcfg._attn_implementation = "sdpa"
    text = Gemma4TextConfig(hidden_size=24, num_hidden_layers=1, vocab_size=8, vocab_size_per_layer_input=8)
    torch.manual_seed(seed)
    vision, embed = Gemma4VisionModel(vcfg).eval(), Gemma4MultimodalEmbedder(vcfg, text).eval()
    randomize_(vision, seed)
    randomize_(embed, seed + 1)
    config = VisionConfig.from_dict(vcfg.to_dict())
    mine, mine_embed = VisionModel(config), Embedder(config, 24)
    mine.load_state_dict(vision.state_dict(), strict=True)
    mine_embed.load_state_dict(embed.state_dict(), strict=True)
    vision, embed = vision.to(dtype), embed.to(dtype)
    vision.encoder.rotary_emb = type(vision.encoder.rotary_emb)(vcfg)  # float32 inv_freq, as from_pretrained has it
    tower = Tower(mine.place(torch.device("cpu"), dtype), mine_embed.to(dtype).eval(), torch.device("cpu"), dtype)
    return (vision, embed), tower


def theirs(stock, items):
    """Stock transformers on the same unpadded patches (a batch of equal-size items)."""
    vision, embed = stock
    pixels = torch.from_numpy(np.stack([p.pixels for p in items])).double().mul(1 / 255).float()
    positions = torch.from_numpy(np.stack([p.positions for p in items]))
    with torch.inference_mode():
        out = vision(pixel_values=pixels, pixel_position_ids=positions).last_hidden_state
        return list(embed(out).split([p.soft_tokens for p in items]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bit_equal_to_transformers_modules(variant, dtype):
    stock, tower = stock_and_ours(VARIANTS[variant], dtype)
    rng = np.random.default_rng(7)
    shapes = [(90, 120), (64, 200), (150, 150)]
    for h, w in shapes:
        item = patchify(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), 70)
        mine, = tower.encode([item])
        want, = theirs(stock, [item])
        assert mine.dtype == dtype and mine.shape == want.shape
        assert torch.equal(mine, want), (variant, (h, w), (mine.float() - want.float()).abs().max())
    pair = [patchify(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8), 70) for _ in range(2)]
    for mine, want in zip(tower.encode(pair), theirs(stock, pair)):  # a stack of two: one batched call each
        assert torch.equal(mine, want)


def test_clip_bounds_bite_and_the_float_bounds_equal_the_tensor_bounds():
    _, tower = stock_and_ours(VARIANTS["clipped"], torch.float32)
    linears = [m for m in tower.vision.modules() if getattr(m, "clipped", False)]
    assert linears and all(m.bounds[3] < float("inf") for m in linears)  # the random bounds bite
    item = patchify(np.random.default_rng(3).integers(0, 256, (100, 140, 3), dtype=np.uint8), 70)
    fast, = tower.encode([item])
    for m in linears:
        m.bounds = None  # the 0-dim tensor clamps, as transformers (and --compile) run them
    slow, = tower.encode([item])
    assert torch.equal(fast, slow)


def configs() -> list[dict]:
    released = [dict(v, **COMMON) for v, _, _ in RELEASED.values()]  # rope_type "default", as they ship
    return [{}, TINY, {"rope_theta": 50.0}, *VARIANTS.values(), *released]


@pytest.mark.parametrize("raw", configs())
def test_config_reads_what_transformers_reads(raw):
    mine = VisionConfig.from_dict(json.loads(json.dumps(raw)))
    ref = Gemma4VisionConfig.from_dict(json.loads(json.dumps(raw)))
    for field in dataclasses.fields(VisionConfig):
        if field.name == "rope_theta":
            assert mine.rope_theta == ref.rope_parameters["rope_theta"]
        elif field.name == "output_proj_dims":
            assert mine.output_proj_dims == getattr(ref, "output_proj_dims", None)
        else:
            assert getattr(mine, field.name) == getattr(ref, field.name), field.name


def test_config_refuses_what_the_tower_cannot_run():
    with pytest.raises(UsageError, match="hidden_activation 'relu'"):
        VisionConfig.from_dict({"hidden_activation": "relu"})
    with pytest.raises(UsageError, match="axial"):
        VisionConfig.from_dict({"rope_parameters": {"rope_type": "linear", "rope_theta": 1.0, "factor": 2.0}})
    with pytest.raises(UsageError, match="multiple of 4"):
        VisionConfig.from_dict({"head_dim": 10})


def test_text_width_default_is_transformers_default():
    from gemma4enc.model.vision import TextConfig

    assert TextConfig({}).hidden_size == Gemma4TextConfig().hidden_size


def test_an_encode_process_never_imports_transformers(ckpt, tmp_path):
    """The point of vision.py: a run loads torch and its tower, not transformers (nor do its workers)."""
    from .helpers import flags, photo

    media = tmp_path / "media"
    media.mkdir()
    photo(120, 160).save(media / "a.jpg")
    # main(), not the console script: that one leaves by os._exit once torch is loaded (issue 39),
    # before this process could print what it imported
    code = ("import sys\nfrom gemma4enc.commands.cli import main\n"
            f"sys.argv = ['gemma4enc', 'encode', {str(media)!r}, '-o', {str(tmp_path / 'out')!r}, *{flags()!r}, "
            f"'--model', {str(ckpt)!r}, '-q']\n"
            "try:\n    main()\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "out" / "manifest.jsonl").read_text().count('"status": "ok"') == 1
