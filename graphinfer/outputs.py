"""Request outputs, shaped like vLLM's RequestOutput / CompletionOutput."""
from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # one dict per generated token
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: dict = field(default_factory=dict)  # spec decoding counters; n > 1: "num_cached_tokens" per child
    # SamplingParams.prompt_logprobs (vLLM's): None for the first prompt token, then per prompt token a dict of that
    # token's Logprob and the top N's; None when the request asked for none
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
