"""Speculative-decoding counters, as vLLM's SpecDecodingStats (exported as spec_decode_* in /metrics and bench)."""
from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int
    num_drafts: int = 0  # (request, step) pairs that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    @classmethod
    def since(cls, now: dict, before: dict) -> "SpecDecodingStats":
        """The counters of as_dict() `now` minus those of an earlier as_dict() (empty: since start)."""
        stats = cls(now["num_spec_tokens"])
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            setattr(stats, name, now[name] - before.get(name, 0))
        earlier = before.get("num_accepted_tokens_per_pos") or [0] * stats.num_spec_tokens
        stats.num_accepted_tokens_per_pos = [a - b for a, b in zip(now["num_accepted_tokens_per_pos"], earlier)]
        return stats

    def as_dict(self) -> dict:
        """The counters plus acceptance rate (accepted / drafted) and mean acceptance length (tokens a verified
        draft yields: 1 + accepted / drafts, vLLM's definition)."""
        d = dict(vars(self), num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))
        d["acceptance_rate"] = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        d["mean_acceptance_length"] = 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
        return d
