"""scripts/serve.py in a subprocess on a free loopback port, and small raw-HTTP helpers (the
`openai` client hides status codes and disconnects; these do not)."""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

SERVE = Path(__file__).resolve().parents[2] / "scripts" / "serve.py"
FAULT_SERVER = Path(__file__).resolve().parent / "fault_server.py"  # serve.py with a step fault
API_KEY = "test-key"
# small engine: short contexts, an 8-sequence batch, 8-token steps (chunked prefill), a fixed KV
# cache (no memory profiling, so the in-process truth and the server build the same engine on any
# device). One config for every server module and the truth: their step programs are the same,
# so each compiles once per session (the shared compile cache), and the small batch and steps
# make few of them (token and sample buckets 4 and 8)
ENGINE_ARGS = ("--max-num-seqs", "8", "--max-model-len", "512", "--max-num-batched-tokens", "8",
               "--num-kv-blocks", "257")


def engine_options(args: tuple[str, ...] = ENGINE_ARGS) -> dict[str, int]:
    """`LLM(**engine_options())`: the engine ENGINE_ARGS give a server."""
    it = iter(args)
    return {flag[2:].replace("-", "_"): int(value) for flag, value in zip(it, it)}


class ServerProcess:
    """`serve.py --port 0 ARGS` (it prints the port it bound; `script`: another launcher of the
    same command line); `stop()` sends a signal and returns the exit status. stderr goes to a
    file (`stderr()`), so a chatty server never blocks on a full pipe. The constructor waits
    until /health answers; with `wait=False` it returns at once, and `wait_ready()` waits (the
    caller works meanwhile while the server imports and loads its model)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, timeout: float = 300.0,
                 script: Path = SERVE, wait: bool = True) -> None:
        self._log = tempfile.NamedTemporaryFile(prefix="serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, str(script), "--port", "0", *args],
                                     stdout=subprocess.DEVNULL, stderr=self._log,
                                     env={**os.environ, **(env or {})})
        self.port, self.base_url = 0, ""
        if wait:
            self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Wait for the port the server prints, then for /health to answer 200."""
        deadline = time.monotonic() + timeout
        self.port = 0
        while not self.port:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"serve.py did not start:\n{self.stderr()}")
            m = re.search(r"serving .* on http://[^:]+:(\d+)/v1", self.stderr())
            self.port = int(m.group(1)) if m else 0
            time.sleep(0.2)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        while True:  # the socket is bound before the model loads; /health answers once it serves
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"serve.py did not become healthy:\n{self.stderr()}")
            try:
                if request(self.port, "GET", "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)

    def stderr(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        self.kill()
        self._log.close()
        os.unlink(self._log.name)


def request(port: int, method: str, path: str, body: bytes | dict[str, Any] | None = None,
            headers: dict[str, str] | None = None, timeout: float = 60.0) -> tuple[int, Any]:
    """(status, parsed JSON body or text) of one HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    try:
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        raw = resp.read().decode()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(raw)
    except json.JSONDecodeError:
        return resp.status, raw


def auth(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class RawStream:
    """A streaming POST read event by event; `close()` drops the connection mid-stream."""

    def __init__(self, port: int, path: str, body: dict[str, Any], key: str = API_KEY,
                 timeout: float = 60.0) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        self.conn.request("POST", path, body=json.dumps(body).encode(),
                          headers={"Content-Type": "application/json", **auth(key)})
        self.resp = self.conn.getresponse()

    def events(self) -> Iterator[str]:
        """Each `data:` payload, up to and including `[DONE]`."""
        while True:
            line = self.resp.readline()
            if not line:
                return
            line = line.decode().strip()
            if line.startswith("data: "):
                yield line[len("data: "):]

    def close(self) -> None:
        self.resp.close()
        self.conn.close()


def metric(text: str, name: str) -> float:
    """The value of an unlabelled-but-for-model_name sample of `name` in Prometheus text."""
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+-]+)$", text, flags=re.M)
    if m is None:
        raise KeyError(name)
    return float(m.group(1))


def wait_until(predicate: Any, timeout: float, interval: float = 0.05) -> float:
    """Seconds until `predicate()` held; raises TimeoutError after `timeout`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"condition not met within {timeout}s")
        time.sleep(interval)
    return time.monotonic() - start


def check_error(body: Any, param: str | None = None) -> dict[str, Any]:
    """The error object of an OpenAI error body, checked for its four fields."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    return err
