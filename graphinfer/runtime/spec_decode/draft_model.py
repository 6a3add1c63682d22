"""Draft-model proposer: a smaller model with the target's vocabulary proposes k tokens greedily.

The draft is a Worker of its own (loaded, passed, lowered and captured with the target's graph mode and kernels) with
a block manager over its KV cache: for each target request about to decode, a mirror Sequence holds the request's
tokens. A proposal round first brings the mirror up to the target's tokens (its KV stays valid up to the first token
that differs: after a rejection only the rejected drafts' positions are recomputed), then runs k one-token steps on
the draft, taking the argmax each time. Rounds after the first are uniform decode batches, which replay the draft's
own decode graphs where it has them.
"""
from dataclasses import replace

from graphinfer.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SpeculativeConfig
from graphinfer.errors import InvalidConfigError
from graphinfer.runtime.engine.block_manager import BlockManager
from graphinfer.runtime.engine.scheduler import ScheduledRequest, SchedulerOutput
from graphinfer.runtime.engine.sequence import Sequence, SequenceStatus
from graphinfer.runtime.spec_decode.ngram_proposer import draft_budget
from graphinfer.runtime.worker.worker import Worker
from graphinfer.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0)


class DraftModelProposer:
    def __init__(self, spec: SpeculativeConfig, target):
        """target: the EngineCore whose requests get drafts."""
        tc = target.config
        if tc.parallel_config.world_size > 1:
            raise InvalidConfigError("speculative_config with a draft model runs at tensor_parallel_size=1 and "
                                     "data_parallel_size=1 for now; use method 'ngram' with parallel layouts.")
        mc = tc.model_config
        draft_mc = ModelConfig(spec.model, mc.dtype, target.max_model_len, mc.seed, str(target.device))
        # As many KV blocks as the target's: the draft never holds more tokens than the target does.
        num_blocks = target.worker.num_blocks
        cc = CacheConfig(tc.cache_config.block_size, enable_prefix_caching=False, num_gpu_blocks_override=num_blocks,
                         kv_cache_dtype=tc.cache_config.kv_cache_dtype)
        draft_config = EngineConfig(draft_mc, cc, replace(tc.scheduler_config, async_scheduling=False),
                                    replace(tc.compile_config, capture_sizes=target.worker.dispatcher.capture_sizes),
                                    ParallelConfig())
        self.worker = Worker(draft_config, target.platform, target.backend)
        if (v := self.worker.hf_config.vocab_size) != (tv := target.hf_config.vocab_size):
            self.worker.release(tensors=True)
            raise InvalidConfigError(f"Draft model {spec.model!r} has a vocabulary of {v} tokens, the target {tv}: "
                                     f"a draft must share the target's tokenizer.")
        self.block_manager = BlockManager(num_blocks, cc.block_size, enable_prefix_caching=False)
        self.k = spec.num_speculative_tokens
        self.mirrors: dict[str, Sequence] = {}  # target request id -> its sequence in the draft's cache
        self.synced: dict[str, int] = {}  # target request id -> its length at the last sync

    def propose_for(self, seqs: list[Sequence]) -> None:
        """Set each sequence's spec_token_ids: up to k greedy draft tokens ([] where the draft's cache is full)."""
        bm = self.block_manager
        live = {s.request_id for s in seqs}
        for rid in [r for r in self.mirrors if r not in live]:  # finished, aborted, preempted or mid-prompt
            bm.free(self.mirrors.pop(rid))
            self.synced.pop(rid, None)
        budgets = {}
        for seq in seqs:
            seq.spec_token_ids = []
            if (k := draft_budget(seq, self.k)) > 0:
                budgets[seq.request_id] = k
                self._sync(seq)
        runner = self.worker.model_runner
        for r in range(max(budgets.values(), default=0)):
            sched = SchedulerOutput()
            for seq in seqs:
                m = self.mirrors.get(seq.request_id)
                if m is None or budgets.get(seq.request_id, 0) <= r:
                    continue
                n = m.num_tokens - m.num_computed_tokens
                if not bm.can_append(m, n):  # the draft's cache is full: this request proposes what it has
                    budgets[seq.request_id] = r
                    continue
                bm.append_slots(m, n)
                sched.scheduled.append(ScheduledRequest(m, n, m.num_computed_tokens, samples=True))
                m.num_computed_tokens += n
            if not sched.scheduled:
                break
            sampled = runner.execute(runner.host_inputs(sched)).to_host()
            for m, token in zip(sched.rows, sampled.sampled_token_ids.tolist()):
                m.token_ids.append(token)
        for seq in seqs:
            if (m := self.mirrors.get(seq.request_id)) is not None:
                seq.spec_token_ids = m.token_ids[len(seq.token_ids):len(seq.token_ids) + budgets.get(seq.request_id, 0)]

    def _sync(self, seq: Sequence) -> None:
        """Bring seq's mirror to seq's tokens, keeping the draft KV of the prefix they share."""
        m = self.mirrors.get(seq.request_id)
        if m is None:
            m = self.mirrors[seq.request_id] = Sequence(seq.request_id, seq.token_ids, _GREEDY, seq.max_tokens)
            m.status = SequenceStatus.RUNNING
        # The target's tokens never change, so the two agree up to the last sync's length; past it the mirror holds
        # the drafts of the last round, which agree with the target up to the first rejected one.
        common = self.synced.get(seq.request_id, 0)
        while common < min(len(m.token_ids), len(seq.token_ids)) and m.token_ids[common] == seq.token_ids[common]:
            common += 1
        m.token_ids = list(seq.token_ids)
        self.synced[seq.request_id] = len(seq.token_ids)
        m.num_computed_tokens = min(m.num_computed_tokens, common, len(seq.token_ids) - 1)
        self.block_manager.trim(m)

    def shutdown(self) -> None:
        self.mirrors.clear()
        self.worker.release(tensors=True)
