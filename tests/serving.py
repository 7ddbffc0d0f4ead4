"""A live `ellm serve` in a subprocess on loopback, for the server's tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx

KEY = "test-key-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, model: str):
        self.proc, self.port, self.model = proc, port, model
        self.url = f"http://127.0.0.1:{port}"

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=300, **kw)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}


@contextmanager
def live_server(artifact, *args: str, model: str = "smollm2", threads: int = 2):
    port = free_port()
    cmd = [sys.executable, "-m", "ellm", "serve", str(artifact), "--port", str(port), "--api-key", KEY,
           "--model-id", model, "--threads", str(threads), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ellm serve exited with {proc.returncode}: {proc.stdout.read()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError("ellm serve did not come up in 120 s")
            time.sleep(0.2)
        yield Server(proc, port, model)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
