"""Continuous-batching scheduler with a token budget, chunked prefill and preemption by recompute.

Each step (vLLM v1's unified scheme): running sequences first, in arrival order, each taking what it
still needs (1 token for a decode, the rest of its prompt for a chunked prefill) out of
max_num_batched_tokens; then waiting sequences are admitted while the budget, max_num_seqs and free
blocks allow, their prompts chunked to fit. Decodes and prefill chunks share a step. When a running
sequence needs a block and none is free, the most recently admitted one is preempted: its blocks are
freed (their hashes kept, so its recompute is mostly prefix-cache hits) and it goes back to the front
of the waiting queue. A request that could never fit is refused at admission (engine), so a sequence
running alone always has room and the scheduler always makes progress.

With speculative decoding a decoding sequence also computes its draft tokens (seq.spec_token_ids), whose KV
goes into lookahead slots; drafts that do not fit the token budget (or would need a preemption) are dropped.

Blocks that a step fills with known tokens are offered to the prefix cache when it is scheduled (vLLM v1's
order), so a sequence admitted later in the same step already shares them: parallel sampling's children compute
their common prompt once. (Each layer writes the whole step's KV before its attention reads any; a step that fails
withdraws them: BlockManager.uncache.)

With async scheduling a sequence may have a token still on its way from the device (num_pending): it is
scheduled as a decode all the same, except when that token is its last (max_tokens), and after a
preemption it is not re-admitted before the token lands.
"""
from collections import deque
from dataclasses import dataclass, field

from graphinfer.config import CacheConfig, SchedulerConfig
from graphinfer.runtime.block_manager import BlockManager
from graphinfer.runtime.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute now)
    preempted: list[Sequence] = field(default_factory=list)
    cached_blocks: list[int] = field(default_factory=list)  # offered to the prefix cache for this step (see below)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int):
        self.config = scheduler_config
        self.block_manager = BlockManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def stats(self) -> dict:
        """The load, for /metrics and the data-parallel front end."""
        return {"running": len(self.running), "waiting": len(self.waiting), "kv_usage": self.block_manager.usage,
                "preemptions": self.num_preemptions}

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending and seq.num_output_tokens >= seq.max_tokens:
                i += 1  # async scheduling: its last token is on the way; it ends on length once that lands
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
                out.scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            break
        if out.preempted:  # memory is short: don't admit anyone this step
            return out
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:  # preempted with a token on its way (async scheduling): admit it once it lands
                break
            cached = self.block_manager.find_cached_blocks(seq)
            n = seq.num_tokens - len(cached) * self.block_manager.block_size
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.block_manager.can_allocate(seq, cached, n):
                break
            self.block_manager.allocate(seq, cached, n)
            out.cached_blocks += self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens + n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take seq out of the queues and release its blocks (finished, stopped or aborted)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.grammar = None  # structured outputs: its matcher goes now, not with the last reference to the sequence
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
