"""Real sizes: a random checkpoint in each released size's exact vision config and file layout
(tests/realsize.py), loaded through load_tower: names, shapes, dtypes and value counts against
what was written and against the config's formula; one photo's parity at E2B size.

Cost: ~1.9 GB of bf16 written to a temporary folder in all (26B-A4B and 31B: 1.15 GB each, each
deleted after its test), at most ~1.2 GB anonymous memory (plus the file pages safetensors maps);
about 35 s of CPU time.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open

from gemma4enc.media.patches import patchify
from gemma4enc.model.load import load_tower

from . import realsize
from .helpers import close, hf_image_features, photo, reference


@pytest.fixture(scope="module")
def e2b(tmp_path_factory):
    folder = tmp_path_factory.mktemp("real-e2b")
    written = realsize.build(folder, "E2B")
    yield folder, written
    shutil.rmtree(folder, ignore_errors=True)


def test_the_formula_gives_the_published_31b_count():
    """31B's vision tower as published (`_verified_total_params`), std buffers included; + embed_vision."""
    assert realsize.vision_params("31B") - 1152 * 5376 == 569_550_384
    assert realsize.vision_params("E2B") - 768 * 1536 == 167_364_608 + 16 * 7 * 4  # 448 clip scalars


def check_layout(folder, written, size):
    vision, width, files = realsize.RELEASED[size]
    names = sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".json"))
    if files == 1:
        assert names == ["config.json", "model.safetensors"]
    else:
        assert names == ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                         "model.safetensors.index.json"]
    tower = load_tower(str(folder), "bfloat16", "cpu")
    assert tower.out_dim == width
    cfg = tower.vision.config
    assert {k: getattr(cfg, k) for k in vision} == vision
    assert (cfg.patch_size, cfg.pooling_kernel_size, cfg.position_embedding_size) == (16, 3, 10240)
    total = 0
    for part, module in (("model.vision_tower.", tower.vision), ("model.embed_vision.", tower.embed)):
        state = module.state_dict()
        mine = {k: v for k, v in written.items() if k.startswith(part)}
        assert sorted(part + k for k in state) == sorted(mine)  # every name, nothing more
        assert len({mine[part + k]["file"] for k in state}) == 1
        with safe_open(str(folder / mine[next(iter(mine))]["file"]), framework="pt") as f:
            for key, value in state.items():
                assert tuple(value.shape) == mine[part + key]["shape"], key
                assert value.dtype == torch.bfloat16, key
                assert torch.equal(value, f.get_tensor(part + key)), key
        total += sum(v.numel() for v in state.values())
    assert total == realsize.vision_params(size)
    layers = tower.vision.encoder.layers
    assert len(layers) == vision["num_hidden_layers"]
    assert hasattr(tower.vision, "std_bias") == vision["standardize"]
    clips = [k for k in tower.vision.state_dict() if k.endswith("input_min")]
    assert len(clips) == (7 * vision["num_hidden_layers"] if vision["use_clipped_linears"] else 0)


def test_e2b_layout(e2b):
    check_layout(*e2b, "E2B")


@pytest.mark.slow
@pytest.mark.parametrize("size", ["E4B", "26B-A4B", "31B"])
def test_released_layouts(tmp_path, size):
    folder = tmp_path / size
    try:
        check_layout(folder, realsize.build(folder, size, seed=1), size)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_e2b_size_matches_get_image_features(e2b):
    """One photo through the full-size E2B tower, float32, against transformers (1e-4 × scale)."""
    image = photo(360, 480, seed=11)
    ref = reference(e2b[0])
    want = hf_image_features(ref, image, budget=140)
    del ref
    tower = load_tower(str(e2b[0]), "float32", "cpu")
    (got,) = tower.encode([patchify(image, 140)])
    assert got.shape == want.shape and got.shape[1] == 1536
    assert close(got, want, 1e-4), (got - want).abs().max()


def test_12b_unified_vision_embedder_config_and_count():
    """gemma4_unified (google/gemma-4-12B-it) has no ViT: its vision_embedder at the default (12B)
    config, built by transformers on meta, holds exactly what the formula says."""
    unified = pytest.importorskip("transformers.models.gemma4_unified.modeling_gemma4_unified",
                                  reason="this transformers has no gemma4_unified")
    from transformers.models.gemma4_unified.configuration_gemma4_unified import (
        Gemma4UnifiedTextConfig,
        Gemma4UnifiedVisionConfig,
    )

    vcfg = Gemma4UnifiedVisionConfig()
    assert (vcfg.patch_size, vcfg.pooling_kernel_size, vcfg.mm_embed_dim, vcfg.mm_posemb_size) == (16, 3, 3840, 1120)
    text = Gemma4UnifiedTextConfig(hidden_size=3840, num_hidden_layers=1, vocab_size=8)  # mm_embed_dim's width
    with torch.device("meta"):
        embedder = unified.Gemma4UnifiedVisionEmbedder(vcfg, text)
    shapes = {k: tuple(v.shape) for k, v in embedder.state_dict().items()}
    patch = (16 * 3) ** 2 * 3  # one 48 px merged patch, raw
    assert shapes == {
        "patch_ln1.weight": (patch,), "patch_ln1.bias": (patch,),
        "patch_dense.weight": (3840, patch), "patch_dense.bias": (3840,),
        "patch_ln2.weight": (3840,), "patch_ln2.bias": (3840,),
        "pos_embedding": (1120, 2, 3840),
        "pos_norm.weight": (3840,), "pos_norm.bias": (3840,),
        "multimodal_embedder.embedding_projection.weight": (3840, 3840),
    }
    count = 2 * patch + patch * 3840 + 3840 + 2 * 3840 + 1120 * 2 * 3840 + 2 * 3840 + 3840 * 3840
    assert sum(torch.Size(s).numel() for s in shapes.values()) == count == 49_922_304
