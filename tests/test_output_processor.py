"""The front end's output processor alone (entrypoints/output_processor.py), fed EngineCoreOutputs made up here: text
as a full decode gives it, stop strings (which end the request here and are handed back as aborts for the core),
logprob dicts, output kinds and parallel sampling's gathering. The tokenizer is the bundled SmolLM2's."""
import pytest

from graphinfer.runtime.engine.request import EngineCoreOutput
from graphinfer.runtime.entrypoints.input_processor import Request
from graphinfer.runtime.entrypoints.output_processor import OutputProcessor
from graphinfer.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from graphinfer.models.gguf_loader import load_gguf_tokenizer

    return load_gguf_tokenizer(smollm2_path)


def _add(proc, tok, params, rid="r", prompt="The capital of France is"):
    ids = tok(prompt).input_ids
    return proc.add_request(Request(rid, prompt, ids, params, max_tokens=32))


def test_streams_text_as_a_full_decode_and_ends_with_the_core(tok):
    proc = OutputProcessor(tok)
    [core_req] = _add(proc, tok, SamplingParams(max_tokens=32))
    assert core_req.request_id == "r" and core_req.max_tokens == 32
    ids = tok(" Paris, of course. It is nice").input_ids
    outs, stopped = proc.process([EngineCoreOutput("r", ids[:3])])
    assert stopped == [] and outs[0].outputs[0].text == tok.decode(ids[:3]) and not outs[0].finished
    outs, _ = proc.process([EngineCoreOutput("r", ids[3:], finish_reason="length")])
    [c] = outs[0].outputs
    assert (c.text, c.token_ids, c.finish_reason) == (tok.decode(ids), ids, "length") and outs[0].finished
    assert not proc.has_unfinished_requests()
    assert proc.process([EngineCoreOutput("r", [5])]) == ([], [])  # a finished request's late tokens are dropped


def test_a_stop_string_ends_the_request_here_and_asks_the_core_to_abort(tok):
    proc = OutputProcessor(tok)
    _add(proc, tok, SamplingParams(stop=["course"]), "a")
    _add(proc, tok, SamplingParams(stop=["course"], include_stop_str_in_output=True), "b")
    ids = tok(" Paris, of course. It is nice").input_ids
    outs, stopped = proc.process([EngineCoreOutput("a", ids), EngineCoreOutput("b", ids)])
    assert stopped == ["a", "b"]
    a, b = (o.outputs[0] for o in outs)
    assert (a.text, a.finish_reason, a.stop_reason) == (" Paris, of ", "stop", "course")
    assert b.text == " Paris, of course" and len(a.token_ids) < len(ids)  # the tokens after the stop are dropped
    # the same tokens with the core's own stop on the last: nothing to abort
    _add(proc, tok, SamplingParams(stop=["course"]), "c")
    _, stopped = proc.process([EngineCoreOutput("c", ids[:ids.index(tok(" course").input_ids[0]) + 1],
                                                finish_reason="length")])
    assert stopped == []


def test_logprobs_decoded_and_cumulative(tok):
    proc = OutputProcessor(tok)
    _add(proc, tok, SamplingParams(logprobs=2, output_kind=RequestOutputKind.FINAL_ONLY))
    outs, _ = proc.process([EngineCoreOutput("r", [11, 12], [(-0.5, 1, [11, 40], [-0.5, -1.0]),
                                                               (-2.0, 3, [7, 8], [-0.1, -0.2])])])
    assert outs == []  # FINAL_ONLY: nothing until it finishes
    outs, _ = proc.process([EngineCoreOutput("r", [13], [(-1.0, 1, [13, 9], [-1.0, -3.0])], finish_reason="stop",
                                             stop_reason=13)])
    [c] = outs[0].outputs
    assert c.cumulative_logprob == pytest.approx(-3.5) and c.stop_reason == 13
    first, second = c.logprobs[0], c.logprobs[1]
    assert list(first) == [11, 40] and first[40].rank == 2 and first[11].decoded_token == tok.decode([11])
    assert list(second) == [12, 7, 8] and second[12].rank == 3 and second[7].logprob == -0.1


def test_parallel_sampling_children_gather_into_the_request(tok):
    proc = OutputProcessor(tok)
    reqs = _add(proc, tok, SamplingParams(n=2, seed=5, output_kind=RequestOutputKind.FINAL_ONLY), "p")
    assert [r.request_id for r in reqs] == ["0_p", "1_p"] and [r.sampling_params.seed for r in reqs] == [5, 6]
    outs, _ = proc.process([EngineCoreOutput("1_p", [20], finish_reason="length", num_cached_tokens=4)])
    assert outs == []  # a sibling still runs
    outs, _ = proc.process([EngineCoreOutput("0_p", [21], finish_reason="length")])
    [out] = outs
    assert out.request_id == "p" and [c.index for c in out.outputs] == [0, 1] and out.metrics["num_cached_tokens"] == [0, 4]
    assert proc.abort_request("p") == [] and not proc.parents  # finished: nothing left to abort
    _add(proc, tok, SamplingParams(n=3), "q")
    assert proc.abort_request("q") == ["0_q", "1_q", "2_q"] and not proc.has_unfinished_requests()
