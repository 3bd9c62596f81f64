"""Tiny FULL Gemma 4 checkpoints that run text generation, their tokenizer, and Gemma4Processor.

The checkpoints' token ids live inside a tiny character-level vocabulary, so the language
model embeds every text token; the multimodal placeholders are Gemma 4's own strings.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers.video_processing_utils import VideoProcessorMixin

from gemma4enc.dev import demo
from gemma4enc.dev import chat
from gemma4enc.dev.chat import CHAT_TEMPLATE, MM, SPECIAL, VIDEO, vocab  # noqa: F401


def tokenizer():
    """dev/chat.py's, split as these tests were written for (a run of newlines is one <unk>)."""
    return chat.tokenizer(newlines=False)


def config(kind: str):
    """e2b: per-layer inputs, clipped linears, causal. 26b: vision tokens attend both ways
    (use_bidirectional_attention="vision"), standardize, a mixture of experts, no per-layer inputs."""
    v = vocab()
    cfg = demo.tiny_config(clipped=kind == "e2b", standardize=kind == "26b")
    text = cfg.text_config
    text.vocab_size = text.vocab_size_per_layer_input = 128
    text.pad_token_id, text.eos_token_id, text.bos_token_id = v["<pad>"], v["<eos>"], v["<bos>"]
    if kind == "26b":
        text.hidden_size_per_layer_input = 0
        text.use_bidirectional_attention = "vision"
        text.enable_moe_block, text.num_experts, text.top_k_experts, text.moe_intermediate_size = True, 4, 2, 32
    cfg.tie_word_embeddings = text.tie_word_embeddings = False  # tied, random models repeat the last token
    cfg.image_token_id, cfg.video_token_id = v[MM["image_token"]], v[VIDEO]
    cfg.boi_token_id, cfg.eoi_token_id = v[MM["boi_token"]], v[MM["eoi_token"]]
    cfg.audio_token_id, cfg.boa_token_id = v[MM["audio_token"]], v[MM["boa_token"]]
    cfg.eoa_token_id = v[MM["eoa_token"]]
    return cfg


def build(folder: Path, kind: str, seed: int):
    """Save a random full model and its tokenizer to `folder`; return the folder."""
    from transformers import Gemma4ForConditionalGeneration

    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config(kind)).eval()
    demo.randomize_(model, seed)
    model.generation_config.pad_token_id = vocab()["<pad>"]
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


class FramesVideoProcessor(VideoProcessorMixin):
    """Stands in for Gemma4VideoProcessor, which needs torchvision (not importable here): each
    frame through Gemma4ImageProcessorPil at the video budget, the torchvision-free way that
    transformers' own frames match (research/gemma4_transformers.md §3). Outputs and metadata
    are the video processor's, so Gemma4Processor expands the prompt with its own code."""

    # Gemma4VideoProcessor's; transformers before 5.22 keeps only these keys of a sub-processor's output
    model_input_names = ["pixel_values_videos", "video_position_ids", "num_frames_per_video"]

    def __init__(self, max_soft_tokens: int = 70):
        super().__init__()
        self.max_soft_tokens = max_soft_tokens

    def preprocess(self, videos, video_metadata=None, **kwargs):
        from transformers import BatchFeature
        from transformers.models.gemma4.image_processing_pil_gemma4 import (
            Gemma4ImageProcessorPil,
        )

        pil = Gemma4ImageProcessorPil(max_soft_tokens=self.max_soft_tokens)
        feats = [pil([list(v)], return_tensors="pt") for v in videos]
        return BatchFeature({
            "pixel_values_videos": torch.cat([f["pixel_values"] for f in feats]),
            "video_position_ids": torch.cat([f["image_position_ids"] for f in feats]),
            "num_frames_per_video": torch.tensor([len(v) for v in videos]),
            "num_soft_tokens_per_video": [int(f["num_soft_tokens_per_image"][0]) for f in feats],
            "video_metadata": video_metadata,
        })


def processor(image_tokens: int, video_tokens: int = 70):
    """Gemma4Processor (PIL image processor) with the stand-in video processor."""
    from transformers import Gemma4Processor
    from transformers.models.gemma4.feature_extraction_gemma4 import (
        Gemma4AudioFeatureExtractor,
    )
    from transformers.models.gemma4.image_processing_pil_gemma4 import (
        Gemma4ImageProcessorPil,
    )

    class Processor(Gemma4Processor):
        def check_argument_for_proper_class(self, name, argument):
            if name == "video_processor":  # without torchvision transformers cannot name the class it wants
                return type(argument)
            return super().check_argument_for_proper_class(name, argument)

    return Processor(Gemma4AudioFeatureExtractor(), Gemma4ImageProcessorPil(max_soft_tokens=image_tokens),
                     tokenizer(), FramesVideoProcessor(video_tokens), chat_template=CHAT_TEMPLATE)


def video_frames(path: Path, frames: int) -> tuple[np.ndarray, dict]:
    """The clip as transformers' own video path gives it to Gemma4Processor: load_video with the
    PyAV backend and its uniform sampler (`frames` of them), and the metadata it returns."""
    from transformers.video_utils import load_video

    return load_video(str(path), num_frames=frames, backend="pyav")


TEXT = "Two photos <|image|> and <|image|>, then a clip <|video|>. What changed?"
IMAGE_TOKENS, FRAMES = 140, 4
PATHS = ("a.png", "b.jpg", "clip.mp4")


def write_media(root: Path) -> Path:
    """Two images, a 40-frame clip at 30 fps (4 frames sampled: 00:00 … 00:01), a broken file."""
    from .helpers import photo

    root.mkdir(parents=True, exist_ok=True)
    photo(300, 500, seed=1).save(root / "a.png")
    photo(400, 240, seed=2).save(root / "b.jpg", quality=95)
    demo.write_video(root / "clip.mp4", frames=40)
    (root / "broken.jpg").write_bytes(b"\xff\xd8\xff not a jpeg")
    return root


def encode(media: Path, out: Path, ckpt: Path, *extra: str):
    """`gemma4enc encode` through its CLI; the reader of the result."""
    from typer.testing import CliRunner

    import gemma4enc
    from gemma4enc.commands.cli import app

    args = ["encode", str(media), "-o", str(out), "--model", str(ckpt), "--device", "cpu", "--workers", "0",
            "--max-soft-tokens", str(IMAGE_TOKENS), "--frames", str(FRAMES), "--video-backend", "pyav", "-q", *extra]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output  # 1: broken.jpg failed, the rest is encoded
    return gemma4enc.open(out)


def pixel_inputs(processor, media: Path):
    """The prompt through Gemma4Processor with the pixels, as transformers users give them."""
    from PIL import Image

    images = [Image.open(media / name).convert("RGB") for name in PATHS[:2]]
    frames, meta = video_frames(media / PATHS[2], FRAMES)
    return processor(text=TEXT, images=[images], videos=[frames], video_metadata=[meta], return_tensors="pt")
