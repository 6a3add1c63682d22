"""Memory returned to the OS after a costly request (issue 51): a real `graphinfer serve` of the bundled SmolLM2 with
GRAPHINFER_CPU_RETAIN_FREED_MEMORY=0, its RSS (front end + engine core) measured before, during and after a request
of many logprob entries (allowed: within --max-logprob-entries)."""
import os
import threading
import time

import httpx
import pytest

from server_utils import Server

psutil = pytest.importorskip("psutil")
MiB = 2**20
RETAIN = os.environ.get("GRAPHINFER_TEST_RETAIN_FREED_MEMORY", "0")  # 1: shows the bound fails when memory is kept
# n x max_tokens x (logprobs + 1) = 21,504 entries; each choice's step is batch x vocab floats in the core, each entry
# Python objects and JSON in the front end
SPIKE = {"prompt": "hi", "n": 32, "logprobs": 20, "max_tokens": 32, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    # A KV cache of 128 blocks of 16 tokens, its pages committed by the warm-up below, not by the idle-priority thread
    # (on a busy machine it had not finished before the baseline, and the pages it mapped later looked like memory
    # kept). 16, not the cpu default of 64: the warm-up's 2 x 32 sequences of 3 blocks must cover every block.
    s = Server(["--dtype", "float32", "--max-model-len", "1024", "--num-gpu-blocks-override", "128",
                "--block-size", "16"],
               tmp_path_factory.mktemp("rss") / "server.log",
               env={"GRAPHINFER_CPU_RETAIN_FREED_MEMORY": RETAIN, "GRAPHINFER_CPU_POPULATE_KV_CACHE": "0"}).launch()
    try:
        yield s.wait_ready(300)
    finally:
        s.stop()


def _rss(proc) -> int:
    """The server's RSS: the front end and its engine-core process."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _settled(proc, timeout=30.0) -> int:
    """RSS once it stops moving (the KV cache's pages are committed by a thread; trims run as the server idles)."""
    last, deadline = _rss(proc), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = _rss(proc)
        if abs(now - last) < MiB:
            return now
        last = now
    return last


def test_rss_after_a_spike_returns_within_a_bound(server):
    proc = psutil.Process(server.proc.pid)
    with httpx.Client(base_url=server.url, timeout=300) as http:
        # warm-up: the first requests' one-time allocations, a small logprobs request; the spike's shape without
        # logprobs twice, which writes every KV block (2 x 32 x 3 > 128)
        for body in ({"prompt": "hi", "max_tokens": 4, "n": 2, "logprobs": 1},
                     {**SPIKE, "logprobs": None}, {**SPIKE, "prompt": "ho", "logprobs": None}):
            assert http.post("/v1/completions", json=body).status_code == 200
        baseline = _settled(proc)
        peak, stop = [baseline], threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], _rss(proc))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            r = http.post("/v1/completions", json=SPIKE)
        finally:
            stop.set()
            sampler.join()
        assert r.status_code == 200, r.text[:300]
        assert len(r.json()["choices"]) == SPIKE["n"]
        del r
    after = _settled(proc)
    grew, kept = (peak[0] - baseline) / MiB, (after - baseline) / MiB
    print(f"RSS baseline {baseline / MiB:.1f} MiB, peak +{grew:.1f}, after +{kept:.1f} (retain={RETAIN})")
    assert grew > 20, "the request should grow RSS, or the bound below tells nothing"
    # Measured on the busy 2-core dev VM (fp32 SmolLM2): retention off, baseline 1767 MiB, peak +1261 (the freed
    # activations are mapped again each step), after +7.7; retention on, baseline 2082 (the warm-up's peak kept),
    # peak +22.7, after +19.6 (an earlier setup: +75 / +68): kept is most of the growth, and this fails.
    assert kept <= 0.4 * grew, f"RSS after the spike: +{kept:.1f} MiB of a +{grew:.1f} MiB peak kept"
