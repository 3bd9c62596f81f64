"""gemma4_unified (the 12B's encoder-free vision) against transformers' own get_image_features /
get_video_features, per item, and through the CLI, resume and the Ray engine.

transformers' unified processors import torchvision at module level, and torchvision does not
load beside the CPU torch here. So the reference inputs are built by the processors' own
module-level functions (get_aspect_ratio_preserving_size, convert_image_to_patches /
convert_video_to_patches, patches_merge, the padding), read from their source files and run
step by step as their `_preprocess` does, with Pillow's bicubic resize in place of
torchvision's (the PIL path, as for the ViT models). `test_torchvision_processor` compares with
the processors themselves where torchvision imports.

Tolerances (max abs difference over max |reference|): float32 1e-4 (measured 4.9e-7: the same
arithmetic on the same pixels, only the matmul's blocking differs with the batch); bfloat16
against the reference in bfloat16 0.02 (measured 0 on these photos; 8.4e-3 against the float32
reference), see docs/architecture.md.
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.image_utils import load_image

from gemma4enc.dev.demo import barcode_frame, write_images, write_video
from gemma4enc.errors import UsageError
from gemma4enc.media.patches import patchify, target_size
from gemma4enc.model.checkpoint import find_checkpoint
from gemma4enc.model.load import load_tower
from gemma4enc.model.unified import UnifiedTower, merge
from gemma4enc.options import SOFT_TOKEN_BUDGETS

from .helpers import BASE, SHAPES, close, encode, shard_tokens

SOURCES = Path(transformers.__file__).parent / "models" / "gemma4_unified"
NAMES = {"get_aspect_ratio_preserving_size", "convert_image_to_patches", "convert_video_to_patches",
         "patches_merge", "pad_along_first_dim", "pad_to_max_patches"}


def processor_functions(module: str) -> dict:
    """The module-level functions of a transformers unified processor file, without its torchvision import."""
    tree = ast.parse((SOURCES / f"{module}.py").read_text())
    funcs = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in NAMES]
    space = {"math": math, "torch": torch}
    exec(compile(ast.Module(body=funcs, type_ignores=[]), module, "exec"), space)  # noqa: S102 - transformers' code
    return {name: space[name] for name in NAMES if name in space}


IMAGE = processor_functions("image_processing_gemma4_unified")
VIDEO = processor_functions("video_processing_gemma4_unified")


def resized(image: Image.Image, budget: int) -> torch.Tensor:
    """Step 1, the PIL path: the processor's target size, Pillow bicubic → (3, H, W) uint8."""
    h, w = IMAGE["get_aspect_ratio_preserving_size"](image.height, image.width, 16, budget * 9, 3)
    if (h, w) != (image.height, image.width):
        image = image.resize((w, h), Image.Resampling.BICUBIC)
    return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)


def grid_positions(h: int, w: int) -> torch.Tensor:
    grid = torch.meshgrid(torch.arange(w // 16), torch.arange(h // 16), indexing="xy")
    return torch.stack(grid, dim=-1).reshape(-1, 2)  # (n, 2) teacher positions, as _preprocess makes them


def hf_image_inputs(images, budget=280):
    """Gemma4UnifiedImageProcessor._preprocess's steps 1–6 → (pixel_values, image_position_ids)."""
    pixels, positions = [], []
    for image in images:
        x = resized(image, budget) * (1 / 255)  # TorchvisionBackend.rescale (do_normalize is False)
        teacher = IMAGE["convert_image_to_patches"](x, 16)
        n = teacher.shape[0] // 9
        merged, pos = IMAGE["patches_merge"](teacher[None], grid_positions(*x.shape[-2:])[None], n)
        merged, pos = IMAGE["pad_along_first_dim"](merged[0], pos[0], budget)
        pixels.append(merged)
        positions.append(pos)
    return torch.stack(pixels), torch.stack(positions)


def hf_video_inputs(frames: list[np.ndarray], budget=70):
    """Gemma4UnifiedVideoProcessor._preprocess's steps for one video of frames → (pixels, positions)."""
    video = torch.stack([resized(Image.fromarray(f), budget) for f in frames])  # (F, 3, H, W) uint8
    video = video.to(torch.float32).sub(0.0).div(255.0)  # fused rescale + normalize (mean 0, std 1 × 255)
    patches = VIDEO["convert_video_to_patches"](video, 16)
    positions = grid_positions(*video.shape[-2:])[None].repeat(len(frames), 1, 1)
    merged, pos = VIDEO["patches_merge"](patches, positions, patches.shape[1] // 9)
    return VIDEO["pad_to_max_patches"](merged, pos, budget)


def unified_reference(folder, dtype=torch.float32):
    from transformers import Gemma4UnifiedForConditionalGeneration

    return Gemma4UnifiedForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()


def hf_unified_features(ref, images, budget=280) -> list[torch.Tensor]:
    pixels, positions = hf_image_inputs(images, budget)
    with torch.no_grad():
        return [t.float() for t in ref.model.get_image_features(pixels, image_position_ids=positions).pooler_output]


@pytest.fixture(scope="module")
def ref(ckpt_unified):
    return unified_reference(ckpt_unified)


@pytest.fixture(scope="module")
def tower32(ckpt_unified):
    return load_tower(str(ckpt_unified), "float32", "cpu")


def test_our_resize_rule_is_the_unified_processors(photos):
    for module in (IMAGE, VIDEO):
        rule = module["get_aspect_ratio_preserving_size"]
        for h, w in SHAPES + [(1, 5000), (5000, 1), (48, 48), (47, 47), (4032, 3024), (720, 1280)]:
            for budget in SOFT_TOKEN_BUDGETS:
                try:
                    want = rule(h, w, 16, budget * 9, 3)
                except ValueError:
                    with pytest.raises(ValueError):
                        target_size(h, w, budget)
                    continue
                assert target_size(h, w, budget) == want, (h, w, budget)


def test_merge_is_patches_merge(photos):
    for image in photos:
        for budget in (70, 280):
            x = resized(image, budget)
            teacher = IMAGE["convert_image_to_patches"](x, 16)
            want, pos = IMAGE["patches_merge"](teacher[None], grid_positions(*x.shape[-2:])[None], teacher.shape[0] // 9)
            ours = patchify(image, budget)
            pixels, positions = merge(ours)
            assert np.array_equal(pixels, want[0].numpy()) and np.array_equal(positions, pos[0].numpy())
            shuffled = np.random.default_rng(0).permutation(ours.n)  # positions, not order, place the patches
            again = merge(type(ours)(ours.pixels[shuffled], ours.positions[shuffled]))
            assert np.array_equal(again[0], pixels) and np.array_equal(again[1], positions)


def test_loads_only_the_embedder_and_is_a_tower(ckpt_unified, tower32):
    ckpt = find_checkpoint(str(ckpt_unified))
    assert ckpt.config.model_type == "gemma4_unified"
    read = {k for part in ckpt.tensors.values() for k in part}
    assert read and all(".vision_embedder." in k or ".embed_vision." in k for k in read)
    assert isinstance(tower32, UnifiedTower) and not tower32.attention
    assert tower32.out_dim == 48 and tower32.hidden == 32
    assert tower32.embedder.pos_embedding.abs().sum() > 0  # the random table arrived, not the zeros init


def test_float32_images_match_get_image_features(tower32, ref, photos):
    budgets = [280, 70, 1120, 280, 140, 280, 560, 70, 280]
    items = [patchify(im, b) for im, b in zip(photos, budgets)]
    batched = tower32.encode(items)  # one call over every cell of every image
    for b in set(budgets):
        chosen = [i for i, x in enumerate(budgets) if x == b]
        wants = hf_unified_features(ref, [photos[i] for i in chosen], b)  # the reference pads its batch
        for i, want in zip(chosen, wants):
            assert batched[i].shape == want.shape == (items[i].soft_tokens, 48)
            assert close(batched[i], want, 1e-4), (photos[i].size, b, (batched[i] - want).abs().max())
            assert close(tower32.encode([items[i]])[0], want, 1e-4)  # alone, the same


def test_float32_video_frames_match_get_video_features(tower32, ref):
    frames = [barcode_frame(i, 320, 180) for i in range(0, 40, 5)]
    pixels, positions = hf_video_inputs(frames, 70)
    with torch.no_grad():
        want = ref.model.get_video_features(pixels, video_position_ids=positions,
                                            num_frames_per_video=torch.tensor([len(frames)])).pooler_output[0]
    items = [patchify(np.ascontiguousarray(f), 70) for f in frames]
    got = tower32.encode(items)
    assert [t.shape[0] for t in got] == [p.soft_tokens for p in items] and torch.cat(got).shape == want.shape
    for frame, want_frame in zip(got, torch.split(want, [p.soft_tokens for p in items])):
        assert close(frame, want_frame, 1e-4)


def test_bfloat16_matches_the_reference_in_bfloat16(ckpt_unified, photos):
    tower = load_tower(str(ckpt_unified), "bfloat16", "cpu")
    ref16 = unified_reference(ckpt_unified, torch.bfloat16)
    items = [patchify(im, 280) for im in photos[:4]]
    for got, want in zip(tower.encode(items), hf_unified_features(ref16, photos[:4])):
        assert got.dtype == torch.bfloat16 and close(got, want, 0.02)


def test_other_layouts_load_the_same(ckpt_unified, tower32, photos, tmp_path):
    """transformers' module names (a re-save by other tools) and mlx's (no `model.`) give the same tokens."""
    ckpt = find_checkpoint(str(ckpt_unified))
    tensors = {}
    for file in {f for part in ckpt.tensors.values() for f in part.values()}:
        with safe_open(str(ckpt_unified / file), framework="pt") as f:
            tensors |= {k: f.get_tensor(k) for k in f.keys() if "vision" in k}
    native = {k.replace("vision_embedder.", "embed_vision.").replace("embed_vision.embedding_projection",
              "embed_vision.multimodal_embedder.embedding_projection"): v for k, v in tensors.items()}
    want = tower32.encode([patchify(photos[0], 280)])[0]
    for name, layout in (("native", native), ("mlx", {k.removeprefix("model."): v for k, v in tensors.items()})):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text((ckpt_unified / "config.json").read_text())
        save_file(layout, str(folder / "model.safetensors"))
        assert torch.equal(load_tower(str(folder), "float32", "cpu").encode([patchify(photos[0], 280)])[0], want)
    del native["model.embed_vision.pos_norm.bias"]
    save_file(native, str(tmp_path / "native" / "model.safetensors"))
    with pytest.raises(UsageError, match="missing vision_embedder tensor.s. pos_norm.bias$"):
        load_tower(str(tmp_path / "native"), "float32", "cpu")
    native["model.embed_vision.pos_norm.bias"] = torch.zeros(31)
    save_file(native, str(tmp_path / "native" / "model.safetensors"))
    with pytest.raises(UsageError, match=r"do not match the config: size mismatch for pos_norm.bias"):
        load_tower(str(tmp_path / "native"), "float32", "cpu")
    dense = native.pop("model.embed_vision.patch_dense.weight")  # as compressed-tensors w4a16 stores a Linear
    native |= {"model.embed_vision.patch_dense.weight_packed": torch.zeros(dense.shape[0], dense.shape[1] // 8,
                                                                           dtype=torch.int32),
               "model.embed_vision.patch_dense.weight_scale": torch.ones(dense.shape[0], 1)}
    save_file(native, str(tmp_path / "native" / "model.safetensors"))
    with pytest.raises(UsageError, match=r"quantized \(compressed-tensors; tensor model.embed_vision.patch_dense.weight_packed\).*google/gemma-4-12B-it$"):
        load_tower(str(tmp_path / "native"), "float32", "cpu")


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("unified-media")
    write_images(root / "photos")
    write_video(root / "clip.mp4", frames=24)
    return root


def test_cli_writes_get_image_features_and_resumes(media, ckpt_unified, ckpt, ref, tmp_path):
    out = tmp_path / "out"
    result = encode([media, "-o", out, "--model", ckpt_unified, *BASE])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["encoded"] == 9 and summary["failed"] == 0
    rows, tokens = shard_tokens(out)
    for name in ("landscape.jpg", "panorama.jpg", "square.webp", "tall.png", "tiny.png"):
        path = str(media / "photos" / name)
        assert close(tokens[path], hf_unified_features(ref, [load_image(path)])[0], 1e-4), name
    video = next(r for r in rows if r["kind"] == "video")
    assert video["frames"] == 4 and video["tokens"] == sum(video["frame_tokens"]) == tokens[video["path"]].shape[0]
    with safe_open(str(out / video["shard"]), framework="pt") as f:
        assert f.metadata()["hidden_size"] == "48" and f.metadata()["model"] == str(ckpt_unified.resolve())

    again = encode([media, "-o", out, "--model", ckpt_unified, *BASE])
    assert json.loads(again.stdout)["encoded"] == 0 and json.loads(again.stdout)["done_before"] == 9
    other = encode([media, "-o", out, "--model", ckpt, *BASE])  # a gemma4 (ViT) model into a unified run's OUT
    assert other.exit_code == 2 and "other settings" in other.output


@pytest.mark.slow
def test_ray_engine_equals_local(media, ckpt_unified, tmp_path):
    pytest.importorskip("ray")
    local, ray = tmp_path / "local", tmp_path / "ray"
    assert encode([media, "-o", local, "--model", ckpt_unified, *BASE]).exit_code == 0
    result = encode([media, "-o", ray, "--model", ckpt_unified, *BASE,
                     "--engine", "ray", "--ray-actors", "1", "--workers", "0"])
    assert result.exit_code == 0, result.output
    got, want = shard_tokens(ray)[1], shard_tokens(local)[1]
    assert set(got) == set(want) and len(got) == 9
    assert all(close(got[p], want[p], 1e-5) for p in want)


def test_torchvision_processor(tower32, ref, photos):
    """Where torchvision imports (a CUDA box): the processors themselves. Soft-token counts and
    positions equal ours; pixels differ by the two bicubic resizes (Pillow vs torchvision's
    antialias), so the tokens only within a bound."""
    try:
        import torchvision  # noqa: F401
    except Exception as e:  # noqa: BLE001 - absent, or a CUDA build beside the CPU torch (RuntimeError)
        pytest.skip(f"torchvision does not import here ({type(e).__name__}); the PIL-path tests stand in")
    from transformers import Gemma4UnifiedImageProcessor

    proc = Gemma4UnifiedImageProcessor()
    for image in photos:
        feats = proc(images=[image], return_tensors="pt")
        ours = patchify(image, 280)
        n = ours.soft_tokens
        assert feats["num_soft_tokens_per_image"][0] == n
        assert np.array_equal(feats["image_position_ids"][0, :n].numpy(), merge(ours)[1])
        with torch.no_grad():
            want = ref.model.get_image_features(feats["pixel_values"], image_position_ids=feats["image_position_ids"])
        assert close(tower32.encode([ours])[0], want.pooler_output[0], 0.1)


def test_bench_runs_the_12b_embedder():
    from gemma4enc.dev.bench import bench

    report = bench(size="12b", device="cpu", dtype="float32", workloads=("mixed",), count=2, repeats=1, log=lambda s: None)
    workload = report["workloads"]["mixed"]
    assert report["layers"] == 0 and set(workload["methods"]) == {"hf-padded", "serial", "bucket", "pack"}
    assert workload["default"] == "pack"  # no attention: one call over the budget's patches, on the CPU too
    assert all(r["items_per_s"] > 0 for r in workload["methods"].values())


@pytest.mark.cuda
def test_cuda_bfloat16_and_its_memory_model(ckpt_unified, ref, photos):
    from gemma4enc.model.batching import budget_patches
    from gemma4enc.options import Options

    tower = load_tower(str(ckpt_unified), "bfloat16", "cuda")
    items = [patchify(im, 280) for im in photos]
    for got, want in zip(tower.encode(items), hf_unified_features(ref, photos)):
        assert close(got.cpu(), want, 0.02)  # against the float32 reference: 8.4e-3 on the CPU
    assert budget_patches(tower, Options(), "pack") >= 9 * 1120  # the memory model fitted its probes
