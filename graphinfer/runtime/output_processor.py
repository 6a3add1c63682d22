"""Sampled tokens out (vLLM's OutputProcessor): each row's tokens appended on the host one by one, with drafts
accepted, logprobs recorded, grammars advanced, text detokenized and stops checked; finished requests leave the
scheduler, and RequestOutputs are built."""
import logging

from graphinfer.outputs import CompletionOutput, Logprob, RequestOutput
from graphinfer.runtime.detokenizer import find_stop_string
from graphinfer.runtime.parallel_sampling import ParentRequest
from graphinfer.runtime.sampler import SamplerOutput
from graphinfer.runtime.scheduler import Scheduler
from graphinfer.runtime.sequence import Sequence, SequenceStatus
from graphinfer.runtime.spec_decode.metrics import SpecDecodingStats
from graphinfer.runtime.structured_output import StructuredOutputManager
from graphinfer.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, structured_output: StructuredOutputManager, tokenizer,
                 eos_token_ids: set[int], max_model_len: int):
        self.scheduler, self.structured_output, self.tokenizer = scheduler, structured_output, tokenizer
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self.requests: dict[str, Sequence] = {}  # the sequences that run (a parallel-sampling request's children)
        self.parents: dict[str, ParentRequest] = {}  # parallel-sampling requests by their id

    def add_request(self, seq: Sequence) -> list[Sequence]:
        """Track a request until it finishes; returns the sequences to schedule (a parallel-sampling one's children)."""
        if seq.children:
            self.parents[seq.request_id] = ParentRequest(seq)
        for s in seq.children or [seq]:
            self.requests[s.request_id] = s
        return seq.children or [seq]

    def abort_request(self, request_id: str) -> None:
        """Abort a request (every child of a parallel-sampling one) and free its blocks."""
        parent = self.parents.pop(request_id, None)
        for seq in parent.children if parent is not None else [self.requests.get(request_id)]:
            if seq is not None and self.requests.pop(seq.request_id, None) is not None and not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def process(self, rows: list[Sequence], sampled: SamplerOutput,
                spec_stats: SpecDecodingStats | None = None) -> list[RequestOutput]:
        """Append each row's tokens (on the host) one by one, check stops, and build the outputs. A verification step
        (speculative decoding) emits a row's accepted drafts and one more token; a stop mid-proposal drops the rest.
        spec_stats: speculative decoding's counters, which its rows add to (None: it is off)."""
        spec = sampled.output_token_ids is not None
        emitted = (sampled.output_token_ids if spec else sampled.sampled_token_ids[:, None]).tolist()
        outputs, row = [], 0
        for seq, tokens in zip(rows, emitted):
            first, row = row, row + 1 + len(seq.spec_token_ids)  # its sampler rows: one per draft position
            if seq.is_finished:  # aborted, or stopped a step earlier (async scheduling): its tokens are dropped
                continue
            if spec:
                tokens = self._accept_drafts(seq, tokens, spec_stats)
            for j, token in enumerate(tokens):
                self._append(seq, token, sampled, first + j)
                if seq.is_finished:
                    break
            else:
                if spec:  # the rejected drafts' lookahead blocks go back; full blocks of accepted tokens get cached
                    self.scheduler.block_manager.trim(seq)
                    self.scheduler.block_manager.cache_full_blocks(seq)
            if seq.is_finished or seq.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
                out = self._output(seq, spec_stats is not None)
                if seq.parent is not None:  # a child: its output becomes its request's (None: siblings still run)
                    out = seq.parent.output(seq, out)
                    if seq.parent.finished:
                        self.parents.pop(seq.parent.request_id, None)
                if out is not None:
                    outputs.append(out)
            if seq.is_finished:
                self.requests.pop(seq.request_id, None)
        return outputs

    def _accept_drafts(self, seq: Sequence, emitted: list[int], spec_stats: SpecDecodingStats) -> list[int]:
        """The tokens a verified row emits (its -1 padding cut); its accepted drafts' KV becomes computed."""
        tokens = emitted[:emitted.index(-1)] if -1 in emitted else emitted
        if k := len(seq.spec_token_ids):
            spec_stats.observe(k, len(tokens) - 1)
            seq.num_draft_tokens += k
            seq.num_accepted_tokens += len(tokens) - 1
        seq.num_computed_tokens += len(tokens) - 1
        seq.spec_token_ids = []
        return tokens

    def _append(self, seq: Sequence, token: int, sampled: SamplerOutput, row: int) -> None:
        seq.append_token(token)
        if seq.grammar is not None and not self.structured_output.accept_token(seq.grammar, token):
            logger.error("request %s: its grammar rejected the sampled token %d (a bug); the request ends",
                         seq.request_id, token)
            self.scheduler.finish(seq, "abort")
            return
        if seq.logprobs is not None:
            self._record_logprobs(seq, token, sampled, row)
        delta = ""
        if seq.detokenizer:
            delta = seq.detokenizer.add_token(token)
            seq.output_text = seq.detokenizer.output_text
        reason = self._check_stop(seq, token, delta)
        if reason is None:
            return
        if seq.detokenizer and not isinstance(seq.stop_reason, str):
            seq.detokenizer.flush()  # text held back for an unfinished UTF-8 char decodes as a full decode would
            seq.output_text = seq.detokenizer.output_text
        self.scheduler.finish(seq, reason)

    def _check_stop(self, seq: Sequence, token: int, delta: str) -> str | None:
        """"stop" / "length" if seq is done after `token` (setting stop_reason, cutting a stop string), else None."""
        params = seq.sampling_params
        if seq.grammar is not None and seq.grammar.is_terminated():
            # structured outputs: the grammar's end (its stop token accepted) is the output's end; min_tokens and
            # ignore_eos do not extend it (the grammar would allow nothing more)
            return "stop"
        if len(seq.output_token_ids) >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                return "stop"
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return "stop"
            if params.stop_strings and delta:
                hit = find_stop_string(seq.output_text, len(delta), params.stop_strings, params.include_stop_str_in_output)
                if hit is not None:
                    seq.output_text, seq.stop_reason = hit
                    return "stop"
        if len(seq.output_token_ids) >= seq.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _record_logprobs(self, seq: Sequence, token: int, sampled: SamplerOutput, row: int) -> None:
        lp = float(sampled.sampled_logprobs[row])
        seq.cumulative_logprob += lp
        entry = {token: Logprob(lp, int(sampled.sampled_ranks[row]))}
        n = seq.sampling_params.logprobs
        if n and sampled.topk_token_ids is not None:
            ids = sampled.topk_token_ids[row, :n].tolist()
            lps = sampled.topk_logprobs[row, :n].tolist()
            for rank, (tid, tlp) in enumerate(zip(ids, lps), start=1):
                entry.setdefault(tid, Logprob(tlp, rank))
        if self.tokenizer is not None:
            for tid, logprob in entry.items():
                logprob.decoded_token = self.tokenizer.decode([tid])
        seq.logprobs.append(entry)

    def _output(self, seq: Sequence, spec_metrics: bool) -> RequestOutput:
        completion = CompletionOutput(
            index=seq.index, text=seq.output_text, token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            logprobs=seq.logprobs, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
        metrics = {} if not spec_metrics else {"spec_decode_num_draft_tokens": seq.num_draft_tokens,
                                                      "spec_decode_num_accepted_tokens": seq.num_accepted_tokens}
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion],
                             finished=seq.status == SequenceStatus.FINISHED, num_cached_tokens=seq.num_cached_tokens,
                             metrics=metrics)
