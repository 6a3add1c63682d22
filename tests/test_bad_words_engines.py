"""bad_words (issue 51) where the sampler does not simply see one row per request after the last step's tokens: with
async scheduling (the next step is scheduled before this one's tokens are on the host) and with ngram speculative
decoding (the drafts are verified as rows of their own, each with the drafts before it counted as generated). The
bundled SmolLM2, greedy, offline: the bad words never appear, and the text is the plain engine's with the same bad
words. Async scheduling here, on the session engine switched to its async path (as test_structured_output does);
ngram in test_spec_decode.py, on the SmolLM2 ngram engine that module builds anyway."""
import pytest

from graphinfer import SamplingParams

# The first prompt repeats itself, so ngram drafts " France" right after " capital of" (the bad word is proposed and
# must be rejected); "of France" is two tokens, banned only after " of" (the generated tokens are read: async
# scheduling must have them on the host). The second bans a single-token word.
PROMPTS = ["Paris is the capital of France. Paris is the capital of France. Paris is the capital of France. Paris is",
           "The capital of France is"]
BAD = [["of France"], ["Paris"]]
MAX_TOKENS = 12
_EXPECTED = {}  # id(the session's plain engine) -> expected_texts


def _texts(llm, bad_words):
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, bad_words=b) for b in bad_words]
    return llm.generate(PROMPTS, params, use_tqdm=False)


def expected_texts(smollm2_llm) -> tuple[list[str], list[str]]:
    """The plain engine's texts without and with the bad words (checked to differ where banned); computed once per
    engine (test_spec_decode.py asks too)."""
    if id(smollm2_llm) in _EXPECTED:
        return _EXPECTED[id(smollm2_llm)]
    plain = [o.outputs[0].text for o in _texts(smollm2_llm, [None, None])]
    assert "of France" in plain[0] and "Paris" in plain[1], plain  # the bans have something to remove
    banned = [o.outputs[0].text for o in _texts(smollm2_llm, BAD)]
    assert "of France" not in banned[0] and "Paris" not in banned[1], banned
    assert banned != plain
    _EXPECTED[id(smollm2_llm)] = plain, banned
    return plain, banned


@pytest.fixture(scope="module")
def expected(smollm2_llm):
    return expected_texts(smollm2_llm)


def check_bad_words(llm, expected) -> list:
    """llm's texts without and with the bad words are the plain engine's; the with-bad-words outputs."""
    plain, banned = expected
    assert [o.outputs[0].text for o in _texts(llm, [None, None])] == plain
    outs = _texts(llm, BAD)
    texts = [o.outputs[0].text for o in outs]
    assert "of France" not in texts[0] and "Paris" not in texts[1], texts
    assert texts == banned
    return outs


def test_bad_words_with_async_scheduling(smollm2_llm, expected):
    """The session engine down its async path (EngineCore._step_async, what async_scheduling=True selects: an engine
    built with it differs in that flag only)."""
    core = smollm2_llm.llm_engine.local_core
    assert not core.async_scheduling
    core.async_scheduling = True
    try:
        check_bad_words(smollm2_llm, expected)
    finally:
        core.async_scheduling = False
