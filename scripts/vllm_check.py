"""scripts/vllm_check.sh, step 2 (vLLM's venv, one engine per process): vLLM's CPU build generating
from gemma4enc's tokens equals vLLM generating from the pixels, and its vision encoder never runs.

    vllm_check.py W --via connector|export --dtype float32|bfloat16

One LLM, single process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so the encoder can be counted by wrapping
Gemma4ForConditionalGeneration.embed_multimodal), an encoder cache from W/out32|out16 through
gemma4enc's connector, or from W/export32 through vLLM's own ECExampleConnector. Per request:
  pixels  the file's pixels (a clip: the frames gemma4enc sampled) under a key no cache has: vLLM
          encodes it (1 call); its pixel_values are held equal to --resize torchvision's, bit for bit
  cached  the request helper's dict (the key, black stand-in media): 0 encoder calls; float32: the
          same greedy tokens, logprobs within BOUND; bfloat16: our tokens within TOWER_BF16 of vLLM's
          own tower output (the two bfloat16 towers round differently, and a random tiny model's
          greedy tokens follow that rounding: the figures are printed, docs/serving.md)
  wrong   a.png's request with b.png's key: b.png's answer, not a.png's (the cache is what is used)
  zeros   (export) a zeroed cache file under a fresh key: another answer
Prints one JSON line of what it found; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch

# torchvision imports here only through scripts/vllm_shim/sitecustomize.py (the test environment's shim)

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

BOUND = {"float32": 0.05}  # max |Δ logprob| of the chosen tokens, cached vs pixels (float32 engine)
TOWER_BF16 = 0.1  # bfloat16 engine: max |ours − vLLM's own tower output| / max |vLLM's|
TOKENS = 12

parser = argparse.ArgumentParser()
parser.add_argument("w")
parser.add_argument("--via", choices=("connector", "connector-kwargs", "export"), required=True)
parser.add_argument("--dtype", choices=("float32", "bfloat16"), required=True)
args = parser.parse_args()
W = os.path.abspath(args.w)
plan = json.load(open(os.path.join(W, "plan.json")))
out = os.path.join(W, "out32" if args.dtype == "float32" else "out16")

t0 = time.perf_counter()
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.model_executor.models import gemma4_mm  # noqa: E402

from gemma4enc.media.patches import DIVIDE, MULTIPLY, patchify  # noqa: E402
from gemma4enc.serving.cache import OutCache  # noqa: E402
from gemma4enc.serving.requests import export_index, request, video_metadata  # noqa: E402

import_s = time.perf_counter() - t0

calls: list[dict] = []
_embed = gemma4_mm.Gemma4ForConditionalGeneration.embed_multimodal


def counted(self, **kwargs):
    call = {k: v for k, v in kwargs.items() if k in ("pixel_values", "pixel_values_videos")}
    calls.append(call)
    out = _embed(self, **kwargs)
    call["out"] = [t.detach().float().cpu().clone() for t in out]  # vLLM's own tokens for this item
    return out


gemma4_mm.Gemma4ForConditionalGeneration.embed_multimodal = counted

# connector-kwargs: the server-wide media_io_kwargs a user sets (image_mode RGB is vLLM's own default,
# still hashed into every identifier), given to each request as the chat server gives them; OTHER is
# a request's own, which no connector can map
SERVER = {"image": {"image_mode": "RGB"}, "video": {"num_frames": 8}}
OTHER = {"image": {"image_mode": "RGB", "gemma4enc_check": 1}, "video": {"num_frames": 9}}
# the file's own pixels go under other kwargs than the stand-in: vLLM takes a uuid for its content, so
# under the same uuid and kwargs its processor cache would hand back the stand-in's pixels
OTHER_REAL = {"image": {"image_mode": "RGB", "gemma4enc_check": 2}, "video": {"num_frames": 10}}
KWARGS = args.via == "connector-kwargs"

if args.via.startswith("connector"):
    transfer = {"ec_connector": "GemmaEncConnector", "ec_connector_module_path": "gemma4enc.serving.vllm_connector",
                "ec_role": "ec_consumer", "ec_connector_extra_config": {"out": out}}
    index = OutCache(out)
else:
    ec_dir = os.path.join(W, "ec-" + args.dtype)  # ECExampleConnector makes a folder per lookup: a copy
    shutil.rmtree(ec_dir, ignore_errors=True)
    shutil.copytree(os.path.join(W, "export32"), ec_dir)
    transfer = {"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
                "ec_connector_extra_config": {"shared_storage_path": ec_dir}}
    index = export_index(ec_dir)

t0 = time.perf_counter()
llm = LLM(model=plan["ckpt"], dtype=args.dtype, max_model_len=2048, max_num_seqs=1, enforce_eager=True, seed=0,
          limit_mm_per_prompt={"image": 1, "video": 1}, gpu_memory_utilization=0.25, ec_transfer_config=transfer,
          **({"media_io_kwargs": SERVER} if KWARGS else {}))
start_s = time.perf_counter() - t0
tok = llm.get_tokenizer()
params = SamplingParams(temperature=0, max_tokens=TOKENS, min_tokens=TOKENS, ignore_eos=True, logprobs=0)


def prompt_for(kind: str) -> str:
    part = {"type": kind}
    msgs = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def generate(req: dict) -> tuple[list[int], list[float], int, float]:
    before = len(calls)
    t = time.perf_counter()
    if KWARGS and "media_io_kwargs" not in req:
        req = req | {"media_io_kwargs": SERVER}  # as the chat server hands a request its kwargs
    (res,) = llm.generate([req], params, use_tqdm=False)
    seconds = time.perf_counter() - t
    o = res.outputs[0]
    if o.finish_reason == "error":
        raise RuntimeError(f"the request failed: {o.finish_reason}")
    lps = [lp[i].logprob for lp, i in zip(o.logprobs, o.token_ids)]
    return list(o.token_ids), lps, len(calls) - before, seconds


def pixels_request(name: str, key: str) -> dict:
    row = plan["rows"][name]
    path = row["path"]
    if row["kind"] == "image":
        data = {"image": [Image.open(path).convert("RGB")]}
    else:
        data = {"video": [(np.load(os.path.join(W, "frames", name + ".npy")), video_metadata(row))]}
    return {"prompt": prompt_for(row["kind"]), "multi_modal_data": data, "multi_modal_uuids": {row["kind"]: [key]}}


def our_values(name: str) -> list[torch.Tensor]:
    """The float32 pixel values --resize torchvision gives this file (images: the image processor's
    scaling; vLLM feeds video frames through the image processor too, so frames are held to MULTIPLY)."""
    row = plan["rows"][name]
    if row["kind"] == "image":
        images = [np.asarray(Image.open(row["path"]).convert("RGB"))]
        budget = 280
    else:
        images = list(np.load(os.path.join(W, "frames", name + ".npy")))
        budget = 70
    unit = (torch.arange(256, dtype=torch.uint8) * (1 / 255))
    return [unit[torch.from_numpy(patchify(im, budget, "torchvision", MULTIPLY).pixels).long()] for im in images]


def theirs(call: dict) -> list[torch.Tensor]:
    pv = call.get("pixel_values")
    if pv is None:
        pv = call["pixel_values_videos"]
    return list(pv) if isinstance(pv, (list, tuple)) else list(pv.reshape(-1, *pv.shape[-2:]))


found = {"via": args.via, "dtype": args.dtype, "import_s": round(import_s, 1), "start_s": round(start_s, 1),
         "requests": {}}
failures = []
key_of = (lambda n: index.key(plan["rows"][n]["path"])) if args.via != "export" else (
    lambda n: index[plan["rows"][n]["path"]]["key"])

for n, name in enumerate(("a.png", "c.png", "clip.mp4")):
    kind = plan["rows"][name]["kind"]
    ref_tokens, ref_lps, ref_calls, ref_s = generate(pixels_request(name, f"miss-{args.dtype}-{n}"))
    mine = our_values(name)
    got = theirs(calls[-1]) if ref_calls else []
    pixels_equal = len(got) == len(mine) and all(  # in vLLM's dtype: a bfloat16 engine gets bfloat16 pixels
        torch.equal(g[: m.shape[0]], m.to(g.dtype)) for g, m in zip(got, mine))
    vllm_tokens = calls[-1]["out"][0] if ref_calls else None
    cached = request(index, [plan["rows"][name]["path"]], prompt_for(kind))
    tokens, lps, n_calls, s = generate(cached)
    dlp = max(abs(a - b) for a, b in zip(ref_lps, lps))
    ours = index.tokens(index.key(plan["rows"][name]["path"])) if args.via != "export" else None
    tower = round(((ours.float() - vllm_tokens).abs().max() / vllm_tokens.abs().max()).item(), 6) if (
        ours is not None and vllm_tokens is not None) else None
    found["requests"][name] = {"tokens_vs_vllm_tower": tower, "pixels_tokens": ref_tokens, "cached_tokens": tokens, "encoder_calls_pixels": ref_calls,
                               "encoder_calls_cached": n_calls, "max_dlogprob": round(dlp, 5),
                               "pixels_equal_vllm": pixels_equal, "generate_s_pixels": round(ref_s, 2),
                               "generate_s_cached": round(s, 2)}
    if ref_calls != 1:
        failures.append(f"{name}: vLLM's encoder ran {ref_calls} times from pixels (1 expected)")
    if not pixels_equal and kind == "image":
        failures.append(f"{name}: vLLM's pixel_values differ from --resize torchvision's")
    if n_calls != 0:
        failures.append(f"{name}: the encoder ran {n_calls} times on a cached request")
    if args.dtype == "float32":
        if tokens != ref_tokens:
            failures.append(f"{name}: greedy tokens from the cache {tokens} != from pixels {ref_tokens}")
        if dlp > BOUND[args.dtype]:
            failures.append(f"{name}: logprobs differ by {dlp:.4f} > {BOUND[args.dtype]}")
    elif tower is not None and tower > TOWER_BF16:
        # bfloat16: vLLM's tower and ours round differently (its linears are vLLM's own kernels), and a
        # random tiny model's near-flat logits turn that into other greedy tokens: held to the tokens
        failures.append(f"{name}: our bfloat16 tokens are {tower} × scale from vLLM's own (> {TOWER_BF16})")

# a wrong cache changes the output: a.png's request, b.png's key, gives b.png's answer (from b.png's
# pixels in float32; from b.png's own cached request in bfloat16, where pixels and cache differ by rounding)
if args.dtype == "float32":
    b_tokens, _, b_calls, _ = generate(pixels_request("b.png", f"miss-{args.dtype}-b"))
else:
    b_tokens, _, b_calls, _ = generate(request(index, [plan["rows"]["b.png"]["path"]], prompt_for("image")))
wrong = request(index, [plan["rows"]["a.png"]["path"]], prompt_for("image"))
wrong["multi_modal_uuids"] = {"image": [key_of("b.png")]}
w_tokens, _, w_calls, _ = generate(wrong)
found["wrong_key"] = {"tokens": w_tokens, "b_from_pixels": b_tokens, "encoder_calls": w_calls}
if w_tokens != b_tokens or w_tokens == found["requests"]["a.png"]["pixels_tokens"]:
    failures.append(f"a.png under b.png's key gave {w_tokens}: b.png's answer is {b_tokens}")
if args.via == "export":  # a zeroed cache file: another answer
    zero_key = "g4e-" + "0" * 40
    os.makedirs(os.path.join(ec_dir, zero_key), exist_ok=True)
    from safetensors.torch import load_file, save_file

    a = load_file(os.path.join(ec_dir, key_of("a.png"), "encoder_cache.safetensors"))["ec_cache"]
    save_file({"ec_cache": torch.zeros_like(a)}, os.path.join(ec_dir, zero_key, "encoder_cache.safetensors"))
    zeroed = request(index, [plan["rows"]["a.png"]["path"]], prompt_for("image"))
    zeroed["multi_modal_uuids"] = {"image": [zero_key]}
    z_tokens, _, z_calls, _ = generate(zeroed)
    found["zeroed"] = {"tokens": z_tokens, "encoder_calls": z_calls}
    if z_tokens == found["requests"]["a.png"]["pixels_tokens"] or z_calls:
        failures.append(f"a zeroed cache gave a.png's answer {z_tokens} (or ran the encoder {z_calls} times)")

if KWARGS:  # a request's own kwargs: no key maps; a stand-in fails loudly, the file's own pixels answer
    found["per_request_kwargs"] = {}
    for name in ("a.png", "clip.mp4"):
        kind = plan["rows"][name]["kind"]
        want = found["requests"][name]["pixels_tokens"]
        stand = request(index, [plan["rows"][name]["path"]], prompt_for(kind)) | {"media_io_kwargs": OTHER}
        try:
            got, _, n_calls, _ = generate(stand)
            refused = None
        except Exception as e:  # noqa: BLE001 - what vLLM raises for a failed request is its own
            got, n_calls, refused = None, None, f"{type(e).__name__}: {str(e)[:200]}"
        real = pixels_request(name, key_of(name)) | {"media_io_kwargs": OTHER_REAL}
        r_tokens, _, r_calls, _ = generate(real)
        found["per_request_kwargs"][name] = {"stand_in": refused or got, "pixels_under_key": r_tokens,
                                             "encoder_calls_pixels_under_key": r_calls}
        if refused is None:
            failures.append(f"{name}: a stand-in under per-request kwargs was answered ({got}, {n_calls} encoder "
                            "calls): a silent miss")
        if r_tokens != want or r_calls != 1:
            failures.append(f"{name}: its own pixels under per-request kwargs gave {r_tokens} ({r_calls} encoder "
                            f"calls), not the pixels' answer {want}")

found["failures"] = failures
print(json.dumps(found))
sys.exit(1 if failures else 0)
