"""Load on `ellm serve`: the streaming overhead against `ellm run` on the same prompt, and a soak of mixed
requests that watches the server's resident memory. Both drive a real server process over loopback."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # the model keeps counting: decodes that run to max_tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    model: str
    key: str | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def rss(self) -> int:
        """The server's resident memory, bytes."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def metrics(self) -> dict[str, float]:
        import httpx

        text = httpx.get(self.url + "/metrics", headers=self.headers).text
        return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}


@contextmanager
def server_process(artifact, *args: str, model: str = "model", key: str | None = None,
                   threads: int | None = None) -> Iterator[ServerProcess]:
    """`ellm serve ARTIFACT ARGS` on a free loopback port, up (its /health answers) until the block ends."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "ellm", "serve", str(artifact), "--port", str(port), "--model-id", model, *args]
    if key:
        cmd += ["--api-key", key]
    if threads:
        cmd += ["--threads", str(threads)]
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
        yield ServerProcess(proc, port, model, key)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def stream_decode_rate(server: ServerProcess, prompt: str, n: int) -> tuple[float, float]:
    """Decode tokens/s as a streaming client sees it (chunks after the first over the time between the first
    and the last: counting gives one chunk per token), and as the server's engine measured it (`timings`)."""
    import httpx

    body = {"model": server.model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    times, engine = [], float("nan")
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"timings"' in line:
                engine = float(json.loads(line[6:])["timings"]["predicted_per_second"])
            elif line.startswith("data: {") and '"text":""' not in line:
                times.append(time.perf_counter())
    if len(times) < 2:
        raise RuntimeError("the stream carried fewer than two tokens")
    return (len(times) - 1) / (times[-1] - times[0]), engine


def run_decode_rate(artifact, prompt: str, n: int, threads: int | None) -> float:
    """Decode tokens/s of `ellm run --json` on the same prompt (its own count: tokens after the first)."""
    cmd = [sys.executable, "-m", "ellm", "run", str(artifact), "-p", prompt, "-n", str(n), "--json"]
    if threads:
        cmd += ["--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)["decode_tok_s"])


def overhead(artifact, rounds: int = 5, tokens: int = 256, threads: int | None = None) -> dict:
    """Alternate `ellm run` (a fresh process each time, as a user runs it) and a streaming request to a warm
    server, `rounds` times each. The server's own engine rate separates the HTTP path's cost from warmth."""
    run, served, engine = [], [], []
    with server_process(artifact, "--ctx-size", "2048", threads=threads) as server:
        stream_decode_rate(server, COUNTING, 16)  # warm-up
        for _ in range(rounds):
            run.append(run_decode_rate(artifact, COUNTING, tokens, threads))
            client, eng = stream_decode_rate(server, COUNTING, tokens)
            served.append(client)
            engine.append(eng)
    ratios = [s / r for s, r in zip(served, run)]
    return {"tokens": tokens, "rounds": rounds, "threads": threads, "run_tok_s": run, "served_tok_s": served,
            "server_engine_tok_s": engine, "run_median": statistics.median(run),
            "served_median": statistics.median(served), "ratio_median": statistics.median(ratios), "ratios": ratios,
            "client_over_engine_median": statistics.median(c / e for c, e in zip(served, engine))}


@dataclass
class SoakResult:
    requests: int
    kinds: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    rss_after_20: int = 0
    rss_end: int = 0
    rss_growth: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


def _soak_one(server: ServerProcess, kind: str, doc: str, rnd: random.Random) -> str | None:
    """One request of `kind`; an error message, or None."""
    import httpx

    h = server.headers
    q = rnd.choice(["Summarise it.", "What is it about?", "Name one thing it says.", "Is there a warranty?"])
    if kind == "short":
        body = {"model": server.model, "messages": [{"role": "user", "content": f"Say a number near {rnd.randint(1, 99)}."}],
                "max_tokens": rnd.randint(4, 32), "temperature": rnd.choice([0, 0.8])}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=h, timeout=600)
        return None if r.status_code == 200 and r.json()["choices"][0]["message"] is not None else f"short: {r.status_code}"
    if kind in ("long", "long_stream"):
        body = {"model": server.model, "messages": [{"role": "user", "content": f"{doc}\n\n{q}"}],
                "max_tokens": rnd.randint(8, 48), "temperature": 0, "stream": kind == "long_stream"}
        if kind == "long":
            r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=h, timeout=600)
            return None if r.status_code == 200 else f"long: {r.status_code} {r.text[:200]}"
        done = False
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=h, timeout=600) as r:
            if r.status_code != 200:
                return f"long_stream: {r.status_code}"
            for line in r.iter_lines():
                done = done or line == "data: [DONE]"
        return None if done else "long_stream: no [DONE]"
    if kind == "stream":
        body = {"model": server.model, "prompt": COUNTING, "max_tokens": rnd.randint(8, 64), "temperature": 0,
                "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=h, timeout=600) as r:
            lines = list(r.iter_lines())
        return None if r.status_code == 200 and "data: [DONE]" in lines else f"stream: {r.status_code}"
    if kind == "cancel":
        body = {"model": server.model, "prompt": COUNTING, "max_tokens": 2000, "temperature": 0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=h, timeout=600) as r:
            if r.status_code != 200:
                return f"cancel: {r.status_code}"
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= rnd.randint(2, 8):
                    break
        return None
    raise ValueError(kind)


def soak(artifact, requests: int = 200, clients: int = 3, doc_tokens: int = 4000, seed: int = 0,
         threads: int | None = None, text: str | None = None) -> SoakResult:
    """`requests` mixed requests from `clients` concurrent clients: short chats, prompts of about
    `doc_tokens` tokens (whole and streamed), streamed completions, and streams dropped mid-way."""
    if text is None:
        import tvm

        text = (Path(tvm.__file__).parent / "LICENSE").read_text()
    rnd = random.Random(seed)
    chars = int(doc_tokens * 4.2)  # English prose: about 4.2 characters a token here
    kinds = rnd.choices(["short", "long", "long_stream", "stream", "cancel"], weights=[5, 1, 1, 2, 1], k=requests)
    docs = [(text * 3)[o : o + chars] for o in (rnd.randrange(0, len(text)) for _ in range(requests))]
    res = SoakResult(requests=requests)
    for k in kinds:
        res.kinds[k] = res.kinds.get(k, 0) + 1
    t0 = time.perf_counter()
    with server_process(artifact, "--ctx-size", str(doc_tokens + 1024), "--slots", "2", "--queue", "32",
                        threads=threads) as server:
        with cf.ThreadPoolExecutor(clients) as pool:
            first = min(20, requests)
            seeds = [rnd.random() for _ in range(requests)]
            jobs = [pool.submit(_soak_one, server, kinds[i], docs[i], random.Random(seeds[i])) for i in range(first)]
            res.errors += [e for e in (j.result() for j in jobs) if e]
            res.rss_after_20 = server.rss()
            jobs = [pool.submit(_soak_one, server, kinds[i], docs[i], random.Random(seeds[i]))
                    for i in range(first, requests)]
            res.errors += [e for e in (j.result() for j in jobs) if e]
        time.sleep(0.5)  # the last cancelled stream reaches the worker
        res.rss_end = server.rss()
        res.metrics = server.metrics()
        if server.proc.poll() is not None:
            res.errors.append(f"the server exited with {server.proc.returncode}")
    res.seconds = time.perf_counter() - t0
    res.rss_growth = res.rss_end / res.rss_after_20 - 1
    return res


def soak_json(res: SoakResult) -> str:
    return json.dumps(asdict(res), indent=1)
