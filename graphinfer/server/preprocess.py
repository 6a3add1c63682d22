"""Request preprocessing off the event loop: chat templating, tokenization and the length checks.

The work runs in a small thread pool (HF tokenizers release the GIL while they encode), so /health, /metrics
and the running streams never wait on one large request. A text prompt whose length alone proves it longer
than max_model_len is refused before it is tokenized (`max_chars_per_token`). The checks vLLM's server makes
on the token count are made here: the prompt within max_model_len, and max_tokens + prompt within it too.
"""
import asyncio
import json
import math
from concurrent.futures import ThreadPoolExecutor

from graphinfer.errors import InvalidRequestError, PromptTooLongError
from graphinfer.runtime.entrypoints.chat_template import chat_prompt_text
from graphinfer.runtime.entrypoints.input_processor import Request
from graphinfer.sampling_params import SamplingParams

# Unicode normalization (NFC / NFKC) composes at most 4 code points into one (e.g. U+1FAF from
# U+03A9 U+0313 U+0342 U+0345), so after it a text is at least a quarter of its length.
_COMPOSING = {"NFC", "NFKC"}
_NON_SHRINKING = {"NFD", "NFKD", "Lowercase", "Prepend"}


def _normalizer_shrink(spec) -> int | None:
    """By how much the tokenizer's normalizer can shorten a text at most (None: unknown, no bound)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", []):
            f = _normalizer_shrink(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _COMPOSING:
        return 4
    if kind in _NON_SHRINKING:
        return 1
    if kind == "Replace":
        pattern = (spec.get("pattern") or {}).get("String")
        return 1 if pattern is not None and len(spec.get("content", "")) >= len(pattern) else None
    return None


def max_chars_per_token(tokenizer) -> int | None:
    """An upper bound on how many characters of a prompt one token can stand for, or None where the
    tokenizer gives none. It holds for BPE tokenizers that cannot emit an unknown token (byte-level BPE, or
    BPE with byte fallback: GPT-2 style, Llama, Qwen, SmolLM2): every token is a vocabulary string at least
    as long as the text it covers (a byte-level symbol per byte, "<0x..>" for a byte), after a normalizer
    that shortens the text by a known factor at most."""
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
    except Exception:  # a slow (Python) tokenizer, or an unreadable spec: no bound, tokenize as usual
        return None
    model = spec.get("model") or {}
    byte_level = "ByteLevel" in json.dumps(spec.get("pre_tokenizer")) or model.get("byte_fallback")
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if model.get("type") != "BPE" or not byte_level or shrink is None:
        return None
    longest = max((len(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) if t), default=0)
    return shrink * longest if longest else None


class Preprocessor:
    """Turns validated request bodies into engine sequences, on worker threads."""

    def __init__(self, async_engine, workers: int = 4):
        self.async_engine = self.engine = async_engine  # the EngineClient
        self.tokenizer, self.max_model_len = async_engine.tokenizer, async_engine.max_model_len
        self.chars_per_token = max_chars_per_token(self.tokenizer) if self.tokenizer is not None else None
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="graphinfer-preprocess")

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ----- on a worker thread -----
    def completion(self, prompts: list, params: SamplingParams, request_id: str, echo: bool = False,
                   lora_request=None) -> list[Request]:
        """lora_request: the LoRA adapter every prompt runs with (None: the base model)."""
        self.async_engine.check_batch_size(len(prompts), params.num_candidates)
        truncating = params.truncate_prompt_tokens is not None
        ids = [self._tokenize(p, truncating=truncating) if isinstance(p, str) else p for p in prompts]
        seqs = self._sequences(ids, prompts, params, [f"{request_id}-{i}" for i in range(len(prompts))], lora_request)
        if echo:  # the text echoed: a token-id prompt's is its decoded text (vLLM's; "" without a tokenizer)
            for seq in seqs:
                if seq.prompt is None:
                    seq.prompt = self.tokenizer.decode(seq.prompt_token_ids) if self.tokenizer is not None else ""
        return seqs

    def chat(self, messages: list[dict], add_generation_prompt: bool, params: SamplingParams,
             request_id: str, tools: list[dict] | None = None, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None, lora_request=None) -> list[Request]:
        self.async_engine.check_batch_size(1, params.num_candidates)
        text = chat_prompt_text(self.tokenizer, messages, add_generation_prompt, chat_template, tools,
                                chat_template_kwargs)
        ids = self._tokenize(text, add_special_tokens=False, truncating=params.truncate_prompt_tokens is not None)
        return self._sequences([ids], [None], params, [request_id], lora_request)

    def tokenize(self, prompt: str | None, messages: list[dict] | None, add_generation_prompt: bool,
                 add_special_tokens: bool | None, return_token_strs: bool,
                 tools: list[dict] | None = None) -> tuple[list[int], list[str] | None]:
        """/tokenize: a prompt, or messages (and tools) through the chat template (whose text carries its special
        tokens)."""
        if messages is not None:
            prompt = chat_prompt_text(self.tokenizer, messages, add_generation_prompt, tools=tools)
        if self.tokenizer is None:
            self.engine.tokenize(prompt)  # raises the "no tokenizer" error
        special = messages is None if add_special_tokens is None else add_special_tokens
        ids = self.tokenizer(prompt, add_special_tokens=special).input_ids  # any length: counting is the point
        return ids, self.tokenizer.convert_ids_to_tokens(ids) if return_token_strs else None

    def detokenize(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise InvalidRequestError("This model ships no tokenizer, so token ids cannot be turned into text.")
        vocab = self.engine.hf_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"tokens must be token ids in [0, {vocab}).")
        return self.tokenizer.decode(ids)

    def _tokenize(self, text: str, add_special_tokens: bool = True, truncating: bool = False) -> list[int]:
        """truncating: truncate_prompt_tokens keeps the prompt's end, so its length proves nothing."""
        cpt = self.chars_per_token
        # at least max_model_len tokens: no room to generate
        if cpt and not truncating and len(text) > cpt * (self.max_model_len - 1):
            raise PromptTooLongError(
                f"The prompt has {len(text)} characters, so at least {math.ceil(len(text) / cpt)} tokens, but "
                f"max_model_len is {self.max_model_len}, which must leave room for at least one generated token. "
                f"Shorten the prompt or raise max_model_len.")
        if self.tokenizer is None:
            return self.engine.tokenize(text)  # raises the "no tokenizer" error
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def _sequences(self, ids: list[list[int]], texts: list, params: SamplingParams,
                   request_ids: list[str], lora_request=None) -> list[Request]:
        seqs = []
        for prompt_ids, text, rid in zip(ids, texts, request_ids):
            # the prompt within max_model_len, token ids, ...; an adapter not read yet is read and checked
            seq = self.engine.make_request(prompt_ids, params, rid, lora_request)
            n = seq.num_prompt_tokens
            if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
                raise InvalidRequestError(
                    f"max_tokens={params.max_tokens} is too large: this model's maximum context length is "
                    f"{self.max_model_len} tokens and the prompt has {n} ({n} + {params.max_tokens} > "
                    f"{self.max_model_len}). Ask for at most {self.max_model_len - n} tokens, or shorten the prompt.")
            seq.prompt = text if isinstance(text, str) else None
            seqs.append(seq)
        return seqs
