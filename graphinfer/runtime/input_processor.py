"""Requests in: a prompt and its SamplingParams validated and tokenized into a Sequence (vLLM's InputProcessor),
with what it samples with attached (grammar, generator, detokenizer); queueing is the engine's."""
import itertools

import torch

from graphinfer.config import SchedulerConfig
from graphinfer.errors import InvalidConfigError, InvalidRequestError, KVCacheTooSmallError, PromptTooLongError
from graphinfer.runtime.block_manager import BlockManager
from graphinfer.runtime.detokenizer import IncrementalDetokenizer
from graphinfer.runtime.parallel_sampling import ParentRequest, make_children
from graphinfer.runtime.sequence import Sequence
from graphinfer.runtime.structured_output import StructuredOutputManager
from graphinfer.sampling_params import SamplingParams


def max_model_len_of(hf_config, requested: int | None, sc: SchedulerConfig) -> int:
    """The context a request may fill: max_model_len if given (refused past the model's), else the model's; one
    the scheduler could not fit in a step without chunked prefill is refused."""
    model_len = getattr(hf_config, "max_position_embeddings", None) or 2048
    if requested is not None and requested > model_len:
        raise InvalidConfigError(f"max_model_len={requested} exceeds the model's context length {model_len}; "
                                 f"use max_model_len <= {model_len}.")
    max_model_len = model_len if requested is None else requested
    if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < max_model_len:
        raise InvalidConfigError(
            f"max_num_batched_tokens={sc.max_num_batched_tokens} < max_model_len={max_model_len} "
            f"without chunked prefill: long prompts could never be scheduled. Raise max_num_batched_tokens, "
            f"lower max_model_len, or enable_chunked_prefill=True.")
    return max_model_len


def eos_token_ids_of(hf_config, tokenizer) -> set[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


class InputProcessor:
    def __init__(self, model_name: str, tokenizer, vocab_size: int, max_model_len: int, block_manager: BlockManager,
                 num_blocks: int, structured_output: StructuredOutputManager, device: torch.device,
                 requests: dict[str, Sequence], parents: dict[str, ParentRequest]):
        """requests / parents: the engine's running sequences and parallel-sampling requests (ids in use)."""
        self.model_name, self.tokenizer, self.vocab_size = model_name, tokenizer, vocab_size
        self.max_model_len, self.block_manager, self.num_blocks = max_model_len, block_manager, num_blocks
        self.structured_output, self.device = structured_output, device
        self.requests, self.parents = requests, parents
        self._ids = itertools.count()

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError(f"{self.model_name!r} ships no tokenizer: pass prompts as token ids.")
        return self.tokenizer(prompt).input_ids

    def make_sequence(self, prompt: str | list[int] | dict, params: SamplingParams | None,
                      request_id: str | None = None) -> Sequence:
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
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"The prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}, which must leave "
                f"room for at least one generated token. Shorten the prompt or raise max_model_len.")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        blocks = self.block_manager.blocks_needed(len(ids) + max_tokens - 1)
        if blocks > self.num_blocks:
            raise KVCacheTooSmallError(
                f"The request needs {blocks} KV-cache blocks ({len(ids)} prompt + {max_tokens} new tokens), but the "
                f"cache has only {self.num_blocks}. Lower max_tokens, or give the cache more memory "
                f"(kv_cache_memory_bytes / num_gpu_blocks_override).")
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.requests or request_id in self.parents:
            raise InvalidRequestError(f"Request id {request_id!r} is already in use.")
        seq = Sequence(request_id, text, ids, params, max_tokens)
        if params.num_candidates > 1:  # parallel sampling: the children run, seq stands for the request
            seq.children = make_children(seq)
        for s in seq.children or [seq]:
            if params.structured_outputs is not None:  # compiled once (the server: on its preprocessing threads)
                s.grammar = self.structured_output.grammar_init(params.structured_outputs)
            if s.sampling_params.seed is not None:
                s.generator = torch.Generator(device=self.device).manual_seed(s.sampling_params.seed)
            if self.tokenizer is not None:
                s.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        return seq
