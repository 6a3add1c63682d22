"""Concurrency and overload against real `graphinfer serve tiny-llama` processes on loopback.

tiny-llama has random weights and no tokenizer, so prompts are token ids and `ignore_eos` makes every
request generate exactly max_tokens: what is checked is the server's bookkeeping, not the text.
"""
import asyncio
import random
import time

import httpx
import pytest

from server_utils import assert_openai_error, metric, metric_samples, running_servers, sse_events

NUM_CLIENTS, NUM_EARLY, MAX_NUM_SEQS = 64, 16, 16


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with running_servers({
        "load": ["tiny-llama", "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", "512"],
        "small": ["tiny-llama", "--max-waiting-requests", "0", "--max-num-seqs", "2", "--max-model-len", "256"],
    }, tmp_path_factory.mktemp("servers")) as launched:
        yield launched


async def _metrics(client: httpx.AsyncClient) -> dict:
    r = await client.get("/metrics")
    assert r.status_code == 200
    return metric_samples(r.text)


def test_concurrent_streams_with_early_disconnects(servers):
    server = servers["load"].wait_ready(120)
    rng = random.Random(0)
    jobs = [dict(prompt=[rng.randrange(1, 512) for _ in range(rng.randint(4, 48))],
                 max_tokens=64 if i % 4 == 0 else rng.randint(32, 64), early=i % 4 == 0)
            for i in range(NUM_CLIENTS)]
    assert sum(j["early"] for j in jobs) == NUM_EARLY

    async def one(client, job):
        body = {"prompt": job["prompt"], "max_tokens": job["max_tokens"], "ignore_eos": True, "stream": True,
                "logprobs": 0, "temperature": 0.8, "stream_options": {"include_usage": True}}
        lines = []
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)
                if job["early"] and len(lines) >= 3:
                    return lines  # leaving the block closes the connection mid-stream
        return lines

    async def watch(client, stop: asyncio.Event, seen: dict):
        while not stop.is_set():
            m = await _metrics(client)
            seen["running"] = max(seen["running"], metric(m, "graphinfer:num_requests_running"))
            seen["waiting"] = max(seen["waiting"], metric(m, "graphinfer:num_requests_waiting"))
            await asyncio.sleep(0.05)

    async def main():
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 8, max_keepalive_connections=NUM_CLIENTS + 8)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
            stop, seen = asyncio.Event(), {"running": 0, "waiting": 0}
            watcher = asyncio.create_task(watch(client, stop, seen))
            t0 = time.monotonic()
            results = await asyncio.wait_for(
                asyncio.gather(*(one(client, j) for j in jobs), return_exceptions=True), 120)
            took = time.monotonic() - t0
            stop.set()
            await watcher

            # every aborted request freed its KV blocks and left the scheduler
            deadline, m = time.monotonic() + 30, {}
            while time.monotonic() < deadline:
                m = await _metrics(client)
                finished = sum(metric(m, "graphinfer:request_success_total", finished_reason=r)
                               for r in ("stop", "length", "abort"))
                if (metric(m, "graphinfer:kv_cache_usage_perc") == 0 and finished == NUM_CLIENTS
                        and metric(m, "graphinfer:num_requests_running") == 0
                        and metric(m, "graphinfer:num_requests_waiting") == 0):
                    break
                await asyncio.sleep(0.2)
            health = (await client.get("/health")).status_code
            return results, seen, m, took, health

    results, seen, m, took, health = asyncio.run(main())
    errors = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert not errors, errors[:3]

    for job, lines in zip(jobs, results):
        if job["early"]:
            assert len(lines) == 3
            continue
        events, done = sse_events(lines)
        assert done, lines[-3:]
        *chunks, usage = events
        assert usage["choices"] == [] and usage["usage"] == {
            "prompt_tokens": len(job["prompt"]), "completion_tokens": job["max_tokens"],
            "total_tokens": len(job["prompt"]) + job["max_tokens"]}
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == job["max_tokens"]

    # bounded: never more than max_num_seqs running, and the rest queued
    assert 0 < seen["running"] <= MAX_NUM_SEQS, seen
    assert seen["waiting"] > 0, seen

    assert metric(m, "graphinfer:kv_cache_usage_perc") == 0, m
    assert metric(m, "graphinfer:num_requests_running") == 0 and metric(m, "graphinfer:num_requests_waiting") == 0
    length = metric(m, "graphinfer:request_success_total", finished_reason="length")
    aborts = metric(m, "graphinfer:request_success_total", finished_reason="abort")
    # Each request is counted once; the early disconnects as aborts (unless one had already finished).
    assert length + aborts == NUM_CLIENTS, (length, aborts)
    assert 1 <= aborts <= NUM_EARLY and length >= NUM_CLIENTS - NUM_EARLY
    assert metric(m, "graphinfer:http_requests_total", endpoint="/v1/completions", status="200") == NUM_CLIENTS
    assert health == 200
    assert took < 120
    print(f"\n64 streams in {took:.1f} s; max running {seen['running']:.0f}, max waiting {seen['waiting']:.0f}; "
          f"finished: length={length:.0f} abort={aborts:.0f}")


def test_overload_answers_503_with_retry_after(servers):
    server = servers["small"].wait_ready(120)
    n = 12

    async def one(client, i):
        body = {"prompt": [1, 2, 3, i + 4], "max_tokens": 200, "ignore_eos": True, "stream": i % 2 == 1}
        r = await client.post("/v1/completions", json=body)
        return r

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            responses = await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(n))), 120)
            after = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
            health = await client.get("/health")
            m = await _metrics(client)
            return responses, after, health, m

    responses, after, health, m = asyncio.run(main())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503}, statuses
    rejected = [r for r in responses if r.status_code == 503]
    assert rejected and statuses.count(200) >= 2, statuses
    for r in rejected:
        err = assert_openai_error(r, 503)
        assert err["type"] == "ServiceUnavailableError" and "overloaded" in err["message"]
        assert r.headers.get("retry-after") == "1"
    for r in responses:
        if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
            events, done = sse_events(r.text.splitlines())
            assert done and events[-1]["choices"][0]["finish_reason"] == "length"
        elif r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 200

    assert after.status_code == 200 and health.status_code == 200
    print(f"\noverload: {statuses.count(200)} x 200, {len(rejected)} x 503")
    assert metric(m, "graphinfer:http_requests_total", endpoint="/v1/completions", status="503") == len(rejected)
    assert not [k for k in m if k[0] == "graphinfer:http_requests_total" and dict(k[1])["status"].startswith("5")
                and dict(k[1])["status"] != "503"]
