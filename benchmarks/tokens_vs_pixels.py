"""How close Gemma 4's output from stored tokens comes to its output from the pixels, per dtype.

For tiny random E2B-like and 26B-like full models (tests/gemma_client.py): the prompt of two
images and a clip through Gemma4Processor with pixels, and with the tokens of `gemma4enc encode`
at each tower dtype / stored dtype; prints max |Δ prefill logits| / max |logits| and how many of
20 greedy tokens agree before the first difference, against the pixels through a model of the
same dtype (and, for scale, the bfloat16 model's pixels against the float32 model's). Run from the repository root:

    .venv/bin/python benchmarks/tokens_vs_pixels.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests import gemma_client as gc  # noqa: E402

VARIANTS = [  # (tower --dtype, --out-dtype, model dtype)
    ("float32", "float32", torch.float32),
    ("float32", "bfloat16", torch.float32),
    ("bfloat16", "bfloat16", torch.bfloat16),
]


def agree(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@torch.no_grad()
def measure(kind: str, root: Path) -> None:
    from transformers import Gemma4ForConditionalGeneration

    media = gc.write_media(root / "media")
    ckpt = gc.build(root / kind, kind, seed=3)
    processor = gc.processor(gc.IMAGE_TOKENS)
    pixels = gc.pixel_inputs(processor, media)
    models = {d: Gemma4ForConditionalGeneration.from_pretrained(ckpt, dtype=d).eval()
              for d in (torch.float32, torch.bfloat16)}

    def run(model, batch):
        n = batch["input_ids"].shape[1]
        tokens = model.generate(**batch, max_new_tokens=20, min_new_tokens=20, do_sample=False)[0, n:].tolist()
        return model(**batch).logits.float(), tokens

    def show(what, got, want):
        rel = (got[0] - want[0]).abs().max().item() / want[0].abs().max().item()
        same = agree(got[1], want[1])
        print(f"{kind:4s} {what:52s} max|Δlogits|/max|logits| {rel:.2e}  greedy tokens equal {same}/20", flush=True)

    reference = run(models[torch.float32], pixels)
    show("pixels, bfloat16 model (transformers alone)", run(models[torch.bfloat16], pixels), reference)
    for tower, stored, dtype in VARIANTS:
        emb = gc.encode(media, root / f"{kind}-{tower}-{stored}", ckpt, "--dtype", tower, "--out-dtype", stored)
        batch = emb.mm_encoder_outputs([media / p for p in gc.PATHS], model=models[dtype]).tokenize(processor, gc.TEXT)
        show(f"tokens: tower {tower}, stored {stored}, model {str(dtype)[6:]}", run(models[dtype], batch),
             reference if dtype == torch.float32 else run(models[dtype], pixels))


if __name__ == "__main__":
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("e2b", "26b"):
            measure(kind, Path(tmp))
