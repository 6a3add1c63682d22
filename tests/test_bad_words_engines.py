"""bad_words (issue 51) where the sampler does not simply see one row per request after the last step's tokens: with
async scheduling (the next step is scheduled before this one's tokens are on the host) and with ngram speculative
decoding (the drafts are verified as rows of their own, each with the drafts before it counted as generated). The
bundled SmolLM2, greedy, offline: the bad words never appear, and the text is the plain engine's with the same bad
words."""
import pytest

from graphinfer import LLM, SamplingParams

# The first prompt repeats itself, so ngram drafts " France" right after " capital of" (the bad word is proposed and
# must be rejected); "of France" is two tokens, banned only after " of" (the generated tokens are read: async
# scheduling must have them on the host). The second bans a single-token word.
PROMPTS = ["Paris is the capital of France. Paris is the capital of France. Paris is the capital of France. Paris is",
           "The capital of France is"]
BAD = [["of France"], ["Paris"]]
MAX_TOKENS = 12


def _texts(llm, bad_words):
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, bad_words=b) for b in bad_words]
    return llm.generate(PROMPTS, params, use_tqdm=False)


@pytest.fixture(scope="module")
def expected(smollm2_llm):
    plain = [o.outputs[0].text for o in _texts(smollm2_llm, [None, None])]
    assert "of France" in plain[0] and "Paris" in plain[1], plain  # the bans have something to remove
    banned = [o.outputs[0].text for o in _texts(smollm2_llm, BAD)]
    assert "of France" not in banned[0] and "Paris" not in banned[1], banned
    assert banned != plain
    return plain, banned


@pytest.mark.parametrize("engine", [
    {"async_scheduling": True},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                            "prompt_lookup_max": 3}},
], ids=["async_scheduling", "ngram_spec"])
def test_bad_words_with(engine, expected):
    plain, banned = expected
    with LLM(dtype="float32", max_model_len=1024, seed=0, **engine) as llm:
        assert [o.outputs[0].text for o in _texts(llm, [None, None])] == plain
        outs = _texts(llm, BAD)
    texts = [o.outputs[0].text for o in outs]
    assert "of France" not in texts[0] and "Paris" not in texts[1], texts
    assert texts == banned
    if "speculative_config" in engine:  # drafts were verified (and the repeated prompt's " France" rejected)
        assert outs[0].metrics["spec_decode_num_draft_tokens"] > 0
