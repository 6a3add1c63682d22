import os
import random

import pytest

from graphinfer.runtime.entrypoints.detokenizer import IncrementalDetokenizer, find_stop_string

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tok(smollm2_path):
    d = os.path.dirname(smollm2_path)
    try:
        from graphinfer.models.gguf_loader import load_gguf_tokenizer  # cached on disk: fast after the first run
    except ImportError:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(d, gguf_file=GGUF)
    return load_gguf_tokenizer(os.path.join(d, GGUF))


def stream(tok, prompt_ids, output_ids, skip=True):
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    deltas = []
    for i, t in enumerate(output_ids):
        deltas.append(detok.add_token(t))
        # Mid-stream too: what has been emitted is the full decode, or a prefix of it while a char is pending.
        full = tok.decode(output_ids[: i + 1], skip_special_tokens=skip)
        assert detok.output_text == "".join(deltas)
        assert full.startswith(detok.output_text)
        if not full.endswith("\ufffd"):
            assert detok.output_text == full
    deltas.append(detok.flush())
    assert detok.output_text == "".join(deltas) == tok.decode(output_ids, skip_special_tokens=skip)
    return deltas


PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog. It's 3.14, isn't it?\n\nNew paragraph:\tdone!",
        " Leading space, then  two spaces and a trailing one ",
        "Emoji 😀👍🏽 and 🇯🇵 flags, CJK 日本語のテキスト, 한국어, ünïcödé — “quotes”…",
        "Chat<|im_end|>\n<|im_start|>user\nspecial tokens inside<|im_end|><|endoftext|>",
    ],
)
def test_incremental_equals_full_decode(tok, text, skip):
    out = tok.encode(text, add_special_tokens=False)
    stream(tok, tok.encode(PROMPT, add_special_tokens=False), out, skip)
    stream(tok, [], out, skip)  # no prompt at all


def test_multibyte_chars_are_held_back(tok):
    out = tok.encode("日本語😀", add_special_tokens=False)
    deltas = stream(tok, tok.encode(PROMPT), out)
    assert "" in deltas[:-1]  # some token ended mid-character and emitted nothing
    assert all("\ufffd" not in d for d in deltas)


def test_special_tokens_skipped_or_kept(tok):
    out = tok.encode("Hi<|im_end|>\n<|im_start|>", add_special_tokens=False)
    assert "".join(stream(tok, [], out, skip=True)) == "Hi\n"
    assert "".join(stream(tok, [], out, skip=False)) == "Hi<|im_end|>\n<|im_start|>"


def test_leading_space_after_prompt(tok):
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    out = tok.encode(" Paris. It is", add_special_tokens=False)
    deltas = stream(tok, prompt, out)
    assert deltas[0] == " Paris"


def test_prompt_ending_mid_character(tok):
    ids = tok.encode("Smile 😀 now", add_special_tokens=False)
    # Split inside the emoji's byte tokens: the output starts with orphan continuation bytes.
    for cut in range(1, len(ids)):
        stream(tok, ids[:cut], ids[cut:])


def test_random_token_sequences(tok):
    rng = random.Random(0)
    V = len(tok)
    for _ in range(100):
        prompt = [rng.randrange(V) for _ in range(rng.randrange(12))]
        # Low ids are specials and single bytes, the hard cases; the rest is arbitrary vocab.
        out = [rng.randrange(300) if rng.random() < 0.5 else rng.randrange(V) for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            stream(tok, prompt, out, skip)


# --- find_stop_string ---


def test_stop_basic_hit():
    assert find_stop_string("Hello world. STOP here", 10, ["STOP"], False) == ("Hello world. ", "STOP")


def test_stop_spanning_new_chars_boundary():
    # "ST" was already there, "OP" just arrived.
    assert find_stop_string("abc ST" + "OP x", 4, ["STOP"], False) == ("abc ", "STOP")


def test_stop_include_in_output():
    assert find_stop_string("abc STOP x", 4, ["STOP"], True) == ("abc STOP", "STOP")


def test_stop_earliest_wins():
    text = "one two three"
    assert find_stop_string(text, len(text), ["three", "two"], False) == ("one ", "two")
    assert find_stop_string(text, len(text), ["three", "two"], True) == ("one two", "two")


def test_stop_no_hit():
    assert find_stop_string("Hello world", 5, ["STOP", "xyz"], False) is None
    assert find_stop_string("Hello world", 5, [], False) is None
    assert find_stop_string("Hello world", 0, ["world"], False) is None


def test_stop_only_searches_overlap_with_new_chars():
    # "STOP" lies wholly in old text (already checked on an earlier step): not reported again.
    assert find_stop_string("STOP and more", 4, ["STOP"], False) is None
    assert find_stop_string("xx STOP", 1, ["STOP"], False) == ("xx ", "STOP")
