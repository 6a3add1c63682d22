"""The one encoding of what rank 0 sends the other tensor-parallel ranks: a message as one int64 array (a header,
then the step's host arrays packed end to end: input ids, positions, slots, block tables, query starts, context
lengths, logits rows, pending ids, prompt-logprob rows, LoRA slots), not a pickle per field; only a step that writes
LoRA adapters into slots adds a pickle of those writes. Control calls (save this rank's weights) carry a pickle;
shutdown is a header alone. The transport (executor/step_channel.py) moves the arrays; this
module knows nothing of it, so each side is tested apart."""
import pickle
from dataclasses import dataclass

import numpy as np

from graphinfer.runtime.worker.inputs import HostInputs

STEP, CALL, SHUTDOWN = 1, 2, 4  # 3 is the transport's (step_channel.GROW)
# kind, payload length, then the kind's fields: step, T, B, W, R, P, share sampled, no decode graphs, padding,
# prompt-logprob rows L and their top k, LoRA slots (0 or T), LoRA writes' pickle bytes
HEADER = 15


@dataclass
class StepMessage:
    step: int
    inputs: HostInputs
    share_sampled: bool  # rank 0 broadcasts the sampled ids after this step (async scheduling's pending ids)


@dataclass
class CallMessage:
    method: str  # every other rank runs worker.<method>(*args)
    args: tuple


class Shutdown:
    pass


def encode(msg) -> np.ndarray:
    """msg (StepMessage, CallMessage or Shutdown) as one int64 array."""
    if isinstance(msg, StepMessage):
        h = msg.inputs
        B, W = h.block_tables.shape
        plp = h.prompt_lp_indices if h.prompt_lp_indices is not None else np.zeros(0, dtype=np.int64)
        lora = h.lora_slots if h.lora_slots is not None else np.zeros(0, dtype=np.int64)
        loads = _bytes_as_int64(pickle.dumps(h.lora_loads)) if h.lora_loads else (0, np.zeros(0, dtype=np.int64))
        parts = [h.input_ids, h.positions, h.slot_mapping, h.block_tables.ravel(), h.query_start_loc, h.seq_lens,
                 h.logits_indices, np.asarray(h.pending_dst, dtype=np.int64), np.asarray(h.pending_src, dtype=np.int64),
                 plp, lora, loads[1]]
        payload = np.concatenate([p.astype(np.int64, copy=False) for p in parts])
        return _pack(STEP, [msg.step, len(h.input_ids), B, W, len(h.logits_indices), len(h.pending_dst),
                            int(msg.share_sampled), int(not h.decode_graphs), h.num_pad, len(plp), h.prompt_lp_k,
                            len(lora), loads[0]], payload)
    if isinstance(msg, CallMessage):
        n, data = _bytes_as_int64(pickle.dumps((msg.method, msg.args)))
        return _pack(CALL, [n], data)
    if isinstance(msg, Shutdown):
        return _pack(SHUTDOWN, [], np.zeros(0, dtype=np.int64))
    raise TypeError(f"cannot encode {type(msg).__name__}")


def _bytes_as_int64(data: bytes) -> tuple[int, np.ndarray]:
    """(len(data), data zero-padded to whole int64s)."""
    padded = bytearray(data + bytes(-len(data) % 8))  # writable: torch.from_numpy warns on a read-only array
    return len(data), np.frombuffer(padded, dtype=np.int64)


def _unpickle(words: np.ndarray, n: int):
    return pickle.loads(words.view(np.uint8)[:n].tobytes())


def _pack(kind: int, fields: list[int], payload: np.ndarray) -> np.ndarray:
    out = np.zeros(HEADER + len(payload), dtype=np.int64)
    head = [kind, len(payload), *fields]
    out[:len(head)] = head
    out[HEADER:] = payload
    return out


def decode(buf: np.ndarray):
    """The message encode() wrote at the start of buf (which may be longer: a transport's fixed-size buffer)."""
    kind, n = int(buf[0]), int(buf[1])
    head = buf[2:HEADER].tolist()
    payload = buf[HEADER:HEADER + n]
    if kind == SHUTDOWN:
        return Shutdown()
    if kind == CALL:
        return CallMessage(*_unpickle(payload, head[0]))
    if kind != STEP:
        raise ValueError(f"not a step message: kind {kind}")
    step, T, B, W, R, P, share, no_graphs, num_pad, L, k, S, nbytes = head[:13]
    sizes = [T, T, T, B * W, B + 1, B, R, P, P, L, S, -(-nbytes // 8)]
    a = np.split(payload, np.cumsum(sizes)[:-1])
    inputs = HostInputs(a[0].copy(), a[1].copy(), a[2].copy(), a[3].reshape(B, W).astype(np.int32),
                        a[4].astype(np.int32), a[5].astype(np.int32), a[6].copy(), [], a[7].tolist(), a[8].tolist(),
                        decode_graphs=not no_graphs, num_pad=num_pad, prompt_lp_indices=a[9].copy() if L else None,
                        prompt_lp_k=k, lora_slots=a[10].copy() if S else None,
                        lora_loads=_unpickle(a[11], nbytes) if nbytes else None)
    return StepMessage(step, inputs, bool(share))
