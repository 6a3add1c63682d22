"""What crosses between the front end (entrypoints/) and an engine core (engine/core.py), in either direction, in
process or over a connection (engine/core_client.py): a validated, tokenized request in; per step, each request's
new tokens out (vLLM v1's EngineCoreRequest / EngineCoreOutput)."""
from dataclasses import dataclass

from graphinfer.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved against max_model_len
    # structured outputs: the compiled grammar (in process), or its xgrammar serialization (to another process)
    grammar: object = None


@dataclass
class EngineCoreOutput:
    """One request's tokens from one step. new_logprobs: per new token (sampled logprob, its rank, top-k ids, top-k
    logprobs), when the request asked for logprobs. finish_reason: set on its last output ("stop", "length",
    "abort"); stop_reason: the stop token id that ended it."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[tuple[float, int, list[int], list[float]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0  # speculative decoding: verified / accepted so far
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
