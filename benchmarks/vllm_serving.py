"""vLLM's CPU build from pixels vs from an OUT, with an E2B-sized vision tower and a small text model.

    PYTHONPATH=. .venv/bin/python benchmarks/vllm_serving.py [--photos 6] [--json bench-out/vllm.json]

Phase 1 (gemma4enc's venv): a random checkpoint with E2B's vision tower (768 wide, 16 layers, 12 heads,
clipped linears) and a tiny text model (dev/chat.py: head_dim 32), 6 camera-sized JPEGs (1600×1200),
`gemma4enc encode --resize torchvision --hash --dtype float32` timed, its peak RSS read.
Phase 2 (vLLM's venv, scripts/vllm_venv.sh; scripts/vllm_shim on PYTHONPATH): one engine through the
connector, float32; per photo, first from its pixels under a fresh key (vLLM's encoder runs: its time
summed from embed_multimodal, the whole request's time to first token with max_tokens=1), then from
the OUT (the key; a black stand-in). Peak RSS of each process from getrusage. Prints one JSON object.
Phase 3 (--phase http, vLLM's venv): the same through the server a user runs, vLLM's OpenAI API on
loopback (`python -m vllm.entrypoints.openai.api_server`, the connector, server-wide media_io_kwargs
video num_frames 8), asked with OpenAI's client, streamed: per photo the time to the first token
from the JPEG as a data URL (a fresh uuid) and from the OUT (requests.stand_in_file, the key), and
the same for a 1600×1200 clip (8 frames: its sampled frames as requests.sampled_file made them, then
its stand-in clip). vLLM's encoder calls are counted in the engine process (scripts/vllm_shim).
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
    clip = w / "clip" / "c0.mp4"
    if not clip.exists():
        from gemma4enc.dev.demo import write_video

        clip.parent.mkdir(parents=True, exist_ok=True)
        write_video(clip, frames=48, fps=24, size=(1600, 1200))
    out = w / "out"
    cmd = [sys.executable, "-m", "gemma4enc", "encode", str(media), str(clip), "-o", str(out), "--model", str(ckpt),
           "--resize", "torchvision", "--hash", "--dtype", "float32", "--out-dtype", "float32", "--frames", "8",
           "--device", "cpu", "--overwrite", "-q", "--json"]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"encode failed: {done.stderr[-500:]}")
    from gemma4enc.serving.cache import OutCache
    from gemma4enc.serving.requests import sampled_file

    frames, _ = sampled_file(str(clip), OutCache(str(out)).by_path[str(clip)].row)
    (w / "clip" / "c0-sampled.mkv").write_bytes(frames)  # the miss's pixels: the frames gemma4enc took
    return {"ckpt": str(ckpt), "out": str(out), "photos": [str(p) for p in sorted(media.glob("*.jpg"))],
            "clip": str(clip), "clip_sampled": str(w / "clip" / "c0-sampled.mkv"),
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


def http(w: Path) -> dict:
    """Phase 3: time to first token through vLLM's OpenAI server, from pixels and from the OUT."""
    import base64

    from openai import OpenAI

    from gemma4enc.dev.vllm_server import NotUp, Server
    from gemma4enc.serving.cache import OutCache
    from gemma4enc.serving.requests import stand_in_file

    plan = json.loads((w / "plan.json").read_text())
    calls_log = w / "encoder-calls.log"
    calls_log.write_text("")
    server = Server(plan["ckpt"], plan["out"], [
        "--dtype", "float32", "--max-model-len", "8192", "--max-num-seqs", "1", "--enforce-eager",
        "--gpu-memory-utilization", "0.25", "--limit-mm-per-prompt", json.dumps({"image": 1, "video": 1}),
        "--media-io-kwargs", json.dumps({"video": {"num_frames": 8}}),
    ], w / "serve.log", env={"GEMMA4ENC_CHECK_ENCODER_LOG": str(calls_log)}, start_s=600)
    try:
        server.__enter__()
    except NotUp as e:
        sys.exit(str(e))
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", timeout=600, max_retries=0)
        cache = OutCache(plan["out"])

        def url(data: bytes, mime: str) -> str:
            return f"data:{mime};base64," + base64.b64encode(data).decode()

        def first_token(data_url: str, uuid: str) -> tuple[float, int]:
            kind = "video_url" if data_url.startswith("data:video") else "image_url"
            before = len(calls_log.read_text().splitlines())
            t = time.perf_counter()
            stream = client.chat.completions.create(
                model=plan["ckpt"], temperature=0, max_tokens=4, stream=True,
                messages=[{"role": "user", "content": [{"type": kind, kind: {"url": data_url}, "uuid": uuid},
                                                       {"type": "text", "text": "?"}]}])
            took = None
            for chunk in stream:
                if took is None and chunk.choices and chunk.choices[0].delta.content is not None:
                    took = time.perf_counter() - t
            return round(took if took is not None else time.perf_counter() - t, 3), (
                len(calls_log.read_text().splitlines()) - before)

        result: dict = {"server_start_s": server.start_s, "photos": [], "clip": {}}
        for i, path in enumerate(plan["photos"]):
            pixels = first_token(url(Path(path).read_bytes(), "image/jpeg"), f"bench-miss-{i}-{time.time()}")
            keyed = first_token(url(*stand_in_file(cache.by_path[path].row)), cache.key(path))
            result["photos"].append({"pixels_s": pixels[0], "pixels_encoder_calls": pixels[1],
                                     "out_s": keyed[0], "out_encoder_calls": keyed[1]})
        clip = plan["clip"]
        pixels = first_token(url(Path(plan["clip_sampled"]).read_bytes(), "video/x-matroska"), f"bench-clip-{time.time()}")
        keyed = first_token(url(*stand_in_file(cache.by_path[clip].row)), cache.key(clip))
        result["clip"] = {"pixels_s": pixels[0], "pixels_encoder_calls": pixels[1], "out_s": keyed[0],
                          "out_encoder_calls": keyed[1]}
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        p = [x["pixels_s"] for x in result["photos"][1:]] or [result["photos"][0]["pixels_s"]]  # the first warms up
        o = [x["out_s"] for x in result["photos"][1:]] or [result["photos"][0]["out_s"]]
        result["photo_ttft_median_s"] = {"pixels": med(p), "out": med(o), "ratio": round(med(p) / med(o), 2)}
        result["clip_ttft_ratio"] = round(result["clip"]["pixels_s"] / result["clip"]["out_s"], 2)
        return result
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--photos", type=int, default=6)
    ap.add_argument("--work", default=os.path.expanduser("~/.cache/gemma4enc-bench-vllm"))
    ap.add_argument("--venv", default=os.environ.get("GEMMA4ENC_VLLM_VENV", os.path.expanduser("~/.cache/gemma4enc-vllm")))
    ap.add_argument("--json")
    ap.add_argument("--phase", choices=("all", "serve", "http"), default="all")
    args = ap.parse_args()
    w = Path(args.work)
    if args.phase == "serve":
        print(json.dumps(serve(w)))
        return
    if args.phase == "http":
        print(json.dumps(http(w)))
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
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server runs its engine in a process of its own
    done = subprocess.run([os.path.join(args.venv, "bin", "python"), __file__, "--phase", "http", "--work", str(w)],
                          capture_output=True, text=True, timeout=3600, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        sys.exit(f"vLLM http phase failed: {done.stderr[-800:]}")
    result["http"] = json.loads(lines[-1])
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
