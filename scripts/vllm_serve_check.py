"""scripts/vllm_check.sh's last step, in vLLM's venv: `vllm serve` on loopback (started and stopped
here, every wait bounded) serving from gemma4enc's connector, asked through OpenAI's Python client
as a user would: no silent miss over HTTP.

    vllm_serve_check.py W     # W: scripts/vllm_prepare.py's folder (the checkpoint, W/out32)

The server has server-wide --media-io-kwargs (image_mode RGB, num_frames 8: vLLM hashes them into
every identifier) and --trust-request-mm-kwargs. Per file (a.png, c.png, clip.mp4):
  pixels   the file as a data URL under a uuid OUT lacks (a clip: the frames gemma4enc sampled, as a
           lossless clip at requests.stand_in_rate): vLLM encodes it (1 encoder call)
  keyed    requests.stand_in_file as a data URL, the key as the part's uuid: the same answer, 0
           encoder calls (the connector maps the hashed identifier back to the key)
  other    the stand-in with the request's own media_io_kwargs: an error reaches the client, not
           an answer (the connector fails it from the scheduler side)
Encoder calls are counted in the engine's process by scripts/vllm_shim (GEMMA4ENC_CHECK_ENCODER_LOG).
Prints one JSON line; exit 1 when a check fails, 5 when the server did not come up.
"""

from __future__ import annotations

import base64
import io
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

START_S = 420  # the server's start-up: import, model, KV cache (30-90 s here)
TOKENS = 12
SERVER = {"image": {"image_mode": "RGB"}, "video": {"num_frames": 8}}
OTHER = {"image": {"image_mode": "RGB", "gemma4enc_check": 1}, "video": {"num_frames": 9}}

W = os.path.abspath(sys.argv[1])
plan = json.load(open(os.path.join(W, "plan.json")))
out = os.path.join(W, "out32")
calls_log = os.path.join(W, "serve-encoder-calls.log")
open(calls_log, "w").close()


from gemma4enc.dev.vllm_server import NotUp, Server  # noqa: E402  (gemma4enc as installed in vLLM's venv)

server = Server(plan["ckpt"], out, [
    "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "1", "--enforce-eager",
    "--gpu-memory-utilization", "0.25", "--seed", "0", "--limit-mm-per-prompt", json.dumps({"image": 1, "video": 1}),
    "--media-io-kwargs", json.dumps(SERVER), "--trust-request-mm-kwargs",
], Path(W) / "serve.log", env={"GEMMA4ENC_CHECK_ENCODER_LOG": calls_log}, start_s=START_S)
port = server.port
found: dict = {"port": port}
failures: list[str] = []


try:
    try:
        server.__enter__()
    except NotUp as e:
        print(json.dumps({"error": str(e)}))
        sys.exit(5)
    found["start_s"] = server.start_s

    from openai import OpenAI
    from PIL import Image

    from gemma4enc.serving.cache import OutCache
    import tempfile

    import numpy as np

    from gemma4enc.serving.requests import _write_lossless, stand_in_file, stand_in_rate

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=300, max_retries=0)
    index = OutCache(out)

    def data_url(image: Image.Image) -> str:
        buf = io.BytesIO()
        image.save(buf, "PNG")  # lossless: the stand-in stays its exact colour
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    def ask(url: str, uuid: str, **extra) -> tuple[list[str] | None, int, str | None]:
        """(the answer's tokens, encoder calls it cost, the error that reached the client)."""
        before = len(open(calls_log).read().splitlines())
        kind = "video_url" if url.startswith("data:video") else "image_url"
        messages = [{"role": "user", "content": [{"type": kind, kind: {"url": url}, "uuid": uuid},
                                                 {"type": "text", "text": "What is this?"}]}]
        try:
            r = client.chat.completions.create(model=plan["ckpt"], messages=messages, temperature=0,
                                               max_tokens=TOKENS, logprobs=True, extra_body=extra or None)
        except Exception as e:  # noqa: BLE001 - the client's own error classes
            return None, len(open(calls_log).read().splitlines()) - before, f"{type(e).__name__}: {str(e)[:200]}"
        choice = r.choices[0]
        calls = len(open(calls_log).read().splitlines()) - before
        if choice.finish_reason not in ("stop", "length"):
            return None, calls, f"finish_reason {choice.finish_reason}"
        return [t.token for t in choice.logprobs.content], calls, None

    def file_url(data: bytes, mime: str) -> str:
        return f"data:{mime};base64," + base64.b64encode(data).decode()

    for n, name in enumerate(("a.png", "c.png", "clip.mp4")):
        row = plan["rows"][name]
        key = index.key(row["path"])
        entry = index.by_path[row["path"]].row
        if row["kind"] == "image":
            real = data_url(Image.open(row["path"]).convert("RGB"))
        else:  # the frames gemma4enc sampled, as a lossless clip at the rate that keeps their timestamps
            frames = np.load(os.path.join(W, "frames", name + ".npy"))
            with tempfile.TemporaryDirectory() as tmp:
                _write_lossless(os.path.join(tmp, "f.mkv"), frames, stand_in_rate(entry))
                real = file_url(open(os.path.join(tmp, "f.mkv"), "rb").read(), "video/x-matroska")
        stand = file_url(*stand_in_file(entry))
        pixels, p_calls, p_err = ask(real, f"miss-serve-{n}")
        t = time.perf_counter()
        keyed, k_calls, k_err = ask(stand, key)
        k_s = time.perf_counter() - t
        other, o_calls, o_err = ask(stand, key, media_io_kwargs=OTHER)
        found[name] = {"pixels": pixels, "encoder_calls_pixels": p_calls, "keyed": keyed,
                       "encoder_calls_keyed": k_calls, "keyed_s": round(k_s, 2), "other_kwargs": other or o_err}
        if p_err or p_calls != 1:
            failures.append(f"{name}: from pixels: {p_err or ''} ({p_calls} encoder calls, 1 expected)")
        if k_err or keyed != pixels or k_calls != 0:
            failures.append(f"{name}: keyed stand-in gave {keyed or k_err} with {k_calls} encoder calls; "
                            f"the pixels' answer is {pixels}")
        if other is not None:
            failures.append(f"{name}: a stand-in under a request's own media_io_kwargs was answered: {other}")
    time.sleep(1)  # the front end's stat loggers take the last step's stats
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        metrics = r.read().decode()
    counted = {}
    for line in metrics.splitlines():
        for name in ("hits", "misses", "refused"):
            if line.startswith(f"vllm:gemma4enc_{name}_total"):
                counted[name] = counted.get(name, 0) + float(line.rsplit(" ", 1)[1])
    found["metrics"] = counted
    if counted.get("hits", 0) < 3 or counted.get("refused", 0) < 3:
        failures.append(f"/metrics counts {counted}: 3 hits and 3 refusals at least were made")
finally:
    server.stop()

text = open(os.path.join(W, "serve.log")).read()
found["connector_lines"] = [line.split("gemma4enc: ", 1)[1][:160] for line in text.splitlines() if "gemma4enc: " in line][:6]
if not any("serving" in line for line in found["connector_lines"]):
    failures.append("the connector's start-up line is not in the server's log")
found["failures"] = failures
print(json.dumps(found))
sys.exit(1 if failures else 0)
