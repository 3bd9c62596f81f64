"""Make-believe inputs: tiny random Gemma 4 checkpoints and media that carry their own truth.

Used by `gemma4enc demo`, the tests and the benchmark. Checkpoints are built and saved with
transformers itself.

Every parameter and buffer gets non-trivial random values: the default init (ones for the
position table and norms, ±inf clip bounds, 0/1 std buffers) hides bugs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def tiny_config(clipped: bool = True, standardize: bool = True, hidden: int = 32, text_hidden: int = 48):
    from transformers import Gemma4Config
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig, Gemma4VisionConfig

    text = Gemma4TextConfig(
        vocab_size=256,
        vocab_size_per_layer_input=256,
        hidden_size=text_hidden,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        hidden_size_per_layer_input=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    vision = Gemma4VisionConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        use_clipped_linears=clipped,
        standardize=standardize,
    )
    return Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None)


def tiny_unified_config(embed: int = 32, text_hidden: int = 48):
    """gemma4_unified (the 12B's architecture) with a tiny embedder and language model; the position
    table keeps its real 1120 rows, so a one-cell sliver at the largest budget still fits."""
    from transformers import Gemma4UnifiedConfig
    from transformers.models.gemma4_unified.configuration_gemma4_unified import (
        Gemma4UnifiedTextConfig,
        Gemma4UnifiedVisionConfig,
    )

    text = Gemma4UnifiedTextConfig(
        vocab_size=256,
        hidden_size=text_hidden,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        global_head_dim=16,
        layer_types=["sliding_attention", "full_attention"],
    )
    vision = Gemma4UnifiedVisionConfig(mm_embed_dim=embed, output_proj_dims=embed)
    return Gemma4UnifiedConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None
    )


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Random values everywhere a checkpoint has values, at scales that keep activations sane."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(random_tensor(name, p.shape, g))
        for name, b in model.named_buffers():
            if "inv_freq" not in name and (value := random_buffer(name, b.shape, g)) is not None:
                b.copy_(value)


def random_tensor(name: str, shape, g: torch.Generator) -> torch.Tensor:
    """A float32 value for the parameter or persistent buffer `name` (used without a module, too:
    real-size checkpoints are written tensor by tensor)."""
    buffer = random_buffer(name, shape, g)
    if buffer is not None:
        return buffer
    if name.endswith("norm.weight") or "layernorm" in name:
        return 1.0 + 0.3 * torch.randn(shape, generator=g)
    if "position_embedding_table" in name:
        return 0.5 * torch.randn(shape, generator=g)
    fan_in = shape[-1] if len(shape) > 1 else 1
    return torch.randn(shape, generator=g) / fan_in**0.5


def random_buffer(name: str, shape, g: torch.Generator) -> torch.Tensor | None:
    """Clip bounds that bite and non-trivial std buffers (None: not a buffer we fill)."""
    if name.endswith(("input_min", "output_min")):
        return torch.full(shape, -2.0 - torch.rand((), generator=g).item())
    if name.endswith(("input_max", "output_max")):
        return torch.full(shape, 2.0 + torch.rand((), generator=g).item())
    if name.endswith("std_bias"):
        return 0.5 * torch.randn(shape, generator=g)
    if name.endswith("std_scale"):
        return 0.5 + torch.rand(shape, generator=g)
    return None


def build(
    folder: Path, seed: int = 0, shard_size: str | None = None, unified: bool = False, **config_kw
):
    """Save a random Gemma4ForConditionalGeneration (with `unified`, a Gemma4UnifiedForConditionalGeneration)
    to `folder`; return the in-memory model."""
    from transformers import Gemma4ForConditionalGeneration, Gemma4UnifiedForConditionalGeneration

    torch.manual_seed(seed)
    if unified:
        model = Gemma4UnifiedForConditionalGeneration(tiny_unified_config(**config_kw)).eval()
    else:
        model = Gemma4ForConditionalGeneration(tiny_config(**config_kw)).eval()
    randomize_(model, seed)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return model


def servable_config(vision_tokens: int = 280, **config_kw):
    """tiny_config with its token ids inside vocab(), untied embeddings (a tied random model repeats
    its last token), a text head_dim of 32 (the smallest vLLM's CPU attention takes) and the
    vision_config.default_output_length real Gemma 4 configs carry (vLLM reads it; transformers'
    config class does not define it, so it is set here by hand)."""
    from .chat import MM, VIDEO, vocab

    v = vocab()
    cfg = tiny_config(**config_kw)
    text = cfg.text_config
    text.vocab_size = text.vocab_size_per_layer_input = 128
    text.head_dim = 32
    text.pad_token_id, text.eos_token_id, text.bos_token_id = v["<pad>"], v["<eos>"], v["<bos>"]
    cfg.tie_word_embeddings = text.tie_word_embeddings = False
    cfg.image_token_id, cfg.video_token_id = v[MM["image_token"]], v[VIDEO]
    cfg.boi_token_id, cfg.eoi_token_id = v[MM["boi_token"]], v[MM["eoi_token"]]
    cfg.audio_token_id, cfg.boa_token_id = v[MM["audio_token"]], v[MM["boa_token"]]
    cfg.eoa_token_id = v[MM["eoa_token"]]
    cfg.vision_config.default_output_length = vision_tokens
    return cfg


def build_servable(folder: Path, seed: int = 0, shard_size: str | None = None, **config_kw) -> Path:
    """Save a random full Gemma 4 that generates, with its tokenizer, chat template and processor
    config, to `folder`; return the folder."""
    import json

    from transformers import Gemma4ForConditionalGeneration

    from .chat import processor_config, tokenizer, vocab

    folder = Path(folder)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(servable_config(**config_kw)).eval()
    randomize_(model, seed)
    model.generation_config.pad_token_id = vocab()["<pad>"]
    model.save_pretrained(folder, **({"max_shard_size": shard_size} if shard_size else {}))
    tokenizer().save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps(processor_config(), indent=2) + "\n")
    return folder


# ---- media that carries its own truth -----------------------------------------------------

BITS = 10  # frame index bits drawn in each frame


def barcode_frame(index: int, width: int = 192, height: int = 144) -> np.ndarray:
    """(H, W, 3) uint8: the top half is `index` in BITS black/white columns, the rest texture."""
    frame = np.empty((height, width, 3), np.uint8)
    yy, xx = np.mgrid[0:height, 0:width]
    frame[...] = ((xx * 3 + yy * 2 + index * 7) % 256)[..., None] // 2 + np.array([0, 40, 80], np.uint8)
    band = height // 2
    col = width // BITS
    for bit in range(BITS):
        frame[:band, bit * col : (bit + 1) * col] = 255 if (index >> bit) & 1 else 0
    return frame


def read_barcode(frame: np.ndarray) -> int:
    """Inverse of barcode_frame, robust to codec noise (any size: it reads relative columns)."""
    height, width = frame.shape[:2]
    band = frame[: height // 2].astype(np.float32).mean(axis=(0, 2))  # (W,)
    col = width / BITS
    bits = [band[int(b * col + col * 0.3) : int(b * col + col * 0.7)].mean() > 127 for b in range(BITS)]
    return sum(1 << b for b, on in enumerate(bits) if on)


def write_video(
    path: Path,
    frames: int = 40,
    codec: str = "libx264",
    fps: int = 30,
    size=(192, 144),
    durations_ms: list[int] | None = None,
    gop: int = 12,
) -> None:
    """A clip whose frame i shows i; `durations_ms` gives a variable frame rate; x264/x265 add B-frames."""
    import fractions

    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        stream.options = {"g": str(gop)} if codec in ("libx264", "libx265") else {}
        if durations_ms:  # millisecond clock; no B-frames, so decode order is presentation order
            stream.time_base = stream.codec_context.time_base = fractions.Fraction(1, 1000)
            stream.options = {"g": str(gop), "bf": "0"}
        t = 0
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(barcode_frame(i, *size), format="rgb24")
            if durations_ms:
                frame.pts, frame.time_base = t, fractions.Fraction(1, 1000)
                t += durations_ms[i % len(durations_ms)]
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def rotate_mp4(path: Path) -> None:
    """Mark an MP4's video track as shown rotated by 90° (a phone's display matrix, in tkhd)."""
    data = bytearray(path.read_bytes())
    at = data.find(b"tkhd")
    version = data[at + 4]
    matrix = (
        at + 4 + 4 + (32 if version == 1 else 20) + 8 + 8
    )  # after times, id, duration, reserved, layer…
    values = [0, 0x10000, 0, -0x10000 & 0xFFFFFFFF, 0, 0, 0, 0, 0x40000000]
    data[matrix : matrix + 36] = b"".join(v.to_bytes(4, "big") for v in values)
    path.write_bytes(bytes(data))


def write_images(folder: Path) -> list[Path]:
    """A handful of images: several aspect ratios and Pillow modes, as real folders have."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    yy, xx = np.mgrid[0:480, 0:640]
    base = np.stack([xx % 256, yy % 256, (xx + yy) % 256], -1).astype(np.uint8)
    noisy = np.clip(base.astype(int) + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)
    photo = Image.fromarray(noisy)
    made = []
    for name, image in [
        ("landscape.jpg", photo),
        ("portrait.png", photo.rotate(90, expand=True)),
        ("square.webp", photo.crop((0, 0, 480, 480))),
        ("panorama.jpg", photo.resize((1200, 200))),
        ("tall.png", photo.resize((90, 700))),
        ("tiny.png", photo.resize((20, 30))),
        ("gray.png", photo.convert("L")),
        ("alpha.png", photo.convert("RGBA")),
    ]:
        path = folder / name
        image.save(path)
        made.append(path)
    return made


def make_demo(folder: Path) -> tuple[Path, Path]:
    """A tiny random checkpoint that generates (a tokenizer with a chat template, a processor
    config: one to fine-tune and to serve offline: build_servable) and a folder of generated images
    and videos."""
    folder = Path(folder)
    ckpt, media = folder / "tiny-gemma4", folder / "media"
    if not (ckpt / "tokenizer.json").exists():  # a checkpoint from before it had one is made anew
        build_servable(ckpt, seed=0, shard_size="300KB")
    write_images(media / "photos")
    (media / "clips").mkdir(parents=True, exist_ok=True)
    write_video(media / "clips" / "h264.mp4", frames=48)
    write_video(media / "clips" / "vp9.webm", frames=30, codec="libvpx-vp9")
    (media / "notes.txt").write_text("not media: skipped by the walk\n")
    return ckpt, media
