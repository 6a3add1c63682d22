"""Requests in: a prompt and its SamplingParams validated and tokenized, and its structured-output constraint compiled,
into a Request (vLLM's InputProcessor); queueing is the engine's. Touches no engine state, so any thread may call
it (the server does, on its preprocessing threads)."""
import itertools
from dataclasses import dataclass

from graphinfer.errors import (InvalidRequestError, InvalidSamplingParamsError, KVCacheTooSmallError,
                               PromptTooLongError)
from graphinfer.runtime.structured_output import StructuredOutputManager
from graphinfer.sampling_params import SamplingParams


@dataclass
class Request:
    """A validated request, as the front end tracks it and before the engine core sees it."""
    request_id: str
    prompt: str | None  # its text (None for token ids; the server sets what it echoes)
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved against max_model_len
    grammar: object = None  # structured outputs: the compiled constraint

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class InputProcessor:
    def __init__(self, model_name: str, tokenizer, vocab_size: int, max_model_len: int, block_size: int,
                 num_blocks: int, structured_output: StructuredOutputManager, max_logprobs: int = 20):
        """max_logprobs: the most logprobs / prompt_logprobs per token a request may ask for (-1: no limit)."""
        self.model_name, self.tokenizer, self.vocab_size = model_name, tokenizer, vocab_size
        self.max_logprobs = max_logprobs
        self.max_model_len, self.block_size, self.num_blocks = max_model_len, block_size, num_blocks
        self.structured_output = structured_output
        self._ids = itertools.count()

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError(f"{self.model_name!r} ships no tokenizer: pass prompts as token ids.")
        return self.tokenizer(prompt).input_ids

    def make_request(self, prompt: str | list[int] | dict, params: SamplingParams | None,
                     request_id: str | None = None) -> Request:
        """Validate and tokenize one request without queueing it (so a batch can be checked first)."""
        params = params or SamplingParams()
        if isinstance(prompt, dict):  # vLLM's TokensPrompt / TextPrompt
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise PromptTooLongError("The prompt is empty; give at least one token.")
        vocab = self.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"Prompt token ids must be integers in [0, {vocab}).")
        if any(t >= vocab for t in params.stop_token_ids):  # the sampler masks them by index (min_tokens)
            raise InvalidRequestError(f"stop_token_ids must be token ids in [0, {vocab}).")
        self._check_logprobs(params)
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"The prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}, which must leave "
                f"room for at least one generated token. Shorten the prompt or raise max_model_len.")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        blocks = -(-(len(ids) + max_tokens - 1) // self.block_size)
        if blocks > self.num_blocks:
            raise KVCacheTooSmallError(
                f"The request needs {blocks} KV-cache blocks ({len(ids)} prompt + {max_tokens} new tokens), but the "
                f"cache has only {self.num_blocks}. Lower max_tokens, or give the cache more memory "
                f"(kv_cache_memory_bytes / num_gpu_blocks_override).")
        request_id = str(next(self._ids)) if request_id is None else request_id
        grammar = None
        if params.structured_outputs is not None:  # compiled once (the server: on its preprocessing threads)
            grammar = self.structured_output.compile(params.structured_outputs)
        return Request(request_id, text, ids, params, max_tokens, grammar)

    def _check_logprobs(self, params: SamplingParams) -> None:
        """vLLM's max_logprobs: logprobs and prompt_logprobs (-1: the whole vocabulary) within the engine's limit."""
        limit = self.max_logprobs
        if limit == -1:
            return
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is None:
                continue
            n = self.vocab_size if asked == -1 else asked
            if n > limit:
                what = f"{name}=-1 (the whole vocabulary: {n} per token)" if asked == -1 else f"{name}={asked}"
                raise InvalidSamplingParamsError(
                    f"{what} is more than this engine's max_logprobs={limit}. Ask for at most {limit}, or start the "
                    f"engine with a larger limit: --max-logprobs N (LLM(max_logprobs=N)), -1 for none.")
