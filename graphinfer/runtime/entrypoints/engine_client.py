"""EngineClient (vLLM's): what the offline API, the server, metrics and the benchmarks may use of an engine, and
nothing else. LLMEngine (entrypoints/llm_engine.py: one engine core in this process, data-parallel replicas, or a
core in a process of its own) and the server's AsyncLLMEngine (entrypoints/async_llm.py) implement it."""
from typing import Protocol, runtime_checkable

from graphinfer.config import EngineConfig


@runtime_checkable
class EngineClient(Protocol):
    config: EngineConfig
    tokenizer: object  # None where the model ships none
    max_model_len: int
    hf_config: object  # the model's config (vocab_size, ...)
    info: object  # the core's EngineCoreInfo: KV blocks, EOS ids, MoE layers, speculative decoding, start-up

    def make_request(self, prompt, params=None, request_id: str | None = None, lora_request=None):
        """Validate and tokenize one request (typed errors) without queueing it; any thread may call it.
        lora_request: its LoRA adapter (graphinfer.lora.LoRARequest), read and checked first if new."""

    def add_lora(self, lora_request) -> bool:
        """Read and check a LoRA adapter now (LoRAAdapterError if refused); blocks while it is read."""

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (its host copy and slot); False if it was not loaded."""

    def list_loras(self) -> set[int]: ...

    def abort_request(self, request_id: str) -> None:
        """Abort a request (every child of a parallel-sampling one) and free its KV blocks."""

    def stats(self) -> dict:
        """running, waiting, kv_usage, kv_blocks_in_use, preemptions; under data parallel over every replica, each
        replica's own under "engines"."""

    def expert_load_summary(self, ep_size: int | None = None) -> dict:
        """Tokens per expert and per EP rank of each MoE layer, and their imbalance ({} layers for a dense model)."""

    def reset_expert_load(self) -> None: ...

    def spec_decode_stats(self) -> dict:
        """Speculative decoding's counters since start ({} with it off)."""

    def eplb_stats(self) -> dict:
        """EPLB's rearrangements, moved bytes and EP-rank imbalance ({"enabled": False} with it off)."""

    def on_death(self, callback) -> None:
        """callback(message) once a rank or replica the engine needs dies."""

    def shutdown(self) -> None: ...
