"""Data-parallel lockstep, for MoE models with expert parallel over several replicas (vLLM's DP + EP).

Every replica's MoE layers exchange tokens with every other's (ep_dispatch / ep_combine over the whole world), so
every replica must run every step, with the same token count and the same graph path, or an all-to-all waits
forever. Before each step the replicas' leaders agree, in one all-reduce(max) on the "dp" gloo group, on the
largest token and row counts, whether every batch is a uniform decode, and whether to stop; each then pads its
step to that shape (worker/inputs.py: pad_inputs). A replica with nothing to do runs a padding-only step (vLLM's
dummy batch). Padding rows write no KV (slot -1), sample nothing and count no expert load. Dense replicas never need
this: they share no collective.
"""
from graphinfer.distributed import parallel_state as ps
from graphinfer.runtime.engine.scheduler import SchedulerOutput
from graphinfer.runtime.worker.inputs import DPStep


def agree(sched: SchedulerOutput | None, stop: bool = False) -> DPStep:
    """This replica's step shape against every other's (leaders only; every leader calls it once per step). Replica 0
    drives the rounds: its wait is bounded by the distributed timeout (a replica that stalls fails the round, naming
    it); the others wait for its next round as long as the server stays idle (a dead replica 0 ends their wait)."""
    counts = [s.num_tokens for s in sched.scheduled] if sched is not None else []
    # a step with prompt-logprob rows cannot replay a full decode graph (it returns the last tokens' rows only)
    nonuniform = int(any(n != 1 for n in counts) or
                     any(s.prompt_logprobs is not None for s in (sched.scheduled if sched is not None else [])))
    T, B, nonuniform, stop = ps.dp_all_reduce_max([sum(counts), len(counts), nonuniform, int(stop)],
                                                  bounded=ps.dp_rank() == 0)
    return DPStep(T, B, not nonuniform, bool(stop))


class Lockstep:
    """One replica's side of the rounds; enabled for MoE + expert parallel over several replicas (else every method
    is a no-op)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.stopped = False  # the front end ended the rounds
        self.rounds = 0

    def agree(self, sched: SchedulerOutput | None, stop: bool = False) -> DPStep | None:
        """The step shape every replica pads to, or None when no replica has work, the rounds stopped, or lockstep
        is off."""
        if not self.enabled:
            return None
        self.rounds += 1
        ps.set_phase(f"data-parallel lockstep round {self.rounds}")
        step = agree(sched, stop)
        self.stopped |= step.stop
        return step if step.num_tokens and not step.stop else None

    def stop_rounds(self) -> None:
        """Front end (replica 0), at shutdown: one last round that tells the other lockstep replicas to stop."""
        if self.enabled and not self.stopped:
            self.agree(None, stop=True)
