"""The OpenAI-compatible server as a real `graphinfer serve` process on loopback.

One SmolLM2 server (fp32, --max-model-len 256, --async-scheduling, so that the answers are also checked
against the synchronous offline engine) answers the official `openai` client and the bad inputs;
a tiny-llama server with --api-key checks authentication; another tiny-llama server is stopped with SIGTERM.
All three start together at the beginning of the module, so their start-up overlaps.
"""
import math
import signal
import threading
import time

import httpx
import openai
import pytest

import graphinfer
from server_utils import Server, assert_openai_error, metric, metric_samples, running_servers, sse_events

MODEL = "smol"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with running_servers({
        "smol": ["--dtype", "float32", "--max-model-len", "256", "--served-model-name", MODEL, "--async-scheduling"],
        "keyed": ["tiny-llama", "--api-key", "secret", "--max-model-len", "256"],
        "sigterm": ["tiny-llama", "--max-model-len", "1024"],
    }, tmp_path_factory.mktemp("servers")) as launched:
        yield launched


@pytest.fixture(scope="module")
def smol(servers):
    return servers["smol"].wait_ready(180)


@pytest.fixture(scope="module")
def keyed(servers):
    return servers["keyed"].wait_ready(120)


@pytest.fixture(scope="module")
def client(smol):
    with openai.OpenAI(base_url=f"{smol.url}/v1", api_key="EMPTY", timeout=120, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(smol):
    with httpx.Client(base_url=smol.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def greedy_ref(client):
    """The greedy 16-token completion of PROMPT, which several tests compare against."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16
    assert len(r.choices[0].text.split()) >= 3, r.choices[0].text
    return r


# ----- the official openai client -----

def test_models_and_version(smol, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra.get("max_model_len") == 256
    assert httpx.get(f"{smol.url}/version").json() == {"version": graphinfer.__version__}


def test_completion_greedy_stream_equals_non_stream(client, greedy_ref):
    ref = greedy_ref.choices[0]
    assert greedy_ref.object == "text_completion" and greedy_ref.model == MODEL
    assert greedy_ref.usage.prompt_tokens > 0
    assert greedy_ref.usage.total_tokens == greedy_ref.usage.prompt_tokens + 16
    assert ref.index == 0 and ref.text.strip()

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.model_dump() == greedy_ref.usage.model_dump()
    assert all(c.usage is None for c in text_chunks)


def test_chat_greedy_stream_equals_non_stream(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.choices[0].finish_reason in ("stop", "length")
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens > len(CHAT[0]["content"].split())  # the chat template added tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    *deltas, usage_chunk = chunks
    assert deltas[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == msg.content
    assert deltas[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in deltas[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.model_dump() == r.usage.model_dump()


def test_stop_string(client, greedy_ref):
    ref = greedy_ref.choices[0].text
    word = ref.split()[2]  # a stop string that the greedy text reaches after a few tokens
    expected = ref[:ref.index(word)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                  stop=["never-in-the-output-zq", word])
    c = r.choices[0]
    assert (c.text, c.finish_reason) == (expected, "stop")
    assert c.model_extra.get("stop_reason") == word
    assert word not in c.text and r.usage.completion_tokens < 16

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=word,
                                            stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == expected  # held-back text never leaks the stop string
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_stop_string(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    words = text.split()
    if len(words) < 2:
        pytest.skip(f"greedy chat reply too short for a stop string: {text!r}")
    word = words[1]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stop=[word])
    assert r.choices[0].message.content == text[:text.index(word)]
    assert r.choices[0].finish_reason == "stop"


def test_max_tokens_gives_length(client, greedy_ref):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    assert greedy_ref.choices[0].text.startswith(r.choices[0].text)

    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}],
                                       max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_completion_logprobs(client, greedy_ref):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    c = r.choices[0]
    lp = c.logprobs
    n = r.usage.completion_tokens
    assert n == 6
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == c.text and greedy_ref.choices[0].text.startswith(c.text)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3, top
        assert tlp <= 0 and all(v <= 0 and math.isfinite(v) for v in top.values())
        # greedy: the chosen token is the most likely one
        assert top[tok] == pytest.approx(tlp) and tlp == pytest.approx(max(top.values()))

    # streamed, the per-chunk logprobs add up to the same
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                            stream=True))
    tokens = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    lps = [x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    assert tokens == lp.tokens
    assert lps == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert isinstance(e.token, str) and e.logprob <= 0 and e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)

    # without logprobs=True there are none
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    assert r.choices[0].logprobs is None


def test_batch_prompts(client):
    prompts = [PROMPT, "1, 2, 3, 4,", "Hello, my name is"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, logprobs=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") and c.text for c in r.choices)
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts, finish = ["", "", ""], [None, None, None]
    for ch in chunks[:-1]:
        (c,) = ch.choices
        assert finish[c.index] is None, "a chunk after its finish_reason"
        texts[c.index] += c.text
        finish[c.index] = c.finish_reason
    assert texts == [c.text for c in r.choices]
    assert finish == [c.finish_reason for c in r.choices]
    assert chunks[-1].usage.model_dump() == r.usage.model_dump()


def test_token_id_prompt_equals_text_prompt(client, greedy_ref, smollm2_llm):
    ids = smollm2_llm.llm_engine.tokenize(PROMPT)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0)
    assert r.usage.prompt_tokens == greedy_ref.usage.prompt_tokens == len(ids)
    assert r.choices[0].text == greedy_ref.choices[0].text


def test_greedy_equals_offline_llm(smollm2_llm, greedy_ref):
    """The server's greedy text is what graphinfer.LLM generates offline for the same prompt."""
    out = smollm2_llm.generate([PROMPT], graphinfer.SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert out[0].outputs[0].text == greedy_ref.choices[0].text


# ----- bad inputs -----

LONG_TEXT = "hello " * 400  # ~400 tokens, over --max-model-len 256

BAD = [  # (id, path, raw body, expected status)
    ("malformed-json-cmpl", "/v1/completions", '{"model": "smol", "prompt": "hi",', 400),
    ("malformed-json-chat", "/v1/chat/completions", '{"messages": [{"role": "user"', 400),
    ("not-an-object", "/v1/completions", '["prompt"]', 400),
    ("missing-prompt", "/v1/completions", '{"max_tokens": 2}', 400),
    ("max_tokens-str", "/v1/completions", '{"prompt": "hi", "max_tokens": "abc"}', 400),
    ("temperature-list", "/v1/completions", '{"prompt": "hi", "temperature": []}', 400),
    ("messages-not-list", "/v1/chat/completions", '{"messages": "hello"}', 400),
    ("messages-empty", "/v1/chat/completions", '{"messages": []}', 400),
    ("max_tokens-negative", "/v1/completions", '{"prompt": "hi", "max_tokens": -1}', 400),
    ("max_tokens-zero-chat", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', 400),
    ("temperature-negative", "/v1/completions", '{"prompt": "hi", "temperature": -0.5}', 400),
    ("top_p-zero", "/v1/completions", '{"prompt": "hi", "top_p": 0}', 400),
    ("prompt-too-long-text", "/v1/completions", f'{{"prompt": "{LONG_TEXT}", "max_tokens": 2}}', 400),
    ("prompt-too-long-ids", "/v1/completions", f'{{"prompt": {[1] * 400}, "max_tokens": 2}}', 400),
    ("prompt-too-long-chat", "/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "{LONG_TEXT}"}}]}}', 400),
    ("prompt-empty", "/v1/completions", '{"prompt": []}', 400),
    ("prompt-id-out-of-vocab", "/v1/completions", '{"prompt": [1, 1000000000]}', 400),
    ("unknown-model-cmpl", "/v1/completions", '{"model": "nope", "prompt": "hi"}', 404),
    ("unknown-model-chat", "/v1/chat/completions", '{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}', 404),
    ("n-2", "/v1/completions", '{"prompt": "hi", "n": 2}', 400),
    ("n-2-chat", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "n": 2}', 400),
    ("echo", "/v1/completions", '{"prompt": "hi", "echo": true}', 400),
    ("logprobs-21", "/v1/completions", '{"prompt": "hi", "logprobs": 21}', 400),
    ("top_logprobs-21", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}', 400),
    ("stop-empty-string", "/v1/completions", '{"prompt": "hi", "stop": [""]}', 400),
    ("min_tokens-over-max", "/v1/completions", '{"prompt": "hi", "max_tokens": 2, "min_tokens": 3}', 400),
    # regressions: each of these used to answer 500, the first three by killing the engine loop for good
    ("stop_token_id-out-of-vocab", "/v1/completions", '{"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [1000000]}', 400),
    ("stop_token_id-over-int64", "/v1/completions", '{"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [100000000000000000000]}', 400),
    ("temperature-nan", "/v1/completions", '{"prompt": "hi", "max_tokens": 2, "temperature": NaN}', 400),
    ("repetition_penalty-inf", "/v1/completions", '{"prompt": "hi", "max_tokens": 2, "repetition_penalty": Infinity}', 400),
    ("lone-surrogate-prompt", "/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', 400),
    ("lone-surrogate-chat", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}', 400),
    ("lone-surrogate-model", "/v1/completions", '{"model": "\\ud800", "prompt": "hi"}', 400),
]


@pytest.mark.parametrize("path,body,status", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(http, path, body, status):
    resp = http.post(path, content=body.encode(), headers={"content-type": "application/json"})
    err = assert_openai_error(resp, status)
    if status == 404:
        assert err["type"] == "NotFoundError" and "nope" in err["message"]
    else:
        assert err["type"] == "BadRequestError", err


def test_top_k_beyond_the_vocabulary_means_no_top_k(http):
    # used to overflow int64 in the sampler and kill the engine loop; now clamped there, as vLLM does
    resp = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "top_k": 10**20})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2


def test_prompt_too_long_says_why(http):
    err = assert_openai_error(http.post("/v1/completions", json={"prompt": [1] * 400}), 400)
    assert "256" in err["message"] and "400" in err["message"]


def test_unknown_route_and_method(http):
    assert_openai_error(http.get("/v1/nothing-here"), 404)
    assert http.get("/v1/completions").status_code == 405


def test_still_healthy_after_bad_inputs(smol, http, client, greedy_ref):
    assert http.get("/health").status_code == 200
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].text == greedy_ref.choices[0].text
    assert "graphinfer:http_requests_total" in http.get("/metrics").text


# ----- a non-streaming client that goes away -----

def _samples(http):
    return metric_samples(http.get("/metrics").text)


def test_non_stream_client_disconnect_aborts(smol, http):
    """A client that gives up on a non-streaming request (here after 1 s of a ~15 s one) has its requests
    aborted: their KV blocks are freed and they are counted as finished_reason="abort", not run to the end."""
    before = _samples(http)

    def give_up(body):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{smol.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))

    give_up({"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True})
    give_up({"prompt": ["Once upon a time", "In a galaxy far away"], "max_tokens": 200, "ignore_eos": True})

    deadline, m = time.monotonic() + 20, before
    while time.monotonic() < deadline:
        m = _samples(http)
        if (metric(m, "graphinfer:request_success_total", finished_reason="abort")
                == metric(before, "graphinfer:request_success_total", finished_reason="abort") + 3
                and metric(m, "graphinfer:num_requests_running") == 0
                and metric(m, "graphinfer:kv_cache_usage_perc") == 0):
            break
        time.sleep(0.2)
    for reason in ("abort", "length", "stop"):
        delta = (metric(m, "graphinfer:request_success_total", finished_reason=reason)
                 - metric(before, "graphinfer:request_success_total", finished_reason=reason))
        assert delta == (3 if reason == "abort" else 0), (reason, delta)
    assert metric(m, "graphinfer:num_requests_running") == 0 and metric(m, "graphinfer:kv_cache_usage_perc") == 0
    assert metric(m, "graphinfer:generation_tokens_total") == metric(before, "graphinfer:generation_tokens_total")


# ----- API key -----

def test_api_key(keyed):
    url = keyed.url
    body = {"model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": 2}
    assert_openai_error(httpx.post(f"{url}/v1/completions", json=body), 401)
    assert_openai_error(httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_openai_error(httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "secret"}), 401)
    assert_openai_error(httpx.get(f"{url}/v1/models"), 401)
    ok = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer secret"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer secret"}).json()["data"][0]["id"] == "tiny-llama"
    # the unauthenticated endpoints
    assert httpx.get(f"{url}/health").status_code == 200
    metrics = httpx.get(f"{url}/metrics")
    assert metrics.status_code == 200 and 'status="401"' in metrics.text
    assert httpx.get(f"{url}/version").status_code == 200

    with openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="tiny-llama", prompt=[1, 2, 3], max_tokens=2)
    with openai.OpenAI(base_url=f"{url}/v1", api_key="secret", max_retries=0) as good:
        assert good.completions.create(model="tiny-llama", prompt=[1, 2, 3], max_tokens=2).usage.completion_tokens == 2
        # tiny-llama has no tokenizer, so no chat template: a 400, not a crash
        with pytest.raises(openai.BadRequestError):
            good.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=2)


# ----- SIGTERM -----

def _wait_exit(server: Server, timeout: float) -> tuple[int | None, float]:
    t0 = time.monotonic()
    try:
        rc = server.proc.wait(timeout)
    except Exception:
        rc = None
    return rc, time.monotonic() - t0


# uvicorn shuts down gracefully on SIGTERM, then re-raises the signal: the exit status is -SIGTERM (0 on older ones).
EXIT_OK = (0, -signal.SIGTERM)


def test_sigterm_idle(servers):
    server = servers["sigterm"].wait_ready(120)
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=60)
    assert r.status_code == 200
    server.proc.send_signal(signal.SIGTERM)
    rc, took = _wait_exit(server, 10)
    assert rc is not None, f"still running 10 s after SIGTERM:\n{server.log()[-2000:]}"
    assert rc in EXIT_OK, (rc, server.log()[-2000:])
    assert "Traceback" not in server.log(), server.log()[-3000:]


def test_sigterm_with_a_stream_in_flight(smol):
    """Last test of the module: it stops the SmolLM2 server. A 200-token stream (~15 s on CPU) is cut after
    uvicorn's 5 s graceful timeout; the process must still exit promptly and cleanly."""
    lines, errors = [], []

    def read():
        try:
            body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{smol.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
        except httpx.HTTPError as e:
            errors.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while len([x for x in lines if x]) < 2 and time.monotonic() < deadline and reader.is_alive():
        time.sleep(0.02)
    assert len([x for x in lines if x]) >= 2, (lines, errors)
    smol.proc.send_signal(signal.SIGTERM)
    rc, took = _wait_exit(smol, 20)
    assert rc is not None, f"still running 20 s after SIGTERM:\n{smol.log()[-2000:]}"
    assert rc in EXIT_OK, (rc, smol.log()[-2000:])
    assert took < 15, took
    reader.join(10)
    assert not reader.is_alive()
    events, done = sse_events(lines)
    assert events and not done, (done, errors)  # cut short by the graceful-shutdown timeout
    assert "Traceback" not in smol.log(), smol.log()[-3000:]
