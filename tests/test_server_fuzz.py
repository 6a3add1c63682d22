"""Schema fuzzing: schemathesis generates requests from the server's own OpenAPI document (/openapi.json),
valid ones and invalid ones, against a real `graphinfer serve tiny-llama` process. No request may get a 5xx,
every error has OpenAI's error body, and the engine stays alive throughout.

tiny-llama has no tokenizer, so string prompts and every chat request end in a 400 (after validation);
--max-model-len 256 bounds the requests that do generate (max_tokens=None means up to the context).
test_validation_cases sends vLLM's validation cases (issue 16) to the same server; their message says which
check refused them (the same cases go to a SmolLM2 server, with the openai client too, in test_server.py).
"""
import json
import os
import time
from datetime import timedelta

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode

from server_utils import Server

TIME_BUDGET_S = 45  # per endpoint and mode: examples beyond it are skipped (the count bounds it first, normally)
SCALE = float(os.environ.get("GRAPHINFER_FUZZ_SCALE", "1"))  # more examples for a deeper local run


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(["tiny-llama", "--max-model-len", "256", "--max-num-seqs", "8"],
               tmp_path_factory.mktemp("fuzz") / "server.log").launch()
    try:
        yield s.wait_ready(120)
    finally:
        s.stop()


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", timeout=30)


def test_openapi_document_lists_the_api(api_schema):
    paths = {op.ok().path for op in api_schema.get_all_operations()}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health", "/version",
            "/metrics"} <= paths


VOCAB = 512  # tiny-llama's

# The schema gives the sampling fields no ranges, so schema-valid bodies are nearly always out of range in some
# field (a 400 before anything runs). "steered" runs swap most fields for in-range values, so that requests get
# through to the engine (token-id prompts, the served model name) while the rest stay as schemathesis made them.
IN_RANGE = {  # (None last: hypothesis favours a one_of's first branches)
    "model": st.sampled_from(["tiny-llama", None]),
    "prompt": st.one_of(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
                        st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20), min_size=1, max_size=3)),
    "temperature": st.one_of(st.floats(0, 2), st.none()),
    "top_p": st.one_of(st.floats(0.01, 1), st.none()),
    "top_k": st.one_of(st.integers(-1, VOCAB + 10), st.integers(2**62, 2**70), st.none()),  # > vocab: top-k off
    "min_p": st.one_of(st.floats(0, 1), st.none()),
    "presence_penalty": st.one_of(st.floats(-2, 2), st.none()),
    "frequency_penalty": st.one_of(st.floats(-2, 2), st.none()),
    "repetition_penalty": st.one_of(st.floats(0.01, 3), st.none()),
    "seed": st.one_of(st.integers(-2**63, 2**64 - 1), st.none()),
    "max_tokens": st.integers(1, 33).map(lambda n: None if n == 33 else n),  # None: up to the context (slow)
    "min_tokens": st.integers(0, 8),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3),
                      st.none()),
    "stop_token_ids": st.one_of(st.lists(st.integers(0, VOCAB - 1), max_size=4),
                                st.lists(st.integers(VOCAB, 2**70), min_size=1, max_size=2),  # not in the vocab: a 400
                                st.none()),
    "logprobs": st.one_of(st.integers(0, 20), st.none()),
    "stream": st.booleans(),
    "stream_options": st.sampled_from([None, None, {"include_usage": True}]),  # only with stream: else a 400
    "ignore_eos": st.booleans(),
    "n": st.integers(1, 3),
    # mostly combinations that run: best_of > n refuses stream and temperature 0 (echo + logprobs: prompt logprobs)
    "echo": st.sampled_from([False, False, True]),
    "best_of": st.sampled_from([None, None, 3]),
    "suffix": st.none(),
    # structured outputs need a tokenizer, which tiny-llama lacks (a 400): test_fuzz_structured_outputs_and_tools
    **{key: st.none() for key in ("structured_outputs", "response_format", "guided_json", "guided_regex",
                                  "guided_choice", "guided_grammar", "guided_whitespace_pattern")},
}


# The fields that need a tokenizer (structured outputs, tools), steered against the SmolLM2 server: schemas, regexes
# and grammars that are partly random go into the grammar compiler (a 400 or an answer, never a 5xx); messages, model
# and a short max_tokens always steered, so requests run.
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=4),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                     max_leaves=6)
_SCHEMA = st.one_of(
    st.just({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}}, "required": ["a"]}),
    st.dictionaries(st.sampled_from(["type", "properties", "enum", "items", "required", "pattern", "minItems", "$ref",
                                     "anyOf", "const", "maxLength"]), _JSON, max_size=4))
SURFACE = {
    "model": st.just("smol"),
    "messages": st.just([{"role": "user", "content": "hi"}]),
    "max_tokens": st.integers(1, 8),
    "temperature": st.sampled_from([0.0, 1.0]),
    "n": st.integers(1, 2),
    "response_format": st.one_of(st.just({"type": "json_object"}), st.just({"type": "text"}),
                                 _SCHEMA.map(lambda x: {"type": "json_schema", "json_schema": {"name": "x", "schema": x}})),
    "structured_outputs": st.one_of(st.text(max_size=6).map(lambda r: {"regex": r}),
                                    st.lists(st.text(max_size=4), max_size=3).map(lambda c: {"choice": c}),
                                    _SCHEMA.map(lambda x: {"json": x}), st.text(max_size=16).map(lambda g: {"grammar": g})),
    "guided_regex": st.text(max_size=6),
    "tools": st.lists(_SCHEMA.map(lambda x: {"type": "function", "function": {"name": "f", "parameters": x}}),
                      min_size=1, max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
}
ALWAYS = ("model", "messages", "max_tokens")
CONSTRAINTS = ("response_format", "structured_outputs", "guided_regex", "tools")  # one at a time (else a 400)


def steer(body, data, fields=None):
    """Each field: an in-range value (mostly), schemathesis's own value, or left out."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    fields = fields or IN_RANGE
    constraint = data.draw(st.sampled_from(CONSTRAINTS), label="constraint") if fields is SURFACE else None
    for key, values in fields.items():
        if fields is SURFACE and (key in ALWAYS or key == constraint or (key == "tool_choice" and constraint == "tools")):
            how = "in-range"
        elif fields is SURFACE and key in CONSTRAINTS + ("tool_choice",):
            how = data.draw(st.sampled_from(["drop"] * 4 + ["keep"]), label=f"steer {key}")
        else:
            how = data.draw(st.sampled_from(["in-range"] * 3 + (["keep"] if key in ("prompt", "model")
                                                                else ["keep", "drop"])), label=f"steer {key}")
        if how == "in-range":
            body[key] = data.draw(values, label=key)
        elif how == "drop":
            body.pop(key, None)
    return body


POS, NEG = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
CASES = [  # (path, method, mode, steered, max_examples); the GETs take no parameters, so no invalid ones exist
    ("/v1/completions", "POST", POS, True, 80),
    ("/v1/completions", "POST", POS, False, 40),
    ("/v1/completions", "POST", NEG, False, 50),
    ("/v1/chat/completions", "POST", POS, False, 40),
    ("/v1/chat/completions", "POST", NEG, False, 40),
    ("/tokenize", "POST", POS, False, 15),
    ("/tokenize", "POST", NEG, False, 15),
    ("/detokenize", "POST", POS, False, 15),
    ("/detokenize", "POST", NEG, False, 15),
    ("/v1/models", "GET", POS, False, 2),
    ("/version", "GET", POS, False, 2),
]


@pytest.mark.parametrize("path,method,mode,steered,examples", CASES,
                         ids=[f"{c[1]}-{c[0]}-{c[2].value}{'-steered' if c[3] else ''}" for c in CASES])
def test_fuzz_no_server_errors(server, api_schema, path, method, mode, steered, examples):
    fuzz(server, api_schema, path, method, mode, IN_RANGE if steered else None, examples)


def test_fuzz_structured_outputs_and_tools(openai_server, api_schema):
    """Chat requests with structured outputs and tools (SURFACE) on the SmolLM2 server (conftest), which has a
    tokenizer and Hermes tool calling: what tiny-llama refuses for want of a tokenizer reaches the grammar compiler."""
    fuzz(openai_server, api_schema, "/v1/chat/completions", "POST", POS, SURFACE, 30)


def fuzz(server, api_schema, path, method, mode, steering, examples):
    steered = steering is not None
    operation = api_schema[path][method]
    started = time.monotonic()
    seen = {"calls": 0, "statuses": {}, "failed": False}

    with httpx.Client(timeout=5) as health_client:
        @settings(max_examples=max(1, int(examples * SCALE)), deadline=timedelta(seconds=30), database=None,
                  print_blob=True, phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode), data=st.data())
        def check(case, data):
            if steered:  # drawn before the budget check: a replay must draw what the first run drew
                case.body = steer(case.body, data, steering)
            # past the budget, skip the rest, unless an example has failed (its shrinking and final replay must
            # run it again, or hypothesis reports a flaky test instead of the failure)
            if time.monotonic() - started > TIME_BUDGET_S * SCALE and not seen["failed"]:
                return
            try:
                exchange(case)
            except BaseException:
                seen["failed"] = True
                raise

        def exchange(case):
            response = case.call(base_url=server.url, timeout=60)
            seen["calls"] += 1
            seen["statuses"][response.status_code] = seen["statuses"].get(response.status_code, 0) + 1
            case.validate_response(response, checks=[not_a_server_error])
            assert response.status_code < 500, response.text[:500]
            if response.status_code >= 400:
                body = json.loads(response.content)
                assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]), body
                assert body["error"]["code"] == response.status_code, body
            # a request must never take the engine loop down for the requests after it
            health = health_client.get(f"{server.url}/health")
            assert health.status_code == 200, (health.status_code, health.text)

        check()

    print(f"\n{method} {path} [{mode.value}{' steered' if steered else ''}]: {seen['calls']} calls in "
          f"{time.monotonic() - started:.1f} s, statuses {dict(sorted(seen['statuses'].items()))}")
    assert seen["calls"] > 0
    if steered:  # the steering must keep getting requests through to the engine
        assert seen["statuses"].get(200, 0) >= seen["calls"] // 10, seen


HI = {"role": "user", "content": "hi"}
VALIDATION = [  # (id, path, body, a fragment of the message that names the check)
    ("role-unknown", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ("content-missing", "/v1/chat/completions", {"messages": [{"role": "user"}]}, "needs 'content'"),
    ("content-null", "/v1/chat/completions", {"messages": [{"role": "system", "content": None}, HI]}, "needs 'content'"),
    ("assistant-no-content", "/v1/chat/completions", {"messages": [HI, {"role": "assistant"}]}, "needs 'content'"),
    ("tool-no-content", "/v1/chat/completions", {"messages": [HI, {"role": "tool", "tool_call_id": "c"}]},
     "needs 'content'"),
    ("max_tokens-over-context", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 254}, "3 + 254 > 256"),
    ("max_tokens-over-context-batch", "/v1/completions", {"prompt": [[1], [1, 2, 3, 4]], "max_tokens": 253},
     "4 + 253 > 256"),
    ("max_completion_tokens-over-context", "/v1/chat/completions", {"messages": [HI], "max_completion_tokens": 300},
     "no tokenizer"),  # tiny-llama: the chat template fails first
    ("top_logprobs-without-logprobs", "/v1/chat/completions", {"messages": [HI], "top_logprobs": 3},
     "top_logprobs needs logprobs"),
    ("stream_options-without-stream", "/v1/completions", {"prompt": [1], "stream_options": {"include_usage": True}},
     "stream_options can only be given when stream=true"),
    ("stream_options-stream-false", "/v1/chat/completions",
     {"messages": [HI], "stream": False, "stream_options": {"include_usage": False}},
     "stream_options can only be given when stream=true"),
    ("not-utf8", "/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 2}', "UTF-8"),
]


@pytest.mark.parametrize("path,body,fragment", [v[1:] for v in VALIDATION], ids=[v[0] for v in VALIDATION])
def test_validation_cases(server, path, body, fragment):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server.url}{path}", timeout=60, **kw)
    assert r.status_code == 400, r.text
    err = json.loads(r.content)["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and fragment in err["message"], err


def test_server_healthy_after_fuzzing(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
