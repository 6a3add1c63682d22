"""Continuous-batching scheduler with a token budget, chunked prefill and preemption by recompute; the one place that
advances a request (vLLM v1's Scheduler: schedule, then update_from_output).

schedule(), each step (vLLM v1's unified scheme): running sequences first, in arrival order, each taking what it
still needs (1 token for a decode, the rest of its prompt for a chunked prefill) out of max_num_batched_tokens; then
waiting sequences are admitted while the budget, max_num_seqs and free blocks allow, their prompts chunked to fit.
Decodes and prefill chunks share a step. When a running sequence needs a block and none is free, the most recently
admitted one is preempted: its blocks are freed (their hashes kept, so its recompute is mostly prefix-cache hits)
and it goes back to the front of the waiting queue. A request that could never fit is refused at admission (the
front end), so a sequence running alone always has room and the scheduler always makes progress. Once scheduled, a
sequence's computed tokens count the step's (vLLM's _update_after_schedule), and a sequence the step samples for
holds a placeholder for that token (num_pending) until update_from_output lands it: so with async scheduling the
next step is scheduled while this one runs.

update_from_output(), with the step's sampled tokens on the host: each sampling row's tokens appended (a verify
step's accepted drafts and one more; the rejected drafts' KV taken back), its grammar advanced, token stops checked
(EOS, stop_token_ids, max_tokens, max_model_len, a terminated grammar); finished requests leave the queues and free
their blocks. Returns each row's EngineCoreOutput. Stop strings are the front end's: it aborts a request that hit
one.

With speculative decoding a decoding sequence also computes its draft tokens (seq.spec_token_ids), whose KV goes
into lookahead slots; drafts that do not fit the token budget (or would need a preemption) are dropped.

Blocks that a step fills with known tokens are offered to the prefix cache when it is scheduled (vLLM v1's order),
so a sequence admitted later in the same step already shares them: parallel sampling's children compute their common
prompt once. (Each layer writes the whole step's KV before its attention reads any; a step that fails withdraws
them: step_failed.)

With async scheduling a sequence may have a token still on its way from the device (num_pending): it is scheduled as
a decode all the same, except when that token is its last (max_tokens), and after a preemption it is not re-admitted
before the token lands.

Prompt logprobs (SamplingParams.prompt_logprobs): a step that computes prompt positions [lo, hi) of such a request
names them (ScheduledRequest.prompt_logprobs), for the model runner to put their hidden states through the LM head;
position p's row is the logprob of prompt token p + 1, so the last prompt position (it samples) has none. Each
position's row is scheduled once (seq.num_prompt_logprobs: a recompute after a preemption skips those done), and a
prefix-cache hit never covers a position still owed (vLLM drops the hit for such a request; here the hit is kept up
to the positions already done, i.e. none at admission). The rows land in update_prompt_logprobs and leave with the
request's first output (EngineCoreOutput.prompt_logprobs).
"""
import logging
from collections import deque
from dataclasses import dataclass, field

from graphinfer.config import CacheConfig, SchedulerConfig
from graphinfer.runtime.engine.block_manager import BlockManager
from graphinfer.runtime.engine.request import EngineCoreOutput, PromptLogprobs
from graphinfer.runtime.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)

# Steps a request may be held back by max_loras while requests of running adapters pass it (then none may)
LORA_MAX_WAITS = 64


@dataclass
class ScheduledRequest:
    seq: Sequence
    num_tokens: int  # tokens computed this step (its drafts included)
    start: int  # its computed tokens before the step: the first position computed
    samples: bool  # the step completes its known tokens: it samples a token (drafts: one per draft position, + 1)
    pending_row: int = 0  # async scheduling: the in-flight step's sampler row that holds its input token, if pending
    # prompt logprobs: the prompt positions [lo, hi) whose next token's logprob this step computes (None: none)
    prompt_logprobs: tuple[int, int] | None = None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    cached_blocks: list[int] = field(default_factory=list)  # offered to the prefix cache for this step (see above)
    num_rows: int = 0  # the sequences that sample: the sampler's rows (drafts aside)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def rows(self) -> list[Sequence]:
        """The sequences that sample this step, in the order of the sampler's rows."""
        return [s.seq for s in self.scheduled if s.samples]


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 max_model_len: int, structured_output=None, spec_stats=None, use_eagle: bool = False,
                 max_loras: int = 0):
        """structured_output: the StructuredOutputManager whose matchers accept the sampled tokens (None: no
        grammars); spec_stats: speculative decoding's counters (SpecDecodingStats; None: it is off); use_eagle: the
        proposer keeps cache rows that depend on the next block (MTP: BlockManager.find_cached_blocks); max_loras:
        the LoRA adapters a step may use (vLLM's rule; 0: LoRA is off)."""
        self.config = scheduler_config
        self.max_model_len = max_model_len
        self.structured_output, self.spec_stats = structured_output, spec_stats
        self.block_manager = BlockManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                                          use_eagle)
        self.requests: dict[str, Sequence] = {}  # every unfinished sequence, by request id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.max_loras = max_loras
        self.skip_pending = False  # pipeline parallel: a sequence with a token on its way is not scheduled again
        self.max_batch_seqs = scheduler_config.max_num_seqs  # pipeline parallel: max_num_seqs / pp (set_pipeline)

    def set_pipeline(self, depth: int) -> None:
        """Pipeline parallel with `depth` batches in flight: a sequence with a token on its way waits for it, and a
        step takes at most max_num_seqs / depth requests, so the running ones spread over the batches in flight
        (one batch of all of them would leave the other stages idle)."""
        self.skip_pending = depth > 1
        self.max_batch_seqs = -(-self.config.max_num_seqs // depth)

    def add_request(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def stats(self) -> dict:
        """The load, for /metrics and the data-parallel front end."""
        stats = {"running": len(self.running), "waiting": len(self.waiting), "kv_usage": self.block_manager.usage,
                 "kv_blocks_in_use": self.block_manager.num_blocks - self.block_manager.num_free_blocks,
                 "preemptions": self.num_preemptions}
        if self.max_loras:  # the adapters of running / waiting requests, by name (vLLM's lora_requests_info)
            for key, seqs in (("running_lora_adapters", self.running), ("waiting_lora_adapters", self.waiting)):
                stats[key] = sorted({s.lora_request.lora_name for s in seqs if s.lora_request is not None})
        return stats

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ----- schedule -----
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < self.max_batch_seqs:
            seq = self.running[i]
            if seq.num_pending and (self.skip_pending or seq.num_output_tokens >= seq.max_tokens):
                # async scheduling: its last token is on the way; it ends on length once that lands. Pipeline
                # parallel (skip_pending): its next step waits for the token (vLLM's batch queue)
                i += 1
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.spec_token_ids:  # drafts: only what the budget and free blocks allow, never a preemption for them
                k = min(len(seq.spec_token_ids), budget - n)
                while k and not self.block_manager.can_append(seq, n + k):
                    k -= 1
                del seq.spec_token_ids[k:]
                n += k
            while not self.block_manager.can_append(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.append_slots(seq, n)
                out.cached_blocks += self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens + n)
                self._scheduled(out, seq, n)
                budget -= n
                i += 1
                continue
            break
        if out.preempted:  # memory is short: don't admit anyone this step
            return out
        loras = {s.lora_request.lora_int_id for s in self.running if s.lora_request is not None}
        i = 0  # waiting[:i]: held back by max_loras this step
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs and \
                len(out.scheduled) < self.max_batch_seqs:
            seq = self.waiting[i]
            if seq.num_pending:  # preempted with a token on its way (async scheduling): admit it once it lands
                break
            lora = seq.lora_request.lora_int_id if seq.lora_request is not None else None
            if lora is not None and lora not in loras and len(loras) >= self.max_loras:
                # vLLM's rule: a step holds at most max_loras adapters; later requests of running ones may pass it,
                # until it has waited LORA_MAX_WAITS steps: then nobody passes it, the running adapters drain
                seq.lora_waits += 1
                if seq.lora_waits > LORA_MAX_WAITS:
                    break
                i += 1
                continue
            cached = self.block_manager.find_cached_blocks(seq)
            if seq.wants_prompt_logprobs:  # prompt logprobs need the hidden states of the positions still owed
                cached = cached[:seq.num_prompt_logprobs // self.block_manager.block_size]
            n = seq.num_tokens - len(cached) * self.block_manager.block_size
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.block_manager.can_allocate(seq, cached, n):
                break
            self.block_manager.allocate(seq, cached, n)
            out.cached_blocks += self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens + n)
            del self.waiting[i]
            if lora is not None:
                loras.add(lora)
                seq.lora_waits = 0
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._scheduled(out, seq, n)
            budget -= n
        return out

    @staticmethod
    def _scheduled(out: SchedulerOutput, seq: Sequence, n: int) -> None:
        """seq computes n tokens this step: they count as computed from now on (vLLM's _update_after_schedule), and
        a step that completes seq's known tokens holds a placeholder for the token it samples."""
        start = seq.num_computed_tokens
        samples = start + n == seq.num_tokens + len(seq.spec_token_ids)
        prompt_lp = None
        if seq.wants_prompt_logprobs:  # rows of positions not yet scheduled (a recompute skips the earlier ones)
            lo, hi = max(start, seq.num_prompt_logprobs), min(start + n, seq.num_prompt_tokens - 1)
            if hi > lo:
                prompt_lp = (lo, hi)
                seq.num_prompt_logprobs = hi
        out.scheduled.append(ScheduledRequest(seq, n, start, samples, seq.pending_row, prompt_lp))
        if samples:
            seq.pending_row = out.num_rows
            out.num_rows += 1
        seq.num_computed_tokens += n
        seq.num_pending += samples

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def step_failed(self, out: SchedulerOutput) -> None:
        """The step's forward failed: its KV was never written, so no request may hit the blocks offered to the prefix
        cache when it was scheduled."""
        self.block_manager.uncache(out.cached_blocks)

    # ----- update -----
    def update_prompt_logprobs(self, out: SchedulerOutput, plp) -> None:
        """Land the step's prompt logprobs (plp: the host PromptLogprobs of its rows, in scheduling order, with the
        step's largest k; the model runner's prompt_logprobs): each request keeps its part until its first output.
        Call it before update_from_output of the same step."""
        row = 0
        for s in out.scheduled:
            if s.prompt_logprobs is None:
                continue
            lo, hi = s.prompt_logprobs
            first, row = row, row + hi - lo
            seq = s.seq
            if seq.is_finished:
                continue
            k = _prompt_k(seq.sampling_params.prompt_logprobs, plp.topk_ids.shape[1])
            seq.prompt_logprobs_parts.append(PromptLogprobs(plp.logprobs[first:row], plp.ranks[first:row],
                                                            plp.topk_ids[first:row, :k], plp.topk_logprobs[first:row, :k]))

    def update_from_output(self, out: SchedulerOutput, sampled) -> list[EngineCoreOutput]:
        """Land the step's sampled tokens (sampled: the host SamplerOutput of out.rows; None when no row sampled) and
        return an output for each row still running, or finished by them."""
        if sampled is None:
            return []
        spec = sampled.output_token_ids is not None
        emitted = (sampled.output_token_ids if spec else sampled.sampled_token_ids[:, None]).tolist()
        outputs, row = [], 0
        for seq, tokens in zip(out.rows, emitted):
            first, row = row, row + 1 + len(seq.spec_token_ids)  # its sampler rows: one per draft position
            seq.num_pending -= 1
            if seq.is_finished:  # aborted, or stopped a step earlier (async scheduling): its tokens are dropped
                continue
            if spec:
                tokens = self._accept_drafts(seq, tokens)
            new = []
            for token in tokens:
                new.append(token)
                self._append(seq, token)
                if seq.is_finished:
                    break
            else:
                if spec:  # the rejected drafts' lookahead blocks go back; full blocks of accepted tokens get cached
                    self.block_manager.trim(seq)
                    self.block_manager.cache_full_blocks(seq)
            outputs.append(EngineCoreOutput(
                seq.request_id, new, _logprobs(sampled, first, len(new), seq.sampling_params.logprobs)
                if seq.sampling_params.logprobs is not None else None, seq.finish_reason, seq.stop_reason, seq.num_cached_tokens, seq.num_draft_tokens,
                seq.num_accepted_tokens, self._take_prompt_logprobs(seq)))
        return outputs

    @staticmethod
    def _take_prompt_logprobs(seq: Sequence) -> PromptLogprobs | None:
        """The whole prompt's logprobs, once (on the request's first output), if it asked for them."""
        k = seq.sampling_params.prompt_logprobs
        if k is None or seq.prompt_logprobs_sent:
            return None
        seq.prompt_logprobs_sent = True
        parts, seq.prompt_logprobs_parts = seq.prompt_logprobs_parts, []
        return PromptLogprobs.concat(parts, _prompt_k(k, parts[0].topk_ids.shape[1] if parts else 0))

    def _accept_drafts(self, seq: Sequence, emitted: list[int]) -> list[int]:
        """The tokens a verified row emits (its -1 padding cut); its rejected drafts' KV is taken back."""
        tokens = emitted[:emitted.index(-1)] if -1 in emitted else emitted
        if k := len(seq.spec_token_ids):
            self.spec_stats.observe(k, len(tokens) - 1)
            seq.num_draft_tokens += k
            seq.num_accepted_tokens += len(tokens) - 1
        seq.num_computed_tokens -= k - (len(tokens) - 1)
        seq.spec_token_ids = []
        return tokens

    def _append(self, seq: Sequence, token: int) -> None:
        seq.append_token(token)
        if seq.grammar is not None and not self.structured_output.accept_token(seq.grammar, token):
            logger.error("request %s: its grammar rejected the sampled token %d (a bug); the request ends",
                         seq.request_id, token)
            self.finish(seq, "abort")
            return
        if (reason := self._check_stop(seq, token)) is not None:
            self.finish(seq, reason)

    def _check_stop(self, seq: Sequence, token: int) -> str | None:
        """"stop" / "length" if seq is done after `token` (setting stop_reason for a stop token id), else None."""
        params = seq.sampling_params
        if seq.grammar is not None and seq.grammar.is_terminated():
            # structured outputs: the grammar's end (its stop token accepted) is the output's end; min_tokens and
            # ignore_eos do not extend it (the grammar would allow nothing more)
            return "stop"
        if len(seq.output_token_ids) >= params.min_tokens:
            if token in seq.eos_token_ids and not params.ignore_eos:
                return "stop"
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return "stop"
        if len(seq.output_token_ids) >= seq.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    # ----- finish -----
    def finish_requests(self, request_ids, reason: str = "abort") -> None:
        """End unfinished requests by id (aborts; the front end's stop strings); unknown ids are ignored."""
        for request_id in request_ids:
            if (seq := self.requests.get(request_id)) is not None:
                self.finish(seq, reason)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take seq out of the queues and release its blocks (finished, stopped or aborted)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self.requests.pop(seq.request_id, None)
        seq.grammar = None  # structured outputs: its matcher goes now, not with the last reference to the sequence
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason


def _logprobs(sampled, first: int, n: int, k: int) -> list[tuple[float, int, list[int], list[float]]]:
    """The logprob record of a row's n new tokens (sampler rows first .. first + n - 1), with its top k."""
    rows = range(first, first + n)
    lps, ranks = sampled.sampled_logprobs, sampled.sampled_ranks
    if not k or sampled.topk_token_ids is None:
        return [(float(lps[r]), int(ranks[r]), [], []) for r in rows]
    ids, top = sampled.topk_token_ids, sampled.topk_logprobs
    return [(float(lps[r]), int(ranks[r]), ids[r, :k].tolist(), top[r, :k].tolist()) for r in rows]


def _prompt_k(asked: int, available: int) -> int:
    """The top-k columns a request's prompt logprobs keep: what it asked for (-1: all the step computed)."""
    return available if asked == -1 else min(asked, available)
