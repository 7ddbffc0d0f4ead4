"""A live `ellm serve` in a subprocess on loopback, for the server's tests."""

from __future__ import annotations

from contextlib import contextmanager

from ellm.bench.serve import ServerProcess, server_process

KEY = "test-key-123"


class Server:
    def __init__(self, proc: ServerProcess):
        self.proc, self.url, self.model = proc, proc.url, proc.model

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=300, **kw)

    def metrics(self) -> dict[str, float]:
        return self.proc.metrics()


@contextmanager
def live_server(artifact, *args: str, model: str = "smollm2", threads: int = 2):
    with server_process(artifact, *args, model=model, key=KEY, threads=threads) as proc:
        yield Server(proc)
