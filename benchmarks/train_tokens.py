"""A training step from stored tokens against one from the pixels: data-loader and step time per example.

Real-size photos (the `bench --e2e` media, benchmedia.py: 12 MP phone JPEGs) and a random model
with Gemma 4 E2B's vision tower (16 layers, 768 wide, clipped linears) under a small text model
(--text-layers, 1536 wide as E2B's, per-layer inputs), float32, tower frozen. Per example
(batch of one, SGD, --rounds interleaved rounds, the median):

- loader: pixels = decode + Gemma4Processor (resize, patchify) + the chat template and labels;
  tokens = the shard read + training.Collator;
- step: forward, backward and the optimizer step; the pixel path runs the frozen tower inside it.

The OUT is encoded once beforehand with `gemma4enc encode --resize exact` (the processor's pixels;
its time is printed apart: it is paid once, not every epoch). Run from the repository root:

    .venv/bin/python benchmarks/train_tokens.py --photos 4 --rounds 2
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests import gemma_client as gc  # noqa: E402
from tests.test_training import PixelCollator  # noqa: E402


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def build(folder: Path, text_layers: int, seed: int = 0) -> Path:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from gemma4enc.dev import demo

    config = gc.config("e2b").to_dict()
    config["vision_config"].update(hidden_size=768, intermediate_size=3072, num_hidden_layers=16,
                                   num_attention_heads=12, num_key_value_heads=12, head_dim=64)
    text = config["text_config"]
    types = (["sliding_attention", "full_attention"] * text_layers)[:text_layers]
    global_head = next(iter(text.get("per_layer_config", {}).values()), {})  # the full-attention layers'
    text.update(hidden_size=1536, intermediate_size=6144, num_hidden_layers=text_layers, layer_types=types,
                num_attention_heads=8, num_key_value_heads=1, head_dim=128,
                per_layer_config={str(i): global_head for i, t in enumerate(types) if t == "full_attention"})
    cfg = Gemma4Config.from_dict(config)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(cfg).eval()
    demo.randomize_(model, seed)
    model.save_pretrained(folder)
    gc.tokenizer().save_pretrained(folder)
    return folder


def encode(media: list[str], out: Path, ckpt: Path, tokens: int, resize: str) -> float:
    from typer.testing import CliRunner

    from gemma4enc.commands.cli import app

    start = time.perf_counter()
    result = CliRunner().invoke(app, ["encode", *media, "-o", str(out), "--model", str(ckpt), "--device", "cpu",
                                      "--workers", "0", "--max-soft-tokens", str(tokens), "--dtype", "float32",
                                      "--out-dtype", "float32", "--resize", resize, "-q"])
    assert result.exit_code == 0, result.output
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=280, help="soft-token budget per image")
    parser.add_argument("--text-layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--resize", default="exact", help="encode's --resize: exact gives the processor's pixels")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import Gemma4ForConditionalGeneration

    from gemma4enc import training
    from gemma4enc.dev import benchmedia
    from gemma4enc.output import gemma

    groups, _ = benchmedia.generated(["jpeg-12mp", "jpeg-24mp"])
    media = (groups["jpeg-12mp"] + groups["jpeg-24mp"])[: args.photos]
    root = Path(tempfile.mkdtemp(prefix="train-tokens-"))
    ckpt = build(root / "ckpt", args.text_layers)
    encoded = encode(media, root / "out", ckpt, args.tokens, args.resize)
    model = Gemma4ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32)
    training.freeze_vision(model)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=1e-4)
    snapshot = [p.detach().clone() for p in trainable]
    examples = [{"messages": [
        {"role": "user", "content": [{"type": "image", "path": p}, {"type": "text", "text": "Describe the photo."}]},
        {"role": "assistant", "content": "A photo taken outdoors, in daylight, with a wide view."}]} for p in media]
    data = training.Conversations(root / "out", examples, model=model)
    processor = gc.processor(args.tokens)
    paths = {"tokens": (lambda i: training.Collator(processor, model=model)([data[i]])),
             "pixels": (lambda i: PixelCollator(processor)([data.examples[i]]))}
    times = {(p, what): [] for p in paths for what in ("loader", "step")}
    losses = {p: [] for p in paths}
    for r in range(args.rounds):
        for name in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
            for i in range(len(data)):
                start = time.perf_counter()
                batch = paths[name](i)
                loaded = time.perf_counter()
                loss = model(**batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                times[name, "loader"].append(loaded - start)
                times[name, "step"].append(time.perf_counter() - loaded)
                losses[name].append(loss.item())
                with torch.no_grad():  # every step from the same weights: the two paths see the same model
                    for p, s in zip(trainable, snapshot):
                        p.copy_(s)
    print(f"{time.strftime('%Y-%m-%d')}  CPU {cpu_name()}  torch threads {args.threads}  float32")
    print(f"{len(media)} photos ({', '.join(Path(m).name for m in media)}), budget {args.tokens}; "
          f"tower 16 x 768, text {args.text_layers} x 1536; encode once (--resize {args.resize}): {encoded:.1f} s")
    for name in paths:
        loader, step = (statistics.median(times[name, w]) for w in ("loader", "step"))
        print(f"{name:6s}  loader {loader:7.3f} s  step {step:7.3f} s  total {loader + step:7.3f} s per example")
    gaps = [abs(a - b) / abs(b) for a, b in zip(losses["tokens"], losses["pixels"])]
    print("relative loss difference, tokens vs pixels, per example: "
          + ", ".join(f"{g:.1e}" for g in gaps[: len(data)]))
    # where it comes from: the pixel batch with transformers' own tower run on each image's
    # unpadded patches (as gemma4enc runs it) in place of the padded batch
    unpadded = []
    with torch.no_grad():
        for i in range(len(data)):
            batch = paths["pixels"](i)
            pos, pixels = batch.pop("image_position_ids"), batch.pop("pixel_values")
            feats = []
            for row in range(pixels.shape[0]):
                n = int((pos[row] != -1).all(-1).sum())
                feats += model.model.get_image_features(pixels[row:row + 1, :n], pos[row:row + 1, :n],
                                                        return_dict=True).pooler_output
            batch["mm_encoder_outputs"] = {"image": gemma._output(list(feats))}
            unpadded.append(model(**batch).loss.item())
    print("relative loss difference, tokens vs the pixels through an unpadded tower: "
          + ", ".join(f"{abs(a - b) / abs(b):.1e}" for a, b in zip(losses["tokens"], unpadded)))


if __name__ == "__main__":
    main()
