"""What crosses between the front end (entrypoints/) and an engine core (engine/core.py), in either direction, in
process or over a connection (engine/core_client.py): a validated, tokenized request in; per step, each request's
new tokens out (vLLM v1's EngineCoreRequest / EngineCoreOutput)."""
from dataclasses import dataclass

import numpy as np

from graphinfer.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved against max_model_len
    # structured outputs: the compiled grammar (in process), or its xgrammar serialization (to another process)
    grammar: object = None
    lora_request: object = None  # its LoRA adapter (lora/request.py's LoRARequest), or None


@dataclass
class PromptLogprobs:
    """A request's prompt logprobs, row i for prompt token i + 1 (given tokens 0..i): its logprob and rank (1 = most
    likely) under the raw logits, and the top k ids and logprobs (k = SamplingParams.prompt_logprobs)."""
    logprobs: np.ndarray  # [P - 1] float32
    ranks: np.ndarray  # [P - 1] int64
    topk_ids: np.ndarray  # [P - 1, k] int64
    topk_logprobs: np.ndarray  # [P - 1, k] float32

    @staticmethod
    def concat(parts: list["PromptLogprobs"], k: int) -> "PromptLogprobs":
        if not parts:
            return PromptLogprobs(np.zeros(0, np.float32), np.zeros(0, np.int64), np.zeros((0, k), np.int64),
                                  np.zeros((0, k), np.float32))
        if len(parts) == 1:
            return parts[0]
        return PromptLogprobs(*(np.concatenate([getattr(p, f) for p in parts])
                                for f in ("logprobs", "ranks", "topk_ids", "topk_logprobs")))


@dataclass
class EngineCoreOutput:
    """One request's tokens from one step. new_logprobs: per new token (sampled logprob, its rank, top-k ids, top-k
    logprobs), when the request asked for logprobs. finish_reason: set on its last output ("stop", "length",
    "abort"); stop_reason: the stop token id that ended it. prompt_logprobs: the whole prompt's, on the request's
    first output, when it asked for them (SamplingParams.prompt_logprobs)."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[tuple[float, int, list[int], list[float]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0  # speculative decoding: verified / accepted so far
    num_accepted_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
