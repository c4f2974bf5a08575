"""scripts/serve.py under faults: bad command lines, more waiting requests than
--max-waiting-requests (503 at once, nothing lost), and an exception inside an engine step
(fault_server.py: serve.py whose engine fails a step that holds a prompt with its marker): the
requests of that step end with an error, the server serves on, nothing hangs, and SIGINT still
exits cleanly. One server with server_helpers' engine (ENGINE_ARGS: the programs test_serve.py's
server and truth compiled, from the session's compile cache) and 2 waiting requests at most; the
step-fault test stops it, so it comes last."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import pytest

openai = pytest.importorskip("openai")

from fault_server import MARKER  # noqa: E402
from server_helpers import (ENGINE_ARGS, FAULT_SERVER, SERVE, RawStream,  # noqa: E402
                            ServerProcess, check_error, engine_options, request, wait_until)

ARGS = (*ENGINE_ARGS, "--max-waiting-requests", "2")
MAX_NUM_SEQS = engine_options()["max_num_seqs"]
LONG = {"prompt": "Once", "max_tokens": 450, "ignore_eos": True, "stream": True}
SHORT = {"prompt": "Paris is", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess(*ARGS, script=FAULT_SERVER)
    try:
        yield srv
    finally:
        srv.close()


def health(server: ServerProcess) -> tuple[int, dict[str, Any]]:
    return request(server.port, "GET", "/health", timeout=10)


def test_bad_command_lines() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for args, needle in ((["--port", str(port)], "cannot listen"),
                             (["--max-waiting-requests", "-1"], "--max-waiting-requests"),
                             (["--max-num-seqs", "0"], "error: --max-num-seqs must be"),
                             (["--api-key", ""], "--api-key")):
            r = subprocess.run([sys.executable, str(SERVE), *args], capture_output=True, text=True,
                               timeout=120)
            assert r.returncode == 2, r.stderr
            assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and needle in r.stderr


def test_overload_is_503_at_once_and_nothing_is_lost(server: ServerProcess) -> None:
    port = server.port
    streams = []
    for _ in range(MAX_NUM_SEQS):  # fill the batch, each stream running before the next comes
        streams.append(RawStream(port, "/v1/completions", LONG))
        assert next(streams[-1].events()) != "[DONE]"
    assert health(server)[1]["num_requests_running"] == MAX_NUM_SEQS
    with ThreadPoolExecutor(2) as pool:  # two wait for a slot: the limit
        waiting = [pool.submit(request, port, "POST", "/v1/completions", SHORT) for _ in range(2)]
        wait_until(lambda: health(server)[1]["num_requests_waiting"] == 2, timeout=10)
        start = time.monotonic()
        status, body = request(port, "POST", "/v1/completions", SHORT)
        assert status == 503 and time.monotonic() - start < 1.0
        assert check_error(body)["code"] == "overloaded"
        for s in streams:  # disconnect: the waiting ones get the batch
            s.close()
        answers = [f.result(timeout=120) for f in waiting]
    alone = openai.OpenAI(base_url=server.base_url, api_key="any key works without --api-key",
                          max_retries=0).completions.create(model="SmolLM2-135M-Instruct", **SHORT)
    for status, body in answers:
        assert status == 200, body
        assert body["choices"][0]["text"] == alone.choices[0].text
        assert body["usage"] == alone.usage.model_dump(exclude_none=True) and body["usage"]["completion_tokens"] == SHORT["max_tokens"]
    code, h = health(server)
    assert code == 200 and h["num_free_kv_blocks"] == h["num_kv_blocks"] - 1


def test_step_fault_fails_its_request_and_the_server_serves_on(server: ServerProcess) -> None:
    """An exception inside the step that runs the marked request fails that request alone (a
    500 naming no exception), the stream running beside it in the same step fails with it (an
    error chunk, then [DONE]), /health stays 200, later requests get their usual answers, every
    KV block is free again, and SIGINT still exits cleanly. Last: it stops the server."""
    port, start = server.port, time.monotonic()
    victim = RawStream(port, "/v1/completions", LONG)
    events = victim.events()
    assert next(events) != "[DONE]"
    marked = {**SHORT, "prompt": f"{MARKER}: {SHORT['prompt']}"}
    status, body = request(port, "POST", "/v1/completions", marked, timeout=30)
    assert status == 500 and check_error(body)["code"] == "step_failed"
    assert "injected" not in body["error"]["message"] and "Error" not in body["error"]["message"]
    rest = list(events)  # it shared the failed step: an error chunk, then [DONE]
    assert rest[-1] == "[DONE]" and '"step_failed"' in rest[-2]
    code, h = health(server)
    assert code == 200 and h["status"] == "ok"
    alone = openai.OpenAI(base_url=server.base_url, api_key="any", max_retries=0
                          ).completions.create(model="SmolLM2-135M-Instruct", **SHORT)
    for _ in range(2):
        status, body = request(port, "POST", "/v1/completions", SHORT, timeout=60)
        assert status == 200 and body["choices"][0]["text"] == alone.choices[0].text
    wait_until(lambda: (lambda h: h["num_free_kv_blocks"] == h["num_kv_blocks"] - 1)(health(server)[1]),
               timeout=10)
    assert time.monotonic() - start < 60
    assert server.stop(signal.SIGINT, timeout=10) == 0
    log = server.stderr()
    assert "KeyboardInterrupt" not in log and log.count("Traceback") == 1  # the engine's, logged
    assert "injected step fault" in log
