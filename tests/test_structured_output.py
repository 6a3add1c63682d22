"""Structured outputs: graphinfer::apply_token_bitmask's reference against xgrammar's own apply_token_bitmask_inplace
(cpu), the cpu platform's kernel and the Triton kernel (interpreted without a GPU; tests/test_triton_kernels.py runs it
compiled on a GPU and under Triton-Ascend's interpreter) against the reference; the bundled SmolLM2
offline (the session LLM) and behind one `graphinfer serve` (--async-scheduling) with the official `openai` client,
sampled at temperature 1.0 over 20 seeds: JSON-schema outputs validate (jsonschema, else jsonschema_rs), regex ones
re.fullmatch, choices are members; the openai client parses a pydantic response_format; bad constraints are 400s."""
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import pytest
import torch
import xgrammar as xgr
from pydantic import BaseModel, Field

import graphinfer.ops  # noqa: F401
from graphinfer import SamplingParams
from graphinfer.errors import InvalidStructuredOutputError
from graphinfer.ops.bitmask import apply_token_bitmask
from graphinfer.ops.cpu.bitmask import apply_token_bitmask_cpu
from graphinfer.ops.triton.bitmask import apply_token_bitmask as triton_kernel
from graphinfer.runtime.structured_output import StructuredOutputManager
from graphinfer.sampling_params import StructuredOutputsParams
from server_utils import assert_openai_error

reference = apply_token_bitmask.reference  # the PyTorch function itself, whatever a platform registered for cpu

try:
    from jsonschema import validate as _validate
except ImportError:  # the pinned CPU venv has the Rust validator
    from jsonschema_rs import validate as _validate

SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "London", "Tokyo"]},
    "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    "tag": {"type": "string", "maxLength": 8}},
    "required": ["city", "rating", "tag"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{2,8}-[0-9]{3}"
CHOICE = ["Paris", "London", "Tokyo", "New York"]
SEEDS = range(20)


def _bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Random words (bit 31 set in half of them: negative int32), one row all ones, one allowing one token."""
    g = torch.Generator().manual_seed(seed)
    bm = torch.randint(-2**31, 2**31 - 1, (rows, -(-vocab // 32)), dtype=torch.int32, generator=g)
    bm[0] = -1
    if rows > 1:
        bm[1] = 0
        bit = (vocab - 1) % 32
        bm[1, -1] = -2**31 if bit == 31 else 1 << bit  # only the last token
    return bm


@pytest.mark.parametrize("vocab,dtype", [(49152, torch.float32), (1000, torch.bfloat16), (33, torch.float16)])
def test_reference_matches_xgrammar(vocab, dtype):
    logits = torch.randn(4, vocab).to(dtype)
    bitmask = _bitmask(4, vocab, vocab)
    ours, theirs = logits.clone(), logits.clone()
    reference(ours, bitmask)
    xgr.apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[0], logits[0]) and torch.isinf(ours[1, :-1]).all() and ours[1, -1] == logits[1, -1]


@pytest.mark.parametrize("vocab,dtype", [(4100, torch.float32), (1000, torch.bfloat16)])
def test_kernels_match_reference(vocab, dtype):
    big = torch.randn(3, vocab + 64).to(dtype)
    logits = big[:, :vocab]  # a row stride past the vocabulary, as a padded logits buffer has
    bitmask = _bitmask(3, vocab, 7)
    expected = logits.clone()
    reference(expected, bitmask)
    for kernel in (triton_kernel, apply_token_bitmask_cpu):
        out = big.clone()
        kernel(out[:, :vocab], bitmask)
        assert torch.equal(out[:, :vocab], expected) and torch.equal(out[:, vocab:], big[:, vocab:]), kernel


def test_no_tokenizer_and_bad_constraints_are_typed_errors(smollm2_llm):
    with pytest.raises(InvalidStructuredOutputError, match="ships none"):
        StructuredOutputManager(None, 256, {0}, torch.device("cpu")).compile(StructuredOutputsParams(regex="a"))
    engine = smollm2_llm.llm_engine
    for params, message in [(StructuredOutputsParams(json={"type": "foo"}), 'Unsupported type "foo"'),
                            (StructuredOutputsParams(regex="(ab"), "parenthesis is not closed"),
                            (StructuredOutputsParams(json="{not json"), "JSON schema cannot be compiled"),
                            (StructuredOutputsParams(regex="a", whitespace_pattern=" "), "whitespace_pattern")]:
        with pytest.raises(InvalidStructuredOutputError, match=re.escape(message)):
            engine.make_request("Hi", SamplingParams(structured_outputs=params))


def _check(kind: str, text: str) -> None:
    if kind == "json":
        _validate(SCHEMA, json.loads(text))
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICE, text


def test_offline_outputs_always_match(smollm2_llm):
    """One generate: 3 kinds x 5 seeds at temperature 1.0, plus the grammar's end overriding ignore_eos / min_tokens,
    and logprobs read from the masked logits; then LLM.chat with a choice."""
    so = {"json": StructuredOutputsParams(json=SCHEMA), "regex": StructuredOutputsParams(regex=REGEX),
          "choice": StructuredOutputsParams(choice=CHOICE)}
    cases = [(kind, SamplingParams(temperature=1.0, seed=s, max_tokens=200, structured_outputs=p))
             for kind, p in so.items() for s in range(5)]
    cases += [("choice", SamplingParams(temperature=1.0, seed=1, max_tokens=30, ignore_eos=True, min_tokens=20,
                                        logprobs=3, structured_outputs=so["choice"]))]
    outs = smollm2_llm.generate(["Rate a city as JSON:"] * len(cases), [p for _, p in cases], use_tqdm=False)
    for (kind, _), out in zip(cases, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (kind, c.text)
        _check(kind, c.text)
    last = outs[-1].outputs[0]
    assert len(last.token_ids) < 20  # the grammar ended it before min_tokens, ignore_eos or not
    for token, entry in zip(last.token_ids, last.logprobs):
        assert entry[token].logprob > float("-inf") and sum(lp.logprob > float("-inf") for lp in entry.values()) >= 1
    chat = smollm2_llm.chat([{"role": "user", "content": "Which city?"}], SamplingParams(
        temperature=0, max_tokens=10, structured_outputs=so["choice"]), use_tqdm=False)
    assert chat[0].outputs[0].text in CHOICE


def test_greedy_async_equals_sync(smollm2_llm):
    engine = smollm2_llm.llm_engine
    compact = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=compact),
              SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=REGEX)),
              SamplingParams(temperature=0, max_tokens=20)]  # a row without a grammar in the same steps
    prompts = ["Rate a city as JSON:", "A product code:", "The capital of France is"]
    sync = smollm2_llm.generate(prompts, params, use_tqdm=False)
    engine.local_core.async_scheduling = True  # the same engine down its async path (_step_async): masks after the launch
    try:
        asynchronous = smollm2_llm.generate(prompts, params, use_tqdm=False)
    finally:
        engine.local_core.async_scheduling = False
    assert [o.outputs[0].token_ids for o in asynchronous] == [o.outputs[0].token_ids for o in sync]
    _check("json", sync[0].outputs[0].text)
    assert "\n" not in sync[0].outputs[0].text and sync[0].outputs[0].text.startswith('{"city":')  # compact
    _check("regex", sync[1].outputs[0].text)
    assert engine.structured_output.stats().rows > 0


def test_structured_requests_get_no_drafts(smollm2_llm):
    """Speculative decoding (the ngram proposer, k = 3, put on the session engine for this test): the plain request
    of the batch gets drafts, the structured one none (its mask is known for the next token only)."""
    from graphinfer.runtime.spec_decode.ngram_proposer import NgramProposer
    from graphinfer.runtime.spec_decode.metrics import SpecDecodingStats

    engine = smollm2_llm.llm_engine
    core = engine.local_core
    core.proposer, core.scheduler.spec_stats = NgramProposer(3, 1, 4), SpecDecodingStats(3)
    engine.output_processor.spec_metrics = True
    try:
        prompt = "Repeat: red green blue red green blue red green blue red green blue"
        outs = smollm2_llm.generate([prompt, prompt], [
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=REGEX))],
            use_tqdm=False)
    finally:
        core.proposer = core.scheduler.spec_stats = None
        engine.output_processor.spec_metrics = False
    assert outs[0].metrics["spec_decode_num_draft_tokens"] > 0
    assert outs[1].metrics["spec_decode_num_draft_tokens"] == 0
    _check("regex", outs[1].outputs[0].text)


# ----- one `graphinfer serve` -----

@pytest.fixture(scope="module")
def server(openai_server):  # conftest: SmolLM2 fp32, async scheduling
    return openai_server


@pytest.fixture(scope="module")
def client(openai_client):
    return openai_client


def _request(client, kind: str, seed: int, stream: bool) -> tuple[str, str]:
    """(text, finish_reason) of one request of `kind` at temperature 1.0."""
    chat = kind in ("json_schema", "guided_regex")
    common = dict(model="smol", temperature=1.0, seed=seed, max_tokens=200, stream=stream)
    if kind == "json_schema":
        extra = dict(response_format={"type": "json_schema", "json_schema": {"name": "rating", "schema": SCHEMA}})
    elif kind == "regex":
        extra = dict(extra_body={"structured_outputs": {"regex": REGEX}})
    elif kind == "guided_regex":
        extra = dict(extra_body={"guided_regex": REGEX})
    else:
        extra = dict(extra_body={"guided_choice": CHOICE})
    if chat:
        r = client.chat.completions.create(messages=[{"role": "user", "content": "Rate a city."}], **common, **extra)
        if not stream:
            return r.choices[0].message.content, r.choices[0].finish_reason
        chunks = [c for c in r if c.choices]
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason
    r = client.completions.create(prompt="The best city is", **common, **extra)
    if not stream:
        return r.choices[0].text, r.choices[0].finish_reason
    chunks = [c for c in r if c.choices]
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


KINDS = ("json_schema", "regex", "guided_regex", "choice")


@pytest.fixture(scope="module")
def sampled(client):
    """Every kind x 20 seeds, the odd seeds streamed (80 concurrent requests)."""
    jobs = [(kind, seed, seed % 2 == 1) for kind in KINDS for seed in SEEDS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: _request(client, *job), jobs))
    return {job: result for job, result in zip(jobs, results)}


@pytest.mark.parametrize("kind", KINDS)
def test_server_outputs_always_match(sampled, kind):
    check = {"json_schema": "json", "regex": "regex", "guided_regex": "regex", "choice": "choice"}[kind]
    texts = {}
    for (k, seed, stream), (text, finish) in sampled.items():
        if k == kind:
            assert finish == "stop", (seed, stream, text)
            _check(check, text)
            texts.setdefault(stream, set()).add(text)
    assert len(texts[False]) > 1 and len(texts[True]) > 1  # sampled, not one answer 40 times


class CityRating(BaseModel):
    city: Literal["Paris", "London", "Tokyo"]
    rating: int = Field(ge=1, le=5)
    summary: str = Field(max_length=20)


def test_parse_pydantic_response_format(client):
    r = client.chat.completions.parse(model="smol", messages=[{"role": "user", "content": "Rate Paris."}],
                                      response_format=CityRating, temperature=1.0, seed=3, max_tokens=200)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, CityRating) and 1 <= parsed.rating <= 5, r.choices[0].message.content
    assert CityRating.model_validate_json(r.choices[0].message.content) == parsed


def test_choice_logprobs_are_json(server):
    """A forbidden token's logprob is -inf, which JSON cannot carry: served as vLLM's -9999.0."""
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": "smol", "prompt": "The best city is", "max_tokens": 5, "logprobs": 5, "temperature": 0,
        "structured_outputs": {"choice": ["Paris", "Tokyo"]}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] in ("Paris", "Tokyo")
    tops = choice["logprobs"]["top_logprobs"]
    assert tops and all(-9999.0 <= lp <= 0 for top in tops for lp in top.values())


@pytest.mark.parametrize("body,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     'Unsupported type "foo"'),
    ({"structured_outputs": {"regex": "(ab"}}, "parenthesis is not closed"),
    ({"guided_grammar": "root ::= missing"}, 'Rule "missing" is not defined'),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex and response_format"),
    ({"structured_outputs": {"regexp": "a+"}}, "structured_outputs.regexp"),
])
def test_bad_constraints_are_400(server, body, message):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"model": "smol", "messages": [{"role": "user", "content": "Hi"}], **body})
    err = assert_openai_error(r, 400)
    assert message in err["message"], err["message"]


def test_bench_counts_the_structured_work(smollm2_llm):
    """bench throughput's structured run (bench/structured_output.py): the schema lets no output end early, and the
    per-step counters cover every step's rows."""
    from graphinfer.bench.throughput import Workload, timed_generate

    workload = Workload([[100 + i] * 6 for i in range(3)], [6, 9, 12])
    stats, _ = timed_generate(smollm2_llm, workload, 0.6, "json")
    so = stats["structured_output_stats"]
    assert stats["output_tokens"] == workload.output_tokens  # ran to max_tokens, as the unconstrained run would
    assert so["rows"] == workload.output_tokens and so["steps"] == stats["num_steps"] == 12
    assert so["fill_ms_per_step"] > 0 and so["apply_ms_per_step"] > 0 and so["accept_s"] > 0
