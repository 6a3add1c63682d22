"""The scheduler alone, no model: schedule() and update_from_output() over sampled tokens made up here, as the
engine core drives them (vLLM v1's Scheduler tests). update_from_output is the one place a request advances."""
import torch

from graphinfer.config import CacheConfig, SchedulerConfig
from graphinfer.runtime.engine.scheduler import Scheduler
from graphinfer.runtime.engine.sequence import Sequence, SequenceStatus
from graphinfer.runtime.spec_decode.metrics import SpecDecodingStats
from graphinfer.runtime.worker.sampler import SamplerOutput
from graphinfer.sampling_params import SamplingParams

EOS = 2


def _seq(i, n, max_tokens=8, **params) -> Sequence:
    return Sequence(str(i), list(range(i * 1000 + 10, i * 1000 + 10 + n)), SamplingParams(max_tokens=max_tokens, **params),
                    max_tokens, {EOS})


def _sampled(tokens: list[int], logprobs: bool = False) -> SamplerOutput:
    t = torch.tensor(tokens, dtype=torch.int64)
    if not logprobs:
        return SamplerOutput(t, None, None, None, None)
    n = len(tokens)
    return SamplerOutput(t, -torch.arange(n, dtype=torch.float32), torch.ones(n, dtype=torch.int64),
                         torch.stack([t, t + 1], 1), torch.zeros(n, 2))


def _step(sched: Scheduler, token: int = 7):
    """One step: schedule, then every sampling row gets `token`."""
    out = sched.schedule()
    return out, sched.update_from_output(out, _sampled([token] * len(out.rows)) if out.rows else None)


def _sched(max_num_seqs=8, budget=100, blocks=64, block_size=4, **kw) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget), CacheConfig(block_size=block_size),
                     blocks, max_model_len=64, **kw)


def test_decodes_and_prefill_chunks_share_a_step_within_the_budget():
    sched = _sched(budget=10)
    sched.add_request(_seq(0, 3))
    _step(sched)  # seq 0 prefilled, one token sampled
    sched.add_request(_seq(1, 25))
    for want in ([("0", 1), ("1", 9)], [("0", 1), ("1", 9)], [("0", 1), ("1", 7)]):  # a decode + a prefill chunk
        out, outputs = _step(sched)
        assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == want
        assert out.num_tokens <= 10
    # the chunks mid-prompt sample nothing: seq 1's first token comes with the step that ends its prompt
    assert [o.request_id for o in outputs] == ["0", "1"]
    assert sched.requests["1"].num_computed_tokens == 25 and sched.requests["1"].output_token_ids == [7]


def test_decode_advances_computed_tokens_and_appends():
    sched = _sched()
    seq = _seq(0, 5)
    sched.add_request(seq)
    out = sched.schedule()
    assert seq.num_computed_tokens == 5 and seq.num_pending == 1  # counted at schedule: the token is on its way
    assert [(s.start, s.num_tokens, s.samples) for s in out.scheduled] == [(0, 5, True)]
    [o] = sched.update_from_output(out, _sampled([42]))
    assert (o.new_token_ids, o.finished, seq.num_pending) == ([42], False, 0)
    assert seq.token_ids[-1] == 42 and seq.num_tokens == 6
    out = sched.schedule()
    assert [(s.start, s.num_tokens) for s in out.scheduled] == [(5, 1)]


def test_token_stops_and_length():
    sched = _sched()
    eos, stop_id, length = _seq(0, 3), _seq(1, 3, stop_token_ids=[9]), _seq(2, 3, max_tokens=2)
    min_tokens = _seq(3, 3, min_tokens=2)
    for s in (eos, stop_id, length, min_tokens):
        sched.add_request(s)
    out = sched.schedule()
    outs = {o.request_id: o for o in sched.update_from_output(out, _sampled([EOS, 9, 5, EOS]))}
    assert (outs["0"].finish_reason, outs["0"].stop_reason) == ("stop", None)
    assert (outs["1"].finish_reason, outs["1"].stop_reason) == ("stop", 9)
    assert outs["2"].finish_reason is None and outs["3"].finish_reason is None  # min_tokens: EOS does not stop yet
    out = sched.schedule()
    outs = {o.request_id: o for o in sched.update_from_output(out, _sampled([5, 5]))}
    assert outs["2"].finish_reason == "length" and outs["3"].finish_reason is None
    assert eos.is_finished and not eos.block_table and "0" not in sched.requests
    assert [s.request_id for s in sched.running] == ["3"]


def test_logprobs_travel_with_the_tokens():
    sched = _sched()
    sched.add_request(_seq(0, 3, logprobs=1))
    out = sched.schedule()
    [o] = sched.update_from_output(out, _sampled([5], logprobs=True))
    assert o.new_logprobs == [(0.0, 1, [5], [0.0])]


def test_spec_acceptance_takes_back_rejected_drafts():
    stats = SpecDecodingStats(3)
    sched = _sched(spec_stats=stats)
    seq = _seq(0, 6)
    sched.add_request(seq)
    _step(sched)  # prefill: 6 computed, 1 output token
    seq.spec_token_ids = [100, 101, 102]
    out = sched.schedule()
    assert [(s.num_tokens, s.samples) for s in out.scheduled] == [(4, True)]  # the decode token + 3 drafts
    assert seq.num_computed_tokens == 10
    emitted = torch.tensor([[100, 101, 55, -1]])  # 2 drafts accepted, then the target's token
    [o] = sched.update_from_output(out, SamplerOutput(torch.zeros(4, dtype=torch.int64), None, None, None, None,
                                                      output_token_ids=emitted))
    assert o.new_token_ids == [100, 101, 55] and o.num_draft_tokens == 3 and o.num_accepted_tokens == 2
    assert seq.num_computed_tokens == 9 and seq.token_ids[-3:] == [100, 101, 55] and not seq.spec_token_ids
    assert len(seq.block_table) == 3 and stats.num_accepted_tokens == 2  # the rejected draft's slot went back


def test_max_num_seqs_and_preemption_order():
    sched = _sched(max_num_seqs=2, blocks=5)
    for i in range(3):
        sched.add_request(_seq(i, 8))
    out, _ = _step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["0", "1"]  # max_num_seqs caps admission
    out, _ = _step(sched)  # both need a third block; only one is free: the newest (1) is preempted
    assert [s.request_id for s in out.preempted] == ["1"]
    assert [s.seq.request_id for s in out.scheduled] == ["0"]
    assert [s.request_id for s in sched.waiting] == ["1", "2"]
    assert sched.waiting[0].num_computed_tokens == 0 and not sched.waiting[0].block_table
    assert sched.waiting[0].status == SequenceStatus.WAITING and sched.waiting[0].output_token_ids == [7]


def test_async_placeholder_lets_the_next_step_schedule_before_tokens_land():
    sched = _sched()
    seq = _seq(0, 4, max_tokens=3)
    sched.add_request(seq)
    first = sched.schedule()  # the prefill, its token in flight
    second = sched.schedule()  # the decode of that token, scheduled before it lands
    assert [(s.start, s.num_tokens, s.pending_row) for s in second.scheduled] == [(4, 1, 0)]
    assert seq.num_pending == 2 and seq.output_token_ids == []
    sched.update_from_output(first, _sampled([11]))
    third = sched.schedule()  # the third (last, max_tokens 3) token's step, while the second is in flight
    assert [(s.start, s.num_tokens, s.pending_row) for s in third.scheduled] == [(5, 1, 0)]
    assert not sched.schedule().scheduled  # its last token is on the way: nothing more until it lands
    [o] = sched.update_from_output(second, _sampled([12]))
    assert o.new_token_ids == [12] and o.finish_reason is None
    [o] = sched.update_from_output(third, _sampled([13]))
    assert o.finish_reason == "length" and seq.output_token_ids == [11, 12, 13] and seq.num_pending == 0


def test_abort_and_a_finished_rows_late_tokens():
    sched = _sched()
    seq = _seq(0, 4)
    sched.add_request(seq)
    out = sched.schedule()
    sched.finish_requests(["0"])  # aborted while its step runs
    assert sched.update_from_output(out, _sampled([5])) == [] and seq.output_token_ids == []
    assert not sched.has_unfinished_requests() and sched.block_manager.num_free_blocks == 64


def _lora_seq(i, n, lora_id, max_tokens=8):
    from graphinfer.lora import LoRARequest

    seq = _seq(i, n, max_tokens)
    seq.lora_request = LoRARequest(f"a{lora_id}", lora_id, "/adapter") if lora_id else None
    return seq


def test_a_step_holds_at_most_max_loras_adapters_and_a_held_request_is_not_starved():
    """max_loras=1: requests of the running adapter (and of none) pass one of another adapter, as vLLM's scheduler lets
    them, until it has waited LORA_MAX_WAITS steps; then nobody passes it, and it runs once the running adapter
    drains."""
    from graphinfer.runtime.engine import scheduler as scheduler_module

    sched = _sched(max_loras=1)
    sched.add_request(_lora_seq(0, 4, 1, max_tokens=30))
    sched.add_request(_lora_seq(1, 4, 2))
    sched.add_request(_lora_seq(2, 4, 1))
    sched.add_request(_lora_seq(3, 4, 0))
    out, _ = _step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["0", "2", "3"]  # 1's adapter does not fit: passed
    for i in range(4, 4 + scheduler_module.LORA_MAX_WAITS):  # a stream of adapter-1 requests keeps arriving
        sched.add_request(_lora_seq(i, 4, 1, max_tokens=2))
        out, _ = _step(sched)
        ids = {s.seq.lora_request.lora_int_id for s in out.scheduled if s.seq.lora_request is not None}
        assert ids <= {1}
    sched.add_request(_lora_seq(99, 4, 1))
    seen = []
    while "1" not in seen:
        out, _ = _step(sched)
        seen = [s.seq.request_id for s in out.scheduled]
        assert "99" not in seen or "1" in seen  # held at last: nobody passes request 1 any more
    assert {s.seq.lora_request.lora_int_id for s in out.scheduled if s.seq.lora_request} == {2}
