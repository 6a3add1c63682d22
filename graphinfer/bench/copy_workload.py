"""The copy-heavy workload for speculative decoding (`--dataset copy`): outputs that copy from their prompts.

How prompt i of `copy_prompts(tokenizer, num_prompts, passage_tokens, seed, vocab_size)` is built (rng =
random.Random(seed), drawn in prompt order):

- With a tokenizer (a real checkpoint, e.g. the bundled SmolLM2): the fixed English text of `bench accuracy`
  (bench/accuracy_text.PERPLEXITY_TEXT, ~400 tokens), whitespace collapsed and split into sentences after . ! ?.
  The passage is whole sentences from a start drawn with rng.randrange among the sentences from which the text
  still holds `passage_tokens` tokens (sentence lengths counted with the tokenizer, no special tokens), taken until
  it reaches `passage_tokens` tokens (a longer passage than the text starts at sentence 0 and wraps around), joined
  by single spaces. The prompt is INSTRUCTION + passage as one user message in the model's chat template with the
  assistant's turn opened (runtime/chat_template.chat_prompt_ids); a tokenizer without a chat template gets the
  plain text INSTRUCTION + passage + "\\n\\n" (its special tokens added). max_tokens = the passage's length in
  tokens + 16, a cap: bench throughput ends such a request at its EOS, as a user's would; bench latency ignores EOS.
- Without a tokenizer (the presets, random weights): token ids. A passage of `passage_tokens` ids drawn with
  rng.randrange(vocab_size), then the same passage again, then its first 8 ids: the prompt repeats literally, so
  its continuation (passage[8:]) is what lookup proposes. max_tokens = passage_tokens. Random weights do not follow
  the repetition, so there the drafts mostly miss (and after the first miss few are found): the preset case checks
  the plumbing, the tokenizer case measures copying.
"""
import random
import re

from graphinfer.bench.accuracy_text import PERPLEXITY_TEXT

INSTRUCTION = "Repeat the following text exactly, with no comment.\n\n"
# bench throughput's warm-up asks with other words: its prompts share no prefix-cache block with the timed ones
# past the chat template's own opening
WARMUP_INSTRUCTION = "Copy this text word for word.\n\n"


def sentences() -> list[str]:
    return re.split(r"(?<=[.!?])\s+", " ".join(PERPLEXITY_TEXT.split()))


def copy_prompts(tokenizer, num_prompts: int, passage_tokens: int, seed: int, vocab_size: int,
                 instruction: str = INSTRUCTION):
    """(prompts as token ids, max_tokens) of the copy workload (see the module docstring)."""
    rng = random.Random(seed)
    if tokenizer is None:
        prompts, max_tokens = [], []
        for _ in range(num_prompts):
            passage = [rng.randrange(vocab_size) for _ in range(passage_tokens)]
            prompts.append(passage + passage + passage[:8])
            max_tokens.append(passage_tokens)
        return prompts, max_tokens
    from graphinfer.runtime.entrypoints.chat_template import chat_prompt_ids

    sents = sentences()
    lens = [len(tokenizer(s, add_special_tokens=False).input_ids) for s in sents]
    starts = [i for i in range(len(sents)) if sum(lens[i:]) >= passage_tokens] or [0]
    prompts, max_tokens = [], []
    for _ in range(num_prompts):
        i = rng.randrange(len(starts))
        i, passage, n = starts[i], [], 0
        while n < passage_tokens:
            passage.append(sents[i % len(sents)])
            n += lens[i % len(sents)]
            i += 1
        text = " ".join(passage)
        if getattr(tokenizer, "chat_template", None):
            ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": instruction + text}])
        else:
            ids = tokenizer(instruction + text + "\n\n").input_ids
        prompts.append(list(ids))
        max_tokens.append(len(tokenizer(text, add_special_tokens=False).input_ids) + 16)
    return prompts, max_tokens


def load_copy_tokenizer(model: str):
    """The tokenizer copy_prompts uses for `model` (None for a preset or a checkpoint without one); "" is the
    bundled SmolLM2, as for LLM("")."""
    from graphinfer.config import bundled_model_path
    from graphinfer.models.loader import load_tokenizer

    return load_tokenizer(model or bundled_model_path())
