"""A request's state as it moves through the scheduler: tokens, progress, KV blocks, outputs."""
import enum

import torch

from graphinfer.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, max_tokens: int):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output, the tokens whose KV gets computed
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # resolved against max_model_len
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prompt tokens served by prefix-cache hits at the first schedule
        # Async scheduling: tokens sampled on the device but not yet seen on the host (they count in num_tokens,
        # so the next step can be scheduled; their ids reach the next forward on the device).
        self.num_pending = 0
        self.pending_row = 0  # the row of the in-flight step's sampled tokens that holds the pending one
        # Speculative decoding: draft tokens proposed for the next step, verified there (their KV is written in the
        # lookahead slots; only the accepted ones' counts in num_computed_tokens afterwards)
        self.spec_token_ids: list[int] = []
        self.num_draft_tokens = self.num_accepted_tokens = 0  # verified so far (RequestOutput.metrics)
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of this sequence's full, computed blocks
        self.generator: torch.Generator | None = None  # set by the engine (on its device) for a seeded request
        self.grammar = None  # structured outputs: the request's grammar matcher (runtime/structured_output/)
        self.detokenizer = None  # set by the engine when a tokenizer exists
        self.output_text = ""
        self.logprobs: list[dict] | None = [] if sampling_params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # Parallel sampling (runtime/parallel_sampling.py): a request with best_of > 1 as make_sequence returns it
        # runs as these child sequences; a child knows its ParentRequest and its CompletionOutput.index.
        self.children: list[Sequence] = []
        self.parent = None
        self.index = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
