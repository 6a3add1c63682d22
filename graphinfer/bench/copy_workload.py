"""The copy-heavy workload for speculative decoding (`--dataset copy`): outputs that copy from their prompts.

Prompt i (seed s): a passage of the fixed English text of `bench accuracy` (bench/accuracy_text.PERPLEXITY_TEXT),
its sentences from a position drawn with random.Random(s) onward, about `passage_tokens` tokens long, asked to be
copied: "Repeat the following text exactly, with no comment.\n\n<passage>" in the model's chat template (a user
turn, the assistant's turn opened). max_tokens = the passage's length in tokens + 16, so a request ends where a
faithful copy ends (EOS is ignored, as in the other workloads). A model without a tokenizer (the presets) gets token
ids instead: a random passage of `passage_tokens` ids, the same passage again, then its first 8 ids, and max_tokens =
the passage length: a continuation of the repetition is what lookup proposes, whether or not random weights follow.
"""
import random
import re

from graphinfer.bench.accuracy_text import PERPLEXITY_TEXT
from graphinfer.runtime.chat_template import chat_prompt_ids

INSTRUCTION = "Repeat the following text exactly, with no comment.\n\n"


def copy_prompts(tokenizer, num_prompts: int, passage_tokens: int, seed: int, vocab_size: int):
    """(prompts as token ids, max_tokens) of the copy workload."""
    rng = random.Random(seed)
    if tokenizer is None:
        prompts, max_tokens = [], []
        for _ in range(num_prompts):
            passage = [rng.randrange(vocab_size) for _ in range(passage_tokens)]
            prompts.append(passage + passage + passage[:8])
            max_tokens.append(passage_tokens)
        return prompts, max_tokens
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(PERPLEXITY_TEXT.split()))
    prompts, max_tokens = [], []
    for _ in range(num_prompts):
        i = rng.randrange(len(sentences))
        passage, n = [], 0
        while n < passage_tokens:
            s = sentences[i % len(sentences)]
            passage.append(s)
            n += len(tokenizer(s, add_special_tokens=False).input_ids)
            i += 1
        text = " ".join(passage)
        messages = [{"role": "user", "content": INSTRUCTION + text}]
        if getattr(tokenizer, "chat_template", None):
            ids = chat_prompt_ids(tokenizer, messages)
        else:
            ids = tokenizer(INSTRUCTION + text + "\n\n").input_ids
        prompts.append(list(ids))
        max_tokens.append(len(tokenizer(text, add_special_tokens=False).input_ids) + 16)
    return prompts, max_tokens
