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
    lora_request: object = None  # its LoRA adapter (lora/request.py's LoRARequest), or None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class InputProcessor:
    def __init__(self, model_name: str, tokenizer, vocab_size: int, max_model_len: int, block_size: int,
                 num_blocks: int, structured_output: StructuredOutputManager, max_logprobs: int = 20,
                 max_logprob_entries: int = 0, enable_lora: bool = False, pipeline_parallel_size: int = 1):
        """max_logprobs (vLLM's; -1: no limit), max_logprob_entries (0: no limit): the budgets of
        check_logprobs."""
        self.model_name, self.tokenizer, self.vocab_size = model_name, tokenizer, vocab_size
        self.max_logprobs, self.max_logprob_entries = max_logprobs, max_logprob_entries
        self.max_model_len, self.block_size, self.num_blocks = max_model_len, block_size, num_blocks
        self.structured_output, self.enable_lora = structured_output, enable_lora
        self.pipeline_parallel_size = pipeline_parallel_size
        self._ids = itertools.count()

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError(f"{self.model_name!r} ships no tokenizer: pass prompts as token ids.")
        return self.tokenizer(prompt).input_ids

    def make_request(self, prompt: str | list[int] | dict, params: SamplingParams | None,
                     request_id: str | None = None, lora_request=None) -> Request:
        """Validate and tokenize one request without queueing it (so a batch can be checked first)."""
        params = params or SamplingParams()
        if lora_request is not None and not self.enable_lora:
            raise InvalidRequestError(f"The request names LoRA adapter {lora_request.lora_name!r}, but LoRA is not "
                                      f"enabled: start the engine with enable_lora=True (--enable-lora).")
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
        check_token_ids(params, vocab)
        if params.bad_words and params._bad_words_token_ids is None:
            if self.tokenizer is None:
                raise InvalidRequestError(f"bad_words need the model's tokenizer, and {self.model_name!r} ships none.")
            params.update_from_tokenizer(self.tokenizer)
            if any(t >= vocab for w in params._bad_words_token_ids for t in w):
                raise InvalidRequestError(f"bad_words: a word tokenizes to ids outside the vocabulary [0, {vocab}).")
        if params.truncate_prompt_tokens is not None:  # vLLM's: the prompt's last k tokens
            k = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            if k > self.max_model_len:
                raise InvalidRequestError(
                    f"truncate_prompt_tokens value ({k}) is greater than max_model_len ({self.max_model_len}). "
                    f"Please, select a smaller truncation size.")
            ids = ids[-k:]
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
        self.check_logprobs(params, max_tokens)
        if self.pipeline_parallel_size > 1:
            check_pipeline_request(params, self.pipeline_parallel_size)
        request_id = str(next(self._ids)) if request_id is None else request_id
        grammar = None
        if params.structured_outputs is not None:  # compiled once (the server: on its preprocessing threads)
            grammar = self.structured_output.compile(params.structured_outputs)
        return Request(request_id, text, ids, params, max_tokens, grammar, lora_request)

    def check_logprobs(self, params: SamplingParams, max_tokens: int) -> None:
        """vLLM's max_logprobs (logprobs and prompt_logprobs; -1: the whole vocabulary), then the request's logprob
        entries: each of its candidates (best_of, or n) records up to max_tokens tokens x (logprobs + 1) entries (the
        top ones and the sampled one), which its outputs carry (the server's JSON: tens of bytes each)."""
        limit = self.max_logprobs
        for name in ("logprobs", "prompt_logprobs") if limit != -1 else ():
            asked = getattr(params, name)
            n = self.vocab_size if asked == -1 else asked
            if asked is not None and n > limit:
                what = f"{name}=-1 (the whole vocabulary: {n} per token)" if asked == -1 else f"{name}={asked}"
                raise InvalidSamplingParamsError(
                    f"{what} is more than this engine's max_logprobs={limit}. Ask for at most {limit}, or start the "
                    f"engine with a larger limit: --max-logprobs N (LLM(max_logprobs=N)), -1 for none.")
        lp = params.logprobs
        if lp is None and params.num_candidates > params.n:
            lp = 0  # best_of > n: the candidates are ranked by their logprobs (parallel_sampling.child_params)
        if lp is None or not self.max_logprob_entries:
            return
        entries = params.num_candidates * max_tokens * (lp + 1)
        if entries > self.max_logprob_entries:
            raise InvalidRequestError(
                f"The request asks for {entries} logprob entries ({'best_of' if params.best_of else 'n'}="
                f"{params.num_candidates} x max_tokens={max_tokens} x (logprobs={lp} + 1)), more than this server's "
                f"limit of {self.max_logprob_entries} per request (--max-logprob-entries / max_logprob_entries). "
                f"Ask for fewer tokens, choices or logprobs.")


def check_pipeline_request(params: SamplingParams, pp: int) -> None:
    """What a request cannot ask of a pipeline-parallel engine yet."""
    for name, asked in (("prompt_logprobs", params.prompt_logprobs is not None),
                        ("structured_outputs", params.structured_outputs is not None)):
        if asked:
            raise InvalidRequestError(f"{name} is not supported with pipeline_parallel_size={pp} yet (the last stage "
                                      f"sends back only the sampling rows' hidden states); drop {name}, or serve the "
                                      f"model without --pipeline-parallel-size.")


def check_token_ids(params: SamplingParams, vocab: int) -> None:
    """logit_bias and allowed_token_ids name tokens of the vocabulary [0, vocab) (vLLM's checks)."""
    if params.logit_bias and (bad := sorted(t for t in params.logit_bias if t >= vocab)):
        raise InvalidRequestError(f"logit_bias: token id(s) {bad[:8]} are out of the vocabulary (vocabulary size: "
                                  f"{vocab}).")
    if params.allowed_token_ids and any(t >= vocab for t in params.allowed_token_ids):
        raise InvalidRequestError(f"allowed_token_ids: token ids must be in the vocabulary [0, {vocab}).")
