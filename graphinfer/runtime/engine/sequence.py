"""A request's state in the engine core as it moves through the scheduler: tokens, progress, KV blocks, grammar.
What the user sees of it (text, logprob dicts, stop strings) is the front end's (entrypoints/output_processor.py)."""
import enum

import torch

from graphinfer.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 max_tokens: int, eos_token_ids: set[int] = frozenset(), lora_request=None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output, the tokens whose KV gets computed
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # resolved against max_model_len
        self.lora_request = lora_request  # its LoRA adapter (lora/request.py's LoRARequest), or None
        self.lora_waits = 0  # steps its admission was held back by max_loras (the scheduler's starvation guard)
        self.eos_token_ids = eos_token_ids  # the model's
        # what min_tokens masks (vLLM's SamplingParams.all_stop_token_ids): the request's stop ids and the model's EOS
        self.all_stop_token_ids = frozenset(sampling_params.stop_token_ids) | frozenset(eos_token_ids)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache, or is being written by a launched step
        self.num_cached_tokens = 0  # prompt tokens served by prefix-cache hits at the first schedule
        # Tokens sampled by launched steps but not yet seen on the host (vLLM's output placeholders): they count in
        # num_tokens, so the next step can be scheduled before they land (async scheduling); their ids reach the next
        # forward on the device.
        self.num_pending = 0
        self.pending_row = 0  # the row of the in-flight step's sampled tokens that holds the pending one
        # Speculative decoding: draft tokens proposed for the next step, verified there (their KV is written in the
        # lookahead slots; the rejected ones' are taken back out of num_computed_tokens afterwards)
        self.spec_token_ids: list[int] = []
        self.num_draft_tokens = self.num_accepted_tokens = 0  # verified so far (RequestOutput.metrics)
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of this sequence's full, computed blocks
        self.generator: torch.Generator | None = None  # on the engine's device, for a seeded request
        self.grammar = None  # structured outputs: the request's grammar matcher (runtime/structured_output/)
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None  # the stop token id that ended it
        # Prompt logprobs (SamplingParams.prompt_logprobs): position p's row is the logprob of prompt token p + 1.
        # Rows of positions < num_prompt_logprobs are scheduled (a recompute after a preemption skips them); the
        # landed ones wait here (engine/request.py's PromptLogprobs) until the request's first output carries them.
        self.num_prompt_logprobs = 0
        self.prompt_logprobs_parts: list = []
        self.prompt_logprobs_sent = False

    @property
    def cache_key(self):
        """The root of its blocks' chained prefix-cache hashes: blocks computed with one LoRA adapter are never hits
        for another (or for the base model)."""
        return None if self.lora_request is None else ("lora", self.lora_request.lora_int_id)

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
    def wants_prompt_logprobs(self) -> bool:
        """Prompt positions whose logprob rows are still to be scheduled."""
        return self.sampling_params.prompt_logprobs is not None and \
            self.num_prompt_logprobs < len(self.prompt_token_ids) - 1

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
