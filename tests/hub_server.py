"""A Hugging Face hub on loopback, for the tests: the endpoints huggingface_hub calls, over real
HTTP in a thread, counting the body bytes it serves.

- GET /api/models/{org}/{name}[/revision/{rev}] → {"id", "sha", "siblings"} (HfApi.model_info)
- HEAD / GET /{org}/{name}/resolve/{rev}/{file} → ETag, X-Repo-Commit, Content-Length, and with
  `Range: bytes=a-b` a 206 with Content-Range (unless `ranges` is off: then 200 and the whole file)
- errors as the hub sends them: 404 + X-Error-Code RepoNotFound / RevisionNotFound / EntryNotFound,
  401 + GatedRepo
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/(.+))?$")
RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class HubServer:
    """repos: repo id → {"refs": {name: commit}, "commits": {commit: {file: bytes}}}."""

    def __init__(self, ranges: bool = True, api: bool = True):
        self.repos: dict[str, dict] = {}
        self.api = api  # off: /api/models/... is a bare 404, as on a mirror that only serves files
        self.gated: set[str] = set()
        self.ranges = ranges
        self.cut_after: int | None = None  # the next ranged weight GET closes after this many body bytes (once)
        self.served: Counter = Counter()  # file name → body bytes sent
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self.lock = threading.Lock()
        self.httpd = _Quiet(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def add(self, repo_id: str, folder: Path, commit: str, ref: str = "main") -> None:
        repo = self.repos.setdefault(repo_id, {"refs": {}, "commits": {}})
        repo["commits"][commit] = {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}
        repo["refs"][ref] = commit

    def weight_bytes(self) -> int:
        return sum(n for name, n in self.served.items() if name.endswith(".safetensors"))

    def reset(self) -> None:
        self.served.clear()
        self.requests.clear()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


class _Quiet(ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # a client that hangs up early is not an error here
        pass


def _handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the real hub: httpx reuses its connections

        def log_message(self, *args):  # quiet: pytest shows failures, not access logs
            pass

        def do_GET(self):
            self._answer(body=True)

        def do_HEAD(self):
            self._answer(body=False)

        def _error(self, status: int, code: str) -> None:
            body = json.dumps({"error": f"{code}: {self.path}"}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _commit(self, repo_id: str, rev: str | None):
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound"), None
            if repo_id in hub.gated:
                return self._error(401, "GatedRepo"), None
            commit = repo["refs"].get(rev or "main", rev)
            if commit not in repo["commits"]:
                return self._error(404, "RevisionNotFound"), None
            return commit, repo["commits"][commit]

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            with hub.lock:
                hub.requests.append((self.command, path, self.headers.get("Range")))
            if not hub.api and path.startswith("/api/"):
                return self._error(404, "NotFound")
            if m := API.match(path):
                commit, files = self._commit(m.group(1), m.group(2))
                if files is not None:
                    info = {"id": m.group(1), "sha": commit,
                            "siblings": [{"rfilename": name, "size": len(data)} for name, data in files.items()]}
                    self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body, "api")
                return
            if m := RESOLVE.match(path):
                commit, files = self._commit(m.group(1), m.group(2))
                if files is None:
                    return
                name = m.group(3)
                if name not in files:
                    return self._error(404, "EntryNotFound")
                return self._file(name, files[name], commit, body)
            self._error(404, "RepoNotFound")

        def _file(self, name: str, data: bytes, commit: str, body: bool) -> None:
            headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": commit,
                       "Content-Type": "application/octet-stream"}
            if hub.ranges:
                headers["Accept-Ranges"] = "bytes"
            wanted = RANGE.match(self.headers.get("Range") or "")
            if not (hub.ranges and wanted):
                return self._send(200, data, headers, body, name)
            start = int(wanted.group(1))
            end = min(int(wanted.group(2)) + 1 if wanted.group(2) else len(data), len(data))
            if start >= len(data):
                return self._error(416, "RangeNotSatisfiable")
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
            cut = None
            if body and name.endswith(".safetensors") and hub.cut_after is not None and end - start > hub.cut_after:
                cut, hub.cut_after = hub.cut_after, None
            self._send(206, data[start:end], headers, body, name, cut=cut)

        def _send(self, status, data: bytes, headers: dict, body: bool, name: str, cut: int | None = None) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not body:
                return
            sent = 0
            limit = len(data) if cut is None else cut
            try:
                while sent < limit:
                    n = min(64 << 10, limit - sent)
                    self.wfile.write(data[sent: sent + n])
                    sent += n
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client stopped reading (a whole file it needs only the start of)
            finally:
                with hub.lock:
                    hub.served[name] += sent
            if cut is not None:  # the connection dies mid-body, as a flaky network does
                self.close_connection = True
                self.connection.shutdown(2)

    return Handler


def build_checkpoint(folder: Path, seed: int = 0, shard_size: str = "1MB"):
    """A tiny Gemma 4 whose language model holds most bytes (a wide vocabulary), saved by
    transformers in shards with an index, as the released 26B/31B are."""
    from transformers import Gemma4ForConditionalGeneration

    from gemma4enc.dev import demo

    config = demo.tiny_config(clipped=True, standardize=True)
    config.text_config.vocab_size = config.text_config.vocab_size_per_layer_input = 65536
    model = Gemma4ForConditionalGeneration(config).eval()
    demo.randomize_(model, seed)
    model.save_pretrained(folder, max_shard_size=shard_size)
    return model


def headers_and_vision(folder: Path) -> tuple[int, int, dict]:
    """Of the files holding vision tensors: their headers' bytes, their vision bytes, the tensors."""
    from safetensors import safe_open

    from gemma4enc.model.layouts import is_vision

    header_bytes = vision_bytes = 0
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            keys = [k for k in f.keys() if is_vision(k)]
            for key in keys:
                tensors[key] = f.get_tensor(key)
        if keys:
            with open(path, "rb") as raw:
                header_bytes += 8 + struct.unpack("<Q", raw.read(8))[0]
            vision_bytes += sum(t.numel() * t.element_size() for k, t in tensors.items() if k in keys)
    return header_bytes, vision_bytes, tensors
