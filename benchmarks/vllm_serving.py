"""vLLM's CPU build from pixels vs from an OUT, with an E2B-sized vision tower and a small text model.

    PYTHONPATH=. .venv/bin/python benchmarks/vllm_serving.py [--photos 6] [--json bench-out/vllm.json]

Phase 1 (gemma4enc's venv): a random checkpoint with E2B's vision tower (768 wide, 16 layers, 12 heads,
clipped linears) and a tiny text model (dev/chat.py: head_dim 32), 6 camera-sized JPEGs (1600×1200),
`gemma4enc encode --resize torchvision --hash --dtype float32` timed, its peak RSS read.
Phase 2 (vLLM's venv, scripts/vllm_venv.sh; scripts/vllm_shim on PYTHONPATH): one engine through the
connector, float32; per photo, first from its pixels under a fresh key (vLLM's encoder runs: its time
summed from embed_multimodal, the whole request's time to first token with max_tokens=1), then from
the OUT (the key; a black stand-in). Peak RSS of each process from getrusage. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def peak_rss_mb(who=resource.RUSAGE_SELF) -> float:
    return round(resource.getrusage(who).ru_maxrss / 1024, 1)


def prepare(w: Path, photos: int) -> dict:
    import numpy as np
    import torch
    from transformers import Gemma4ForConditionalGeneration

    from gemma4enc.dev import chat, demo
    from gemma4enc.dev.camera import camera_photo

    ckpt = w / "e2b-vision"
    if not (ckpt / "tokenizer.json").exists():
        cfg = demo.servable_config()
        v = cfg.vision_config
        v.hidden_size, v.intermediate_size, v.num_hidden_layers = 768, 3072, 16
        v.num_attention_heads = v.num_key_value_heads = 12
        v.head_dim = 64
        torch.manual_seed(0)
        model = Gemma4ForConditionalGeneration(cfg).eval()
        demo.randomize_(model, 0)
        model.save_pretrained(ckpt)
        chat.tokenizer().save_pretrained(ckpt)
        (ckpt / "processor_config.json").write_text(json.dumps(chat.processor_config(), indent=2))
        del model
    media = w / "photos"
    media.mkdir(parents=True, exist_ok=True)
    for i in range(photos):
        if not (media / f"p{i}.jpg").exists():
            camera_photo(1600, 1200, seed=i).save(media / f"p{i}.jpg", quality=90)
    out = w / "out"
    cmd = [sys.executable, "-m", "gemma4enc", "encode", str(media), "-o", str(out), "--model", str(ckpt),
           "--resize", "torchvision", "--hash", "--dtype", "float32", "--out-dtype", "float32",
           "--device", "cpu", "--overwrite", "-q", "--json"]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"encode failed: {done.stderr[-500:]}")
    return {"ckpt": str(ckpt), "out": str(out), "photos": [str(p) for p in sorted(media.glob("*.jpg"))],
            "encode_s": round(seconds, 2), "encode_photos_per_s": round(photos / seconds, 3),
            "encode_peak_rss_mb": peak_rss_mb(resource.RUSAGE_CHILDREN), "np": np.__version__}


def serve(w: Path) -> dict:
    plan = json.loads((w / "plan.json").read_text())
    import torch
    from PIL import Image
    from vllm import LLM, SamplingParams
    from vllm.model_executor.models import gemma4_mm

    from gemma4enc.serving.cache import OutCache
    from gemma4enc.serving.requests import request

    spent = []
    embed = gemma4_mm.Gemma4ForConditionalGeneration.embed_multimodal

    def timed(self, **kwargs):
        t = time.perf_counter()
        out = embed(self, **kwargs)
        spent.append(time.perf_counter() - t)
        return out

    gemma4_mm.Gemma4ForConditionalGeneration.embed_multimodal = timed
    llm = LLM(model=plan["ckpt"], dtype="float32", max_model_len=2048, max_num_seqs=1, enforce_eager=True, seed=0,
              limit_mm_per_prompt={"image": 1, "video": 0}, gpu_memory_utilization=0.25,
              ec_transfer_config={"ec_connector": "GemmaEncConnector",
                                  "ec_connector_module_path": "gemma4enc.serving.vllm_connector",
                                  "ec_role": "ec_consumer", "ec_connector_extra_config": {"out": plan["out"]}})
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}],
                                     tokenize=False, add_generation_prompt=True)
    one = SamplingParams(temperature=0, max_tokens=1)
    cache = OutCache(plan["out"])
    pixels, cached = [], []
    for i, path in enumerate(plan["photos"]):
        image = Image.open(path).convert("RGB")
        t = time.perf_counter()
        llm.generate([{"prompt": prompt, "multi_modal_data": {"image": [image]},
                       "multi_modal_uuids": {"image": [f"bench-miss-{i}-{time.time()}"]}}], one, use_tqdm=False)
        pixels.append(time.perf_counter() - t)
        before = len(spent)
        t = time.perf_counter()
        llm.generate([request(cache, [path], prompt)], one, use_tqdm=False)
        cached.append(time.perf_counter() - t)
        assert len(spent) == before, "the encoder ran on a cached request"
    n = len(plan["photos"])
    med = lambda xs: round(sorted(xs)[len(xs) // 2], 3)  # noqa: E731
    return {"ttft_pixels_s_median": med(pixels), "ttft_cached_s_median": med(cached),
            "ttft_pixels_s": [round(x, 3) for x in pixels], "ttft_cached_s": [round(x, 3) for x in cached],
            "vllm_encoder_s": round(sum(spent), 2), "vllm_encoder_photos_per_s": round(n / sum(spent), 3),
            "vllm_peak_rss_mb": peak_rss_mb(), "torch_threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--photos", type=int, default=6)
    ap.add_argument("--work", default=os.path.expanduser("~/.cache/gemma4enc-bench-vllm"))
    ap.add_argument("--venv", default=os.environ.get("GEMMA4ENC_VLLM_VENV", os.path.expanduser("~/.cache/gemma4enc-vllm")))
    ap.add_argument("--json")
    ap.add_argument("--phase", choices=("all", "serve"), default="all")
    args = ap.parse_args()
    w = Path(args.work)
    if args.phase == "serve":
        print(json.dumps(serve(w)))
        return
    w.mkdir(parents=True, exist_ok=True)
    plan = prepare(w, args.photos)
    (w / "plan.json").write_text(json.dumps(plan, indent=2))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": f"{REPO / 'scripts' / 'vllm_shim'}:{REPO}"}
    done = subprocess.run([os.path.join(args.venv, "bin", "python"), __file__, "--phase", "serve", "--work", str(w)],
                          capture_output=True, text=True, timeout=3600, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        sys.exit(f"vLLM phase failed: {done.stderr[-800:]}")
    result = {k: v for k, v in plan.items() if k in ("encode_s", "encode_photos_per_s", "encode_peak_rss_mb")}
    result |= json.loads(lines[-1]) | {"photos": len(plan["photos"]), "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
