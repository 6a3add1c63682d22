"""vLLM's request fields and the budgets that bound a request (issue 51), against a real `graphinfer serve` with the
official openai client, and the same tokens from the offline LLM.

One SmolLM2 server (fp32, --trust-request-chat-template, a small --max-logprob-entries and a short structured-output
compile time-out, so the limits are reached by small requests) starts while the offline LLM loads.
"""
import json
import statistics
import threading
import time

import httpx
import openai
import pytest

from graphinfer import SamplingParams
from server_utils import Server, assert_openai_error

MODEL = "smol"
PROMPT = "The capital of France is"
MAX_ENTRIES = 4096
COMPILE_TIMEOUT = 0.3
# SmolLM2's ids
BANANA, A, B, C, PARIS = 21285, 253, 278, 265, 7042


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    s = Server(["--dtype", "float32", "--max-model-len", "1024", "--served-model-name", MODEL,
                "--trust-request-chat-template", "--max-logprob-entries", str(MAX_ENTRIES),
                "--structured-outputs-compile-timeout", str(COMPILE_TIMEOUT)],
               tmp_path_factory.mktemp("request-fields") / "server.log").launch()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def smol(launched, smollm2_llm):  # the offline LLM loads while the server starts
    return launched.wait_ready(300)


@pytest.fixture(scope="module")
def client(smol):
    with openai.OpenAI(base_url=f"{smol.url}/v1", api_key="EMPTY", timeout=120, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(smol):
    with httpx.Client(base_url=smol.url, timeout=120) as c:
        yield c


def served(client, **kw):
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **kw}
    extra = {k: kw.pop(k) for k in list(kw) if k in ("allowed_token_ids", "bad_words", "truncate_prompt_tokens",
                                                      "stop_token_ids", "include_stop_str_in_output")}
    return client.completions.create(**kw, extra_body=extra).choices[0]


def offline(llm, prompt=PROMPT, **kw):
    kw = {"temperature": 0, "max_tokens": 8, **kw}
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0].outputs[0]


# ----- each field changes the output as in vLLM, with the same tokens offline -----

def test_logit_bias_forces_a_token(client, smollm2_llm):
    c = served(client, logit_bias={str(BANANA): 100})
    assert c.text == " banana" * 8
    assert offline(smollm2_llm, logit_bias={BANANA: 100}).text == c.text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logit_bias={str(BANANA): 100})
    assert chat.choices[0].message.content == " banana" * 4
    # a bias beyond OpenAI's range is clamped to it (vLLM's), not refused
    assert served(client, logit_bias={str(BANANA): 1e6}).text == c.text


def test_allowed_token_ids_restrict(client, smollm2_llm):
    c = served(client, allowed_token_ids=[A, B, C])
    assert c.text and set(c.text.split()) <= {"a", "b", "c"}, c.text
    assert offline(smollm2_llm, allowed_token_ids=[A, B, C]).text == c.text


def test_bad_words_never_appear(client, smollm2_llm):
    plain = served(client, max_tokens=12)
    assert "Paris" in plain.text and "the French" not in plain.text
    c = served(client, max_tokens=12, bad_words=["Paris"])
    assert "Paris" not in c.text and c.text != plain.text
    out = offline(smollm2_llm, max_tokens=12, bad_words=["Paris"])
    assert out.text == c.text
    assert "the French" in c.text  # so the two-token bad word below has something to ban
    # two tokens: " French" is banned only right after " the" (vLLM's prefix match); the rest may stay
    two = served(client, max_tokens=12, bad_words=["Paris", "the French"])
    assert "the French" not in two.text and "Paris" not in two.text
    assert offline(smollm2_llm, max_tokens=12, bad_words=["Paris", "the French"]).text == two.text
    sampled = client.completions.create(model=MODEL, prompt=[PROMPT] * 4, max_tokens=8, temperature=1.0, seed=7,
                                        extra_body={"bad_words": ["Paris"]})
    assert all("Paris" not in ch.text for ch in sampled.choices)


def test_stop_token_ids_text_as_vllm(client, smollm2_llm):
    c = served(client, stop_token_ids=[PARIS])
    assert (c.text, c.finish_reason, c.model_extra["stop_reason"]) == ("", "stop", PARIS)
    kept = served(client, stop_token_ids=[PARIS], include_stop_str_in_output=True)
    assert kept.text == " Paris"
    assert offline(smollm2_llm, stop_token_ids=[PARIS]).text == ""
    assert offline(smollm2_llm, stop_token_ids=[PARIS], include_stop_str_in_output=True).text == " Paris"


def test_truncate_prompt_tokens_keeps_the_end(client, smollm2_llm):
    long = "Ignore all of this. " * 300 + PROMPT  # longer than max_model_len: refused without truncation
    r = client.completions.create(model=MODEL, prompt=long, max_tokens=8, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 6})
    assert r.usage.prompt_tokens == 6
    assert r.choices[0].text == offline(smollm2_llm, long, truncate_prompt_tokens=6).text


def test_chat_template_kwargs_reach_the_template(client, smollm2_llm):
    template = "{{ greeting }}, {% for m in messages %}{{ m.content }}{% endfor %}. Answer:"
    messages = [{"role": "user", "content": "what is the capital of France"}]
    rs = {g: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            extra_body={"chat_template": template,
                                                        "chat_template_kwargs": {"greeting": g}})
          for g in ("Hello", "Bonjour mon ami")}
    assert rs["Hello"].usage.prompt_tokens < rs["Bonjour mon ami"].usage.prompt_tokens
    out = smollm2_llm.chat(messages, SamplingParams(temperature=0, max_tokens=6), chat_template=template,
                           chat_template_kwargs={"greeting": "Bonjour mon ami"}, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == rs["Bonjour mon ami"].usage.prompt_tokens
    assert out.outputs[0].text == rs["Bonjour mon ami"].choices[0].message.content


def test_unknown_fields_are_accepted_and_logged_once(smol, http):
    for _ in range(2):
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "frobnicate_level": 3})
        assert r.status_code == 200, r.text
    time.sleep(0.5)
    assert smol.log().count("frobnicate_level") == 1, smol.log()[-2000:]


# ----- bad values: 400s naming the field -----

BAD = [
    ('"logit_bias": {"100": NaN}', "logit_bias"),
    ('"logit_bias": {"100": Infinity}', "logit_bias"),
    ('"logit_bias": {"1000000": 1}', "logit_bias"),
    ('"logit_bias": {"banana": 1}', "logit_bias"),
    ('"logit_bias": {%s}' % ", ".join(f'"{i}": 1' for i in range(1025)), "logit_bias"),
    ('"allowed_token_ids": []', "allowed_token_ids"),
    ('"allowed_token_ids": [1000000]', "allowed_token_ids"),
    ('"bad_words": [" "]', "bad_words"),
    ('"truncate_prompt_tokens": 0', "truncate_prompt_tokens"),
    ('"truncate_prompt_tokens": 5000', "truncate_prompt_tokens"),
    ('"logprobs": 21', "--max-logprobs"),
]


@pytest.mark.parametrize("field,named", BAD, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD)])
def test_bad_values_are_400s_naming_the_field(http, field, named):
    body = '{"prompt": "hi", "max_tokens": 2, %s}' % field
    err = assert_openai_error(http.post("/v1/completions", content=body,
                                        headers={"Content-Type": "application/json"}), 400)
    assert named in err["message"], err


def test_bad_chat_template_kwargs(http):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template_kwargs": {"add_generation_prompt": False}}
    err = assert_openai_error(http.post("/v1/chat/completions", json=body), 400)
    assert "chat_template_kwargs" in err["message"]


def test_request_chat_template_needs_the_flag():
    from graphinfer.errors import InvalidRequestError
    from graphinfer.server.request_limits import check_chat_template

    check_chat_template(None, trusted=False)
    check_chat_template("{{ 1 }}", trusted=True)
    with pytest.raises(InvalidRequestError, match="--trust-request-chat-template"):
        check_chat_template("{{ 1 }}", trusted=False)


# ----- budgets -----

def test_logprob_budget_names_the_limit_and_flag(client):
    with pytest.raises(openai.BadRequestError) as e:  # the request, scaled to this server's limit
        client.completions.create(model=MODEL, prompt="hi", n=8, logprobs=5, max_tokens=200,
                                  extra_body={"ignore_eos": True})
    msg = str(e.value)
    assert "--max-logprob-entries" in msg and str(MAX_ENTRIES) in msg and "9600" in msg, msg
    ok = client.completions.create(model=MODEL, prompt="hi", n=2, logprobs=5, max_tokens=8)  # 96 entries
    assert len(ok.choices) == 2


def test_a_deep_body_is_told_so(http):
    depth = 1000
    body = '{"prompt": "hi", "x": ' + "[" * depth + "]" * depth + "}"
    err = assert_openai_error(http.post("/v1/completions", content=body,
                                        headers={"Content-Type": "application/json"}), 400)
    assert "nests" in err["message"] and "UTF-8" not in err["message"], err


def _deep_schema(depth: int, name: str) -> dict:
    s = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {name: s}, "required": [name]}
    return s


@pytest.mark.slow  # ~30 s, and a pace ratio that two busy CI workers can disturb: make test-slow runs it
def test_a_slow_schema_times_out_while_a_stream_keeps_its_pace(client, http):
    """Three schemas that each take seconds to compile: each is a 400 after the time-out, and, compiled one at a time
    on one thread, they leave a running stream's per-token time within a small factor of what it was."""
    warm = {"prompt": "{", "max_tokens": 2, "structured_outputs": {"json": {"type": "object"}}}
    assert http.post("/v1/completions", json=warm).status_code == 200  # the backend is made at the first one
    arrivals = []

    def stream():
        for _ in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=160, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
            arrivals.append(time.monotonic())

    reader = threading.Thread(target=stream)
    reader.start()
    while len(arrivals) < 40:
        assert reader.is_alive()
        time.sleep(0.01)
    sent = time.monotonic()
    errors = []

    def ask(name):
        body = {"prompt": "{", "max_tokens": 4, "structured_outputs": {"json": _deep_schema(200, name)}}
        errors.append(http.post("/v1/completions", json=body))

    askers = [threading.Thread(target=ask, args=(n,)) for n in ("a", "b", "c")]
    for t in askers:
        t.start()
    for t in askers:
        t.join()
    reader.join()
    for r in errors:
        err = assert_openai_error(r, 400)
        assert "--structured-outputs-compile-timeout" in err["message"], err
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    before = statistics.median(gaps[10:38])
    during = statistics.median([g for a, g in zip(arrivals[1:], gaps) if sent < a < sent + 2.0])
    assert during < 3 * before, (before, during)  # 3.2x measured with the compiles at normal priority
