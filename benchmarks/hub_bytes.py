"""Bytes a first run moves from the hub for a hub id: range requests for the vision tensors only
(gemma4enc/hub.py) against the whole-file downloads of gemma4enc ≤ 0.x (config, index and every
weight file that holds a vision tensor, through hf_hub_download), side by side.

    python benchmarks/hub_bytes.py [--json bench-out/hub_bytes.json]

It builds tiny random Gemma 4 checkpoints whose language model holds most bytes (as in the
released ones): a sharded one (1 MB shards + index, like 26B/31B) and a single-file one (like
E2B/E4B), serves each from the loopback hub emulator of the tests (tests/hub_server.py, which
counts the body bytes it sends) and fetches it both ways into empty caches, in one process.
Also the same fetch from a server that ignores Range (the whole-file stream fallback).
CPU time is time.process_time of this process (client and the emulator's threads together).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPO = "acme/tiny-gemma4"
COMMIT = "1" * 40


def point(server, cache: Path) -> None:
    from huggingface_hub import constants

    os.environ["GEMMA4ENC_CACHE"] = str(cache / "vision")
    constants.HF_HUB_CACHE = str(cache / "hf")
    constants.ENDPOINT = server.url
    constants.HUGGINGFACE_CO_URL_TEMPLATE = server.url + "/{repo_id}/resolve/{revision}/{filename}"


def old_way(repo: str) -> None:
    """What model._hub_files did before: whole files through hf_hub_download."""
    from huggingface_hub import hf_hub_download

    from gemma4enc.model.layouts import INDEX, SINGLE, is_vision

    hf_hub_download(repo, "config.json")
    try:
        index = json.loads(Path(hf_hub_download(repo, INDEX)).read_text())
        files = sorted({f for k, f in index["weight_map"].items() if is_vision(k)})
    except Exception:  # noqa: BLE001 - no index: one file
        files = [SINGLE]
    for file in files:
        hf_hub_download(repo, file)


def measure(folder: Path, ranges: bool, way: str, work: Path) -> dict:
    from gemma4enc.model import hub
    from tests.hub_server import HubServer

    with HubServer(ranges=ranges) as server:
        server.add(REPO, folder, COMMIT)
        point(server, Path(tempfile.mkdtemp(dir=work)))
        cpu = time.process_time()
        if way == "old":
            old_way(REPO)
        else:
            hub.fetch(REPO, log=lambda m: None)
        cpu = time.process_time() - cpu
        return {"served_bytes": sum(server.served.values()), "weight_bytes": server.weight_bytes(),
                "requests": len(server.requests), "cpu_s": round(cpu, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from tests.hub_server import build_checkpoint, headers_and_vision

    work = Path(tempfile.mkdtemp(prefix="hub-bytes-"))
    report = {}
    for layout, shard in (("sharded", "1MB"), ("single", "1GB")):
        folder = work / layout
        build_checkpoint(folder, seed=5, shard_size=shard)
        header_bytes, vision_bytes, _ = headers_and_vision(folder)
        files = sorted(folder.glob("*.safetensors"))
        row = {"weight_files": len(files), "weight_bytes": sum(p.stat().st_size for p in files),
               "vision_bytes": vision_bytes, "vision_headers": header_bytes}
        for name, ranges, way in (("whole_files_before", True, "old"), ("ranges_now", True, "new"),
                                  ("no_range_server", False, "new")):
            row[name] = measure(folder, ranges, way, work)
        report[layout] = row
        print(f"{layout}: {json.dumps(row)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
