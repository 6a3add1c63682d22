"""LoRACPUCache: the loaded adapters kept in host memory, least recently used evicted first (vLLM's
`max_cpu_loras`). Keyed by LoRARequest.lora_int_id."""
from collections import OrderedDict

from graphinfer.errors import InvalidConfigError


class LoRACPUCache:
    def __init__(self, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise InvalidConfigError(f"max_cpu_loras must be an integer >= 1, got {capacity!r}.")
        self.capacity = capacity
        self._entries: OrderedDict = OrderedDict()

    def get(self, lora_id: int):
        """The adapter cached under lora_id (now the most recently used), or None."""
        if lora_id not in self._entries:
            return None
        self._entries.move_to_end(lora_id)
        return self._entries[lora_id]

    def put(self, lora_id: int, adapter) -> list:
        """Cache adapter under lora_id as the most recently used; returns the (id, adapter) pairs evicted to stay
        within capacity, least recently used first."""
        self._entries[lora_id] = adapter
        self._entries.move_to_end(lora_id)
        evicted = []
        while len(self._entries) > self.capacity:
            evicted.append(self._entries.popitem(last=False))
        return evicted

    def remove(self, lora_id: int):
        """Drop lora_id; returns its adapter, or None if it was not cached."""
        return self._entries.pop(lora_id, None)

    def ids(self) -> list[int]:
        """The cached ids, least recently used first."""
        return list(self._entries)

    def __contains__(self, lora_id) -> bool:
        return lora_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)
