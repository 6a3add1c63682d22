"""`graphinfer serve` start-up and shutdown, as real tiny-llama processes on loopback (all started together).

- SIGTERM with nothing in flight: a prompt exit with status 0 (SIGINT: the last test of test_server.py, on its
  tiny-qwen3-moe server, not a server of its own here).
- SIGTERM with requests in flight that finish inside --shutdown-timeout: new requests get 503 meanwhile, the
  requests in flight complete normally, status 0, no KV-cache block left in use. (Past the timeout: the last
  test of test_server.py.)
- The banner prints once the server answers; a busy port is one error line and a non-zero exit.
"""
import re
import signal
import socket
import subprocess
import threading
import time

import httpx

from server_utils import GRAPHINFER, assert_openai_error, metric, metric_samples, running_servers, sse_events

import pytest

MAX_TOKENS = 500


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with running_servers({
        "idle": ["tiny-llama", "--max-model-len", "256"],
        # two at a time, so that of four requests two wait in the queue when the signal comes
        "drain": ["tiny-llama", "--max-model-len", "1024", "--max-num-seqs", "2", "--shutdown-timeout", "120"],
    }, tmp_path_factory.mktemp("servers")) as launched:
        yield launched


def _exit_status(server, timeout: float) -> tuple[int | None, float]:
    t0 = time.monotonic()
    try:
        return server.proc.wait(timeout), time.monotonic() - t0
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - t0


def test_banner_after_the_port_answers_then_sigterm_idle(servers):
    server = servers["idle"]
    deadline = time.monotonic() + 180
    while "graphinfer is serving" not in server.log() and time.monotonic() < deadline:
        assert server.proc.poll() is None, server.log()[-3000:]
        time.sleep(0.05)
    # the banner is printed once the server answers: the very next request gets through
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=60)
    assert r.status_code == 200
    server.proc.send_signal(signal.SIGTERM)
    rc, took = _exit_status(server, 20)
    assert rc == 0, (rc, server.log()[-2000:])
    assert took < 10, took
    log = server.log()
    assert "Traceback" not in log and "KV-cache blocks in use: 0" in log, log[-2000:]


def test_sigterm_drains_requests_in_flight(servers):
    """Four 500-token requests (three streams, one not), two running and two queued, when SIGTERM comes. While
    they drain, /health and new requests get 503; all four then complete normally; the exit status is 0."""
    server = servers["drain"].wait_ready(180)
    lines, whole, errors = {i: [] for i in range(3)}, {}, []

    def stream(i):
        body = {"prompt": [1, 2, 3, i + 4], "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    lines[i].append(line)
        except httpx.HTTPError as e:
            errors.append(e)

    def not_streamed():
        body = {"prompt": [5, 6, 7], "max_tokens": MAX_TOKENS, "ignore_eos": True}
        try:
            whole["r"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        except httpx.HTTPError as e:
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(3)]
    threads.append(threading.Thread(target=not_streamed, daemon=True))
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sum(bool(v) for v in lines.values()) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    while time.monotonic() < deadline:  # all four arrived (two running, two queued): a sleep raced on a busy host
        samples = metric_samples(httpx.get(f"{server.url}/metrics", timeout=10).text)
        if sum(metric(samples, f"graphinfer:num_requests_{s}") for s in ("running", "waiting")) >= 4:
            break
        time.sleep(0.01)
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 60  # a server that never starts draining fails the 503 check below, not hangs
    while httpx.get(f"{server.url}/health", timeout=10).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.01)
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1], "max_tokens": 2}, timeout=10)
    assert_openai_error(refused, 503)
    assert any(t.is_alive() for t in threads), "everything finished before the drain could be observed"
    rc, took = _exit_status(server, 120)
    assert rc == 0, (rc, server.log()[-3000:])
    for t in threads:
        t.join(10)
    assert not errors, errors
    for i in range(3):
        events, done = sse_events(lines[i])
        assert done and events[-1]["usage"]["completion_tokens"] == MAX_TOKENS, (i, events[-2:])
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert whole["r"].status_code == 200 and whole["r"].json()["usage"]["completion_tokens"] == MAX_TOKENS
    log = server.log()
    assert re.search(r"4 request\(s\) finished while draining, 0 ended at the shutdown timeout; "
                     r"KV-cache blocks in use: 0", log), log[-2000:]
    assert "Traceback" not in log


def test_busy_port_is_one_error_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        res = subprocess.run([GRAPHINFER, "serve", "tiny-llama", "--host", "127.0.0.1", "--port", str(port)],
                             capture_output=True, text=True, timeout=120)
    out = [line for line in (res.stdout + res.stderr).splitlines() if line.strip()]
    assert res.returncode != 0 and len(out) == 1, (res.returncode, out)
    assert "already in use" in out[0] and str(port) in out[0], out
    print(f"\nbusy port: exit {res.returncode} after {time.monotonic() - t0:.1f} s: {out[0]}")
