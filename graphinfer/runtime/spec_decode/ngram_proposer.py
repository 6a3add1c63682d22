"""N-gram (prompt lookup) proposer, as vLLM's NgramProposer: the request's last n tokens, for n from
prompt_lookup_max down to prompt_lookup_min, are looked up earlier in its own tokens (prompt + output); the tokens
that followed its most recent earlier occurrence with k tokens after it are the drafts. Runs on the host, on numpy, needs no model."""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k, self.min_n, self.max_n = num_speculative_tokens, prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k (<= num_speculative_tokens) drafts to follow token_ids, or [] when no n-gram matches."""
        k = min(k, self.k)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # windows that start before the suffix itself: the earlier occurrences of the last n tokens
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(hits):
                # the most recent occurrence with k tokens after it, else the earliest (the longest continuation:
                # in a repeating pattern the most recent one sits just before the end)
                full = hits[hits + n + k <= len(tokens)]
                start = (full[-1] if len(full) else hits[0]) + n
                return tokens[start:start + k].tolist()
        return []

    def propose_for(self, seqs) -> None:
        """Set each sequence's spec_token_ids (Sequence objects about to decode)."""
        for seq in seqs:
            seq.spec_token_ids = self.propose(seq.token_ids, draft_budget(seq, self.k))


def draft_budget(seq, k: int) -> int:
    """Drafts worth proposing: a step emits at most drafts + 1 tokens, and no more than the request has left."""
    return min(k, seq.max_tokens - seq.num_output_tokens - 1)
