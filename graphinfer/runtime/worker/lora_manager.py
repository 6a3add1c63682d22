"""LoRAManager: which adapter sits in which of the max_loras device slots, the adapters loaded in host memory (an LRU
of max_cpu_loras, vLLM's), and each step's slot per token.

Rank 0 plans a step (plan: a slot for every adapter the step uses, evicting the least recently used slots the step
does not need; the scheduler lets a step use at most max_loras adapters), and the plan travels in the step's inputs
(HostInputs.lora_slots, lora_loads), so every tensor-parallel rank writes the same adapters into the same slots, each
its own shard (LoRASlots.set_slot), before the forward.
"""
import logging
import threading
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from graphinfer.config import LoRAConfig
from graphinfer.errors import InvalidConfigError
from graphinfer.lora.cpu_cache import LoRACPUCache
from graphinfer.lora.peft import LoRAAdapter, load_adapter
from graphinfer.lora.request import LoRARequest
from graphinfer.lora.slots import LoRASlots
from graphinfer.runtime.worker.device_graphs import staged

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, graph: nn.Module, config: LoRAConfig, dtype: torch.dtype):
        self.modules = [m for m in graph.modules() if isinstance(m, LoRASlots)]
        if not self.modules:
            raise InvalidConfigError("enable_lora: the lora pass found no projection to adapt in this model (it targets "
                                     "q/k/v/o_proj and gate/up/down_proj); serve it without enable_lora.")
        self.config, self.dtype = config, dtype
        self.token_indices = self.modules[0].token_indices  # shared by every LoRASlots
        self.base_shapes = {s.path: (s.in_features, s.out_features) for m in self.modules for s in m.sources}
        self.cpu = LoRACPUCache(config.max_cpu_loras)
        self.paths: dict[int, str] = {}  # the path each cached adapter was read from
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self._indices = np.full(len(self.token_indices), -1, dtype=np.int64)
        self._idle = True  # the index buffer is all -1 (the last step used no adapter)
        # add_lora / remove_lora come from other threads (the server's request threads, a core process's reader)
        self._lock = threading.RLock()

    # ----- adapters in host memory -----
    def add_lora(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter, read (and checked against the model) once, then kept in the host LRU (read again if the id
        now names another path)."""
        with self._lock:
            return self._add_lora(request)

    def _add_lora(self, request: LoRARequest) -> LoRAAdapter:
        lora_id = request.lora_int_id
        if lora_id in self.cpu and self.paths.get(lora_id) == request.lora_path:
            return self.cpu.get(lora_id)
        adapter = load_adapter(request.lora_path, self.base_shapes, self.config.max_lora_rank, self.dtype)
        self.paths[lora_id] = request.lora_path
        for evicted, _ in self.cpu.put(lora_id, adapter):
            self.paths.pop(evicted, None)
            logger.info("LoRA: host cache full (max_cpu_loras=%d), dropped adapter %d", self.config.max_cpu_loras,
                        evicted)
        return adapter

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget the adapter: its host copy, and its slot (free for the next adapter a step needs); False if it was
        not loaded."""
        with self._lock:
            found = lora_int_id in self.cpu or lora_int_id in self.slots
            self.cpu.remove(lora_int_id)
            self.paths.pop(lora_int_id, None)
            self.slots.pop(lora_int_id, None)
            return found

    def list_loras(self) -> list[int]:
        with self._lock:
            return list(self.cpu.ids())

    # ----- a step -----
    def plan(self, requests: dict[int, LoRARequest]) -> tuple[dict[int, int], list[tuple[int, LoRARequest]]]:
        """Rank 0: (slot of each adapter the step uses, the (slot, request) writes the step needs first)."""
        with self._lock:
            return self._plan(requests)

    def _plan(self, requests: dict[int, LoRARequest]) -> tuple[dict[int, int], list[tuple[int, LoRARequest]]]:
        if len(requests) > self.config.max_loras:
            raise RuntimeError(f"a step uses {len(requests)} adapters, more than max_loras={self.config.max_loras}: "
                               f"the scheduler must not let it")
        loads = []
        for lora_id in requests:
            if lora_id in self.slots:
                self.slots.move_to_end(lora_id)
        for lora_id, request in requests.items():
            if lora_id in self.slots:
                continue
            free = [s for s in range(self.config.max_loras) if s not in self.slots.values()]
            if free:
                slot = free[0]
            else:  # the least recently used adapter the step does not use
                victim = next(i for i in self.slots if i not in requests)
                slot = self.slots.pop(victim)
            self.slots[lora_id] = slot
            loads.append((slot, request))
        return {i: self.slots[i] for i in requests}, loads

    def apply(self, lora_slots: np.ndarray | None, loads: list[tuple[int, LoRARequest]]) -> None:
        """Every rank, before the forward: write the planned adapters into their slots, then the step's slot per token
        (the rest of the index buffer -1: padded rows of a captured graph use no adapter)."""
        with self._lock:
            for slot, request in loads:
                self._write(slot, request)
        n = 0 if lora_slots is None else len(lora_slots)
        if n > len(self._indices):
            raise RuntimeError(f"a step of {n} tokens exceeds the LoRA index buffer ({len(self._indices)})")
        if not n and self._idle:
            return
        if n:
            self._indices[:n] = lora_slots
        self._indices[n:] = -1
        self.token_indices.copy_(staged(self._indices, self.token_indices.device), non_blocking=True)
        self._idle = not n

    def _write(self, slot: int, request: LoRARequest) -> None:
        adapter = self.add_lora(request)
        weights = {path: (w.a, w.b) for path, w in adapter.modules.items()}
        for m in self.modules:
            m.set_slot(slot, weights)
