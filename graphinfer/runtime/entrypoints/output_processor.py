"""Tokens out (vLLM v1's OutputProcessor): the engine core's per-step EngineCoreOutputs turned into RequestOutputs.
Per request it keeps what the user sees: the text (detokenized incrementally), logprob dicts with decoded tokens (the
prompt's too: RequestOutput.prompt_logprobs), the cumulative logprob, stop strings, and a parallel-sampling request's
children gathered back (ParentRequest). It never changes a request's progress in the core: a stop string it finds
ends the request here and is returned as an abort for the core."""
from dataclasses import dataclass, field

from graphinfer.outputs import CompletionOutput, Logprob, RequestOutput
from graphinfer.runtime.engine.request import EngineCoreOutput, EngineCoreRequest, PromptLogprobs
from graphinfer.runtime.entrypoints.detokenizer import IncrementalDetokenizer, find_stop_string
from graphinfer.runtime.entrypoints.input_processor import Request
from graphinfer.runtime.entrypoints.parallel_sampling import ParentRequest, child_params, child_request_id
from graphinfer.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class RequestState:
    """One request's (or one parallel-sampling child's) output as it grows."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    logprobs: list[dict] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)  # speculative decoding's per-request counters
    parent: ParentRequest | None = None
    index: int = 0  # its CompletionOutput.index (a child's place among its siblings)
    prompt_logprobs: list[dict | None] | None = None  # RequestOutput.prompt_logprobs, once the core sent them


class OutputProcessor:
    def __init__(self, tokenizer, spec_metrics: bool = False):
        """spec_metrics: speculative decoding is on (each RequestOutput carries its draft counters)."""
        self.tokenizer, self.spec_metrics = tokenizer, spec_metrics
        self.requests: dict[str, RequestState] = {}  # what the core runs (a parallel-sampling request's children)
        self.parents: dict[str, ParentRequest] = {}  # parallel-sampling requests by their id

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def in_use(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self.parents

    def add_request(self, req: Request) -> list[EngineCoreRequest]:
        """Track a request until it finishes; returns what the core runs for it (a parallel-sampling one's
        children)."""
        params = req.sampling_params
        if params.num_candidates > 1:  # parallel sampling: the children run, the request gathers their outputs
            runs = [(child_request_id(req.request_id, i), child_params(params, i))
                    for i in range(params.num_candidates)]
        else:
            runs = [(req.request_id, params)]
        states = [self._state(rid, req, p, i) for i, (rid, p) in enumerate(runs)]
        if params.num_candidates > 1:
            self.parents[req.request_id] = ParentRequest(req, states)
        for state in states:
            self.requests[state.request_id] = state
        return [EngineCoreRequest(s.request_id, req.prompt_token_ids, s.sampling_params, req.max_tokens, req.grammar,
                                  req.lora_request)
                for s in states]

    def _state(self, request_id: str, req: Request, params: SamplingParams, index: int) -> RequestState:
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.skip_special_tokens) \
            if self.tokenizer is not None else None
        return RequestState(request_id, req.prompt, req.prompt_token_ids, params, detok,
                            logprobs=[] if params.logprobs is not None else None, index=index)

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request (every child of a parallel-sampling one); returns the ids the core must abort."""
        parent = self.parents.pop(request_id, None)
        ids = [c.request_id for c in parent.children] if parent is not None else [request_id]
        return [rid for rid in ids if self.requests.pop(rid, None) is not None]

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """(the RequestOutputs of this step's core outputs, the request ids a stop string ended: abort them in the
        core). Outputs of requests no longer tracked (aborted, or ended by a stop string a step earlier) are
        dropped."""
        request_outputs, stopped = [], []
        for eco in outputs:
            state = self.requests.get(eco.request_id)
            if state is None:
                continue
            params = state.sampling_params
            if eco.prompt_logprobs is not None:
                state.prompt_logprobs = self._prompt_logprobs(state.prompt_token_ids, eco.prompt_logprobs)
            # vLLM: the token that stopped the request (EOS, a stop_token_id) is in token_ids but not in the text,
            # unless include_stop_str_in_output
            last_unread = len(eco.new_token_ids) - 1 if eco.finish_reason == "stop" and \
                not params.include_stop_str_in_output else -1
            for j, token in enumerate(eco.new_token_ids):
                state.output_token_ids.append(token)
                if state.logprobs is not None:
                    self._record_logprobs(state, token, eco.new_logprobs[j])
                delta = ""
                if state.detokenizer is not None and j != last_unread:
                    delta = state.detokenizer.add_token(token)
                    state.output_text = state.detokenizer.output_text
                if params.stop_strings and delta and len(state.output_token_ids) >= params.min_tokens:
                    hit = find_stop_string(state.output_text, len(delta), params.stop_strings,
                                           params.include_stop_str_in_output)
                    if hit is not None:
                        state.output_text, state.stop_reason = hit
                        state.finish_reason = "stop"
                        if not eco.finished:
                            stopped.append(state.request_id)
                        break
            else:
                if eco.finished:
                    state.finish_reason, state.stop_reason = eco.finish_reason, eco.stop_reason
                    if state.detokenizer is not None:  # text held back for an unfinished UTF-8 char decodes as a
                        state.detokenizer.flush()  # full decode would
                        state.output_text = state.detokenizer.output_text
            state.num_cached_tokens = eco.num_cached_tokens
            if self.spec_metrics:
                state.metrics = {"spec_decode_num_draft_tokens": eco.num_draft_tokens,
                                 "spec_decode_num_accepted_tokens": eco.num_accepted_tokens}
            finished = state.finish_reason is not None
            if finished:
                self.requests.pop(state.request_id, None)
            if finished or params.output_kind != RequestOutputKind.FINAL_ONLY:
                out = self._output(state)
                if state.parent is not None:  # a child: its output becomes its request's (None: siblings still run)
                    out = state.parent.output(state, out)
                    if state.parent.finished:
                        self.parents.pop(state.parent.request_id, None)
                if out is not None:
                    request_outputs.append(out)
        return request_outputs, stopped

    def _record_logprobs(self, state: RequestState, token: int, record) -> None:
        lp, rank, top_ids, top_lps = record
        state.cumulative_logprob += lp
        entry = {token: Logprob(lp, rank)}
        for r, (tid, tlp) in enumerate(zip(top_ids, top_lps), start=1):
            entry.setdefault(tid, Logprob(tlp, r))
        if self.tokenizer is not None:
            for tid, logprob in entry.items():
                logprob.decoded_token = self.tokenizer.decode([tid])
        state.logprobs.append(entry)

    def _prompt_logprobs(self, prompt_token_ids: list[int], plp: PromptLogprobs) -> list[dict | None]:
        """vLLM's shape: None for the first prompt token, then per prompt token {its id: Logprob, and the top k's},
        each with its decoded token."""
        decoded: dict[int, str] = {}

        def decode(tid: int) -> str | None:
            if self.tokenizer is None:
                return None
            if tid not in decoded:
                decoded[tid] = self.tokenizer.decode([tid])
            return decoded[tid]

        out: list[dict | None] = [None]
        lps, ranks = plp.logprobs.tolist(), plp.ranks.tolist()
        top_ids, top_lps = plp.topk_ids.tolist(), plp.topk_logprobs.tolist()
        for i, token in enumerate(prompt_token_ids[1:]):
            entry = {token: Logprob(lps[i], ranks[i], decode(token))}
            for r, (tid, tlp) in enumerate(zip(top_ids[i], top_lps[i]), start=1):
                if tid not in entry:
                    entry[tid] = Logprob(tlp, r, decode(tid))
            out.append(entry)
        return out

    @staticmethod
    def _output(state: RequestState) -> RequestOutput:
        completion = CompletionOutput(
            index=state.index, text=state.output_text, token_ids=list(state.output_token_ids),
            cumulative_logprob=state.cumulative_logprob if state.logprobs is not None else None,
            logprobs=state.logprobs, finish_reason=state.finish_reason, stop_reason=state.stop_reason)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, [completion],
                             finished=state.finish_reason is not None, num_cached_tokens=state.num_cached_tokens,
                             metrics=dict(state.metrics), prompt_logprobs=state.prompt_logprobs)
