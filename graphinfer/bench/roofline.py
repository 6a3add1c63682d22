"""A memory roofline for LLM serving: the fewest bytes a step must move, at a measured bandwidth.

Model (memory only; compute is ignored, so it is a lower bound on time whatever the FLOPs):
  every step (prefill, decode or mixed) reads all weights once: W bytes, the input embedding table
  excluded unless it is tied to the LM head (a lookup only gathers B rows);
  every scheduled row of a request that computes n new tokens after `start` cached ones reads the KV of
  its whole context (start + n tokens) once and writes the KV of its n new tokens: K bytes per token,
  K = 2 (K and V) x sum over layers of kv_heads x head_dim x dtype bytes.
So a step's bytes = W + K x sum over rows of (start + 2n), and time = bytes / bandwidth.

`ideal_roofline` applies it to the best schedule any engine could run for a workload: every prompt
prefilled in ceil(prompt tokens / max_num_batched_tokens) steps, then max(output) - 1 decode steps with
every live request in each (the first output token comes from the prefill step). KV traffic does not
depend on the schedule; fewer concurrent requests only add steps, so each re-reads W. `step_bytes`
applies it to the steps an engine actually ran.
"""
import math
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn


MODEL = ("memory only: each step reads all weights once (untied input embeddings excluded); each scheduled row "
         "reads the KV of its whole context and writes its new tokens' KV; ideal = ceil(prompt tokens / "
         "max_num_batched_tokens) prefill steps + max(output) - 1 decode steps with every request live; "
         "time = bytes / device-to-device copy bandwidth (read + written)")


@dataclass
class ModelShape:
    num_params: int
    param_bytes: int  # every unique parameter (tied weights once)
    weight_bytes_per_step: int  # W: param_bytes minus an untied input embedding table
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    kv_bytes_per_token: int  # K

    @classmethod
    def from_model(cls, *modules: nn.Module, kv_dtype: torch.dtype | None = None) -> "ModelShape":
        """From the loaded model (and the compiled graph, which owns the fused weights); works on meta too."""
        from graphinfer.models.layers import PagedAttention

        params: dict[int, nn.Parameter] = {}
        for m in modules:
            for p in m.parameters():  # dedupe by storage: the graph shares the model's unfused modules
                params.setdefault(id(p) if p.is_meta else p.data_ptr(), p)
        nbytes = lambda p: p.numel() * p.element_size()  # noqa: E731
        model = modules[0]
        lm_head = getattr(getattr(model, "lm_head", None), "weight", None)
        untied = sum(nbytes(m.weight) for m in model.modules()
                     if isinstance(m, nn.Embedding) and m.weight is not lm_head)
        attn = [m for m in model.modules() if isinstance(m, PagedAttention)]
        kv_dtype = kv_dtype or (lm_head.dtype if lm_head is not None else next(model.parameters()).dtype)
        size = torch.empty((), dtype=kv_dtype).element_size()  # K and V planes, or MLA's one latent plane
        per_token = sum(a.cache_planes * a.num_kv_heads * a.head_dim for a in attn) * size
        total = sum(nbytes(p) for p in params.values())
        return cls(sum(p.numel() for p in params.values()), total, total - untied, len(attn), attn[0].num_kv_heads,
                   attn[0].head_dim, str(kv_dtype).replace("torch.", ""), per_token)

    @classmethod
    def from_engine(cls, engine) -> "ModelShape":
        worker = engine.worker
        graph = worker.graph if isinstance(worker.graph, nn.Module) and worker.graph is not worker.model else None
        mods = (worker.model, graph) if graph is not None else (worker.model,)
        return cls.from_model(*mods, kv_dtype=worker.model_runner.kv_cache.dtype)

    def to_dict(self) -> dict:
        return asdict(self)


def row_kv_tokens(start: int, n: int) -> int:
    """KV tokens a row moves: reads its context (start + n), writes its n new tokens."""
    return start + 2 * n


def step_bytes(shape: ModelShape, kv_tokens: int) -> int:
    return shape.weight_bytes_per_step + shape.kv_bytes_per_token * kv_tokens


def ideal_roofline(shape: ModelShape, prompt_lens: list[int], output_lens: list[int],
                   max_num_batched_tokens: int, bandwidth: float) -> dict:
    """The module docstring's best schedule: bytes, seconds and output tok/s at `bandwidth` (bytes/s)."""
    prefill_steps = math.ceil(sum(prompt_lens) / max_num_batched_tokens)
    decode_steps = max(output_lens) - 1
    kv = sum(row_kv_tokens(0, p) for p in prompt_lens)
    for p, o in zip(prompt_lens, output_lens):
        m = o - 1  # decode j = 1..m reads p + j tokens and writes 1
        kv += m * p + m * (m + 1) // 2 + m
    nbytes = (prefill_steps + decode_steps) * shape.weight_bytes_per_step + kv * shape.kv_bytes_per_token
    seconds = nbytes / bandwidth
    return {"bytes": nbytes, "seconds": seconds, "output_tok_s": sum(output_lens) / seconds,
            "prefill_steps": prefill_steps, "decode_steps": decode_steps, "kv_tokens": kv}


def measure_bandwidth(device: torch.device | str, nbytes: int | None = None, iters: int | None = None) -> dict:
    """Device-to-device copy bandwidth, (bytes read + written) / time; 2 GiB on accelerators, 256 MiB on CPU."""
    from graphinfer.platforms import platform_for_device

    device = torch.device(device)
    cpu = device.type == "cpu"
    nbytes = nbytes or (256 << 20 if cpu else 2 << 30)
    iters = iters or (3 if cpu else 10)
    sync = platform_for_device(device.type).synchronize
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: page faults on CPU, lazy init on a GPU
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync()
    seconds = (time.perf_counter() - start) / iters
    del src, dst
    return {"copy_bytes": nbytes, "iters": iters, "seconds_per_copy": seconds, "bytes_per_s": 2 * nbytes / seconds}
