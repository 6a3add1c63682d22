"""The one encoding of what rank 0 sends the other tensor-parallel ranks (executor/step_encoding.py), apart from its
transport: every field survives the round trip, also read from a longer buffer (the transport's fixed capacity)."""
import numpy as np
import pytest

from graphinfer.runtime.executor import step_encoding as enc
from graphinfer.runtime.worker.inputs import DPStep, HostInputs, pad_inputs


def _inputs(pending: bool = False) -> HostInputs:
    return HostInputs(input_ids=np.array([5, 6, 7, 0, 9], dtype=np.int64), positions=np.array([0, 1, 2, 7, 3]),
                      slot_mapping=np.array([16, 17, 18, 39, -1]),
                      block_tables=np.array([[1, 0], [4, 2], [3, 0]], dtype=np.int32),
                      query_start_loc=np.array([0, 3, 4, 5], dtype=np.int32), seq_lens=np.array([3, 8, 4], dtype=np.int32),
                      logits_indices=np.array([2, 3, 4]), rows=["a", "b", "c"],
                      pending_dst=[3] if pending else [], pending_src=[1] if pending else [])


def _same(a: HostInputs, b: HostInputs) -> None:
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "query_start_loc", "seq_lens",
                 "logits_indices"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert (a.pending_dst, a.pending_src, a.decode_graphs, a.num_pad) == (b.pending_dst, b.pending_src,
                                                                         b.decode_graphs, b.num_pad)


@pytest.mark.parametrize("pending", [False, True])
def test_step_round_trip(pending):
    h = _inputs(pending)
    data = enc.encode(enc.StepMessage(7, h, share_sampled=pending))
    assert data.dtype == np.int64 and len(data) == enc.HEADER + 5 * 3 + 6 + 4 + 3 + 3 + 2 * pending
    buf = np.concatenate([data, np.full(100, 12345, dtype=np.int64)])  # what follows is ignored
    msg = enc.decode(buf)
    assert isinstance(msg, enc.StepMessage) and msg.step == 7 and msg.share_sampled == pending
    assert msg.inputs.rows == []  # the sequences stay on rank 0: the other ranks sample nothing
    h.rows = []
    _same(msg.inputs, h)


def test_padded_lockstep_step_keeps_its_padding_and_graph_choice():
    h = pad_inputs(_inputs(), DPStep(num_tokens=9, num_rows=3, uniform_decode=False))
    assert h.num_pad == 4 and not h.decode_graphs
    msg = enc.decode(enc.encode(enc.StepMessage(1, h, False)))
    h.rows = []
    _same(msg.inputs, h)


def test_control_messages_round_trip():
    msg = enc.decode(enc.encode(enc.CallMessage("save_rank_files", ("/tmp/x", 3))))
    assert isinstance(msg, enc.CallMessage) and (msg.method, msg.args) == ("save_rank_files", ("/tmp/x", 3))
    assert isinstance(enc.decode(enc.encode(enc.Shutdown())), enc.Shutdown)
    with pytest.raises(TypeError):
        enc.encode(object())
