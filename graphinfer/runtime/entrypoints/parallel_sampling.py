"""Parallel sampling (SamplingParams n > 1, best_of > 1), as vLLM v1's ParentRequest: a request fans out into best_of
child sequences of its prompt, and their outputs are gathered back under the request's id.

To the engine core the children are ordinary requests. Their prompt KV is computed once: the scheduler offers the full
blocks of what it schedules to the prefix cache at once (as vLLM v1 does), so the siblings admitted after the first
child, in the same step, hit its prompt blocks and compute only the last, partial one. A seeded request's child i
samples with seed + i (vLLM's rule): the children differ, and child i equals an n=1 request with that seed.

Outputs. Streamed (CUMULATIVE): each child's CompletionOutput (index i) in a RequestOutput of its own under the
request's id, `finished` once every child has. FINAL_ONLY: one RequestOutput with the n CompletionOutputs in index
order. best_of > n: once every candidate has finished, the n with the highest cumulative logprob, best first
(index 0..n-1); to rank them the children compute their logprobs even where the request asked for none.
"""
from dataclasses import replace

from graphinfer.outputs import RequestOutput
from graphinfer.sampling_params import RequestOutputKind, SamplingParams


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params child `index` samples with: n = 1, its own seed, and what ranking needs. Prompt logprobs are child
    0's alone (the prompt is the same; the others take its blocks from the prefix cache)."""
    seed = params.seed
    if seed is not None:
        seed += index
        if seed >= 2**64:  # wraps: still the 64-bit seed range SamplingParams accepts
            seed -= 2**64
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    if params.num_candidates == params.n:
        return replace(params, n=1, best_of=None, seed=seed, prompt_logprobs=prompt_logprobs)
    return replace(params, n=1, best_of=None, seed=seed, output_kind=RequestOutputKind.FINAL_ONLY,
                   logprobs=0 if params.logprobs is None else params.logprobs, prompt_logprobs=prompt_logprobs)


def child_request_id(request_id: str, index: int) -> str:
    """Child `index`'s id (vLLM's "{i}_{request id}")."""
    return f"{index}_{request_id}"


class ParentRequest:
    """A request running as child requests (their RequestStates, entrypoints/output_processor.py): turns their outputs
    into the request's."""

    def __init__(self, request, children: list):
        params = request.sampling_params
        self.request_id, self.prompt, self.children = request.request_id, request.prompt, children
        self.n, self.ranked = params.n, params.num_candidates > params.n
        self.logprobs_asked = params.logprobs is not None
        self.streaming = params.output_kind != RequestOutputKind.FINAL_ONLY and not self.ranked
        self.unfinished = len(self.children)
        self.finals: dict[int, RequestOutput] = {}  # child index -> its final output (FINAL_ONLY, ranked)
        self.prompt_logprobs = None  # child 0's (the only child that computes them)
        for child in self.children:
            child.parent = self

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def output(self, child, out: RequestOutput) -> RequestOutput | None:
        """child's output (under child's id) as the request's; None while a FINAL_ONLY request still runs."""
        if out.finished:
            self.unfinished -= 1
        if child.index == 0 and out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if self.streaming:
            return replace(out, request_id=self.request_id, prompt=self.prompt, finished=self.finished,
                           prompt_logprobs=self.prompt_logprobs)
        self.finals[child.index] = out
        if not self.finished:
            return None
        finals = [self.finals[i] for i in range(len(self.children))]
        completions = [o.outputs[0] for o in finals]
        if self.ranked:
            best = sorted(completions, key=lambda c: c.cumulative_logprob, reverse=True)[:self.n]
            completions = [replace(c, index=i, logprobs=c.logprobs if self.logprobs_asked else None)
                           for i, c in enumerate(best)]
        metrics = {}
        for o in finals:  # speculative decoding's counters, summed over the children
            for k, v in o.metrics.items():
                metrics[k] = metrics.get(k, 0) + v
        metrics["num_cached_tokens"] = [c.num_cached_tokens for c in self.children]  # per child, in child order
        # the prompt as first computed: its later siblings took it from the prefix cache
        return replace(out, request_id=self.request_id, prompt=self.prompt, outputs=completions, finished=True,
                       num_cached_tokens=min(c.num_cached_tokens for c in self.children), metrics=metrics,
                       prompt_logprobs=self.prompt_logprobs)
