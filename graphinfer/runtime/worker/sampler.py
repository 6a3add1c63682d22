"""Batched next-token sampler, following vLLM v1's Sampler.

Order: raw logprobs (or raw logits: logprobs_mode) -> allowed_token_ids mask -> bad words -> min_tokens mask ->
logit_bias -> penalties -> greedy argmax | temperature -> min_p -> top_k -> top_p
-> exponential-race sampling. Logprobs are computed only when some row asks for them. Structured outputs' grammar
mask is applied to the logits before any of it (model runner), so every path reads masked logits. The
request's own logits processors (allowed_token_ids, bad_words, logit_bias: vLLM's) are tensors built per step from
the rows' params (a bitmask through graphinfer::apply_token_bitmask, index lists for the bans and biases), applied to
the fp32 copy of the logits; like everything here they run after the forward, outside any captured graph.

Where the platform has the fused sampling kernel (graphinfer/ops/triton/sampling.py: CUDA, Ascend with
Triton-Ascend, cpu with kernels="triton"), a batch whose rows ask for nothing but a temperature (no logprobs,
penalties, min_tokens mask in force, top-k / top-p / min-p) is sampled by that one kernel straight from the
logits; other batches take the torch path below, whose race then also draws through the kernel (on the
filtered log-probabilities), so every row draws from the same random stream on either path. The stream is
vLLM's seed + offset: a seeded request uses (its seed, tokens it has generated so far), so it samples the same
tokens whatever else is in the batch; other rows use (a per-step seed from this sampler's host RNG, their row).
Without the kernel (the cpu default) the race draws with torch: unseeded rows from the sampler's generator,
seeded rows from their own (Sequence.generator), with the same batch independence; the tokens a given seed
yields therefore differ between the two (as they already differ between torch's cpu and CUDA generators).
"""
import random
from dataclasses import dataclass, fields

import numpy as np
import torch

from graphinfer.errors import InvalidConfigError
from graphinfer.ops.cpu import sampling as cpu_sampling


@dataclass
class SamplerOutput:
    """On the sampler's device; to_host() copies it over. The logprob fields are None when no row asked."""
    sampled_token_ids: torch.Tensor  # [B] int64
    sampled_logprobs: torch.Tensor | None  # [B] float32, raw log_softmax (or logit: logprobs_mode) at the sampled token
    sampled_ranks: torch.Tensor | None  # [B] int64, 1 = most likely under the raw logits
    topk_token_ids: torch.Tensor | None  # [B, N] int64, N = max requested logprobs (0 if none asked)
    topk_logprobs: torch.Tensor | None  # [B, N] float32, raw log_softmax (or logits)
    # Speculative decoding (runtime/spec_decode/verify.py): the rows above are draft positions, and request i
    # emits output_token_ids[i] up to the first -1 (its j-th token is row offset_i + j above)
    output_token_ids: torch.Tensor | None = None

    def to_host(self, non_blocking: bool = False) -> "SamplerOutput":
        """Host copies. non_blocking: into pinned memory, valid once the device has done the work issued so far."""
        return SamplerOutput(*(None if t is None else t.to("cpu", non_blocking=non_blocking)
                               for t in (getattr(self, f.name) for f in fields(self))))


LOGPROBS_MODES = ("raw_logprobs", "raw_logits")  # vLLM's names; its processed_* modes are not supported


class Sampler:
    def __init__(self, seed: int = 0, device="cpu", kernel=None, logprobs_mode: str = "raw_logprobs"):
        """kernel: the platform's fused sampling kernel (Platform.sample_kernel), or None for torch alone.
        logprobs_mode: what the logprobs fields report, vLLM's raw_logprobs (log_softmax of the logits) or
        raw_logits (the logits themselves, e.g. to judge ties at the compute dtype's precision)."""
        if logprobs_mode not in LOGPROBS_MODES:
            raise InvalidConfigError(f"logprobs_mode {logprobs_mode!r} is not supported: use one of "
                                     f"{', '.join(LOGPROBS_MODES)} (vLLM's processed_* modes are not implemented)")
        self.logprobs_mode = logprobs_mode
        self.device = torch.device(device)
        self.kernel = kernel
        # Rows without their own seed share this generator (torch race) or draw a per-step seed from this host
        # RNG (kernel race: no device state to advance, nothing read back).
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.step_rng = random.Random(seed)

    def __call__(self, logits: torch.Tensor, rows: list) -> SamplerOutput:
        params = [r.sampling_params for r in rows]
        if all(_argmax_only(r, p) for r, p in zip(rows, params)):
            # Greedy rows with nothing to mask or report need only the argmax of the logits as they are: no
            # fp32 copy written and re-read (B x vocab x 4 bytes). Same token: the upcast is exact and monotone,
            # and max returns the first maximum's index as argmax does (on CPU, max(dim) over bf16 logits measured
            # faster than argmax: issue 30's closing note; the cpu kernel is faster still, and off the CPU
            # cpu_sampling.argmax is that max).
            return SamplerOutput(cpu_sampling.argmax(logits), None, None, None, None)
        if self.kernel is not None and all(_temperature_only(r, p) for r, p in zip(rows, params)):
            # One pass over the logits in their own dtype: greedy rows take the argmax (temperature 0).
            rows_idx = range(len(rows))
            temps = [0.0 if p.greedy else p.temperature for p in params]
            return SamplerOutput(self._kernel_sample(logits, rows, rows_idx, temps), None, None, None, None)
        x = logits.to(torch.float32, copy=True)  # copy: we mask and penalise in place
        dev = x.device

        # vLLM's raw_* logprobs modes: before penalties, temperature and filtering.
        asked = [p.logprobs for p in params if p.logprobs is not None]
        raw_lp = None
        if asked:
            raw_lp = torch.log_softmax(x, dim=-1) if self.logprobs_mode == "raw_logprobs" else x.clone()

        processors = any(p.has_logits_processors for p in params)  # a plain batch pays this check only
        if processors:
            _apply_allowed_token_ids(x, params)
            _apply_bad_words(x, rows, params)
        self._apply_min_tokens(x, rows, params)
        if processors:
            _apply_logit_bias(x, params)
        self._apply_penalties(x, rows, params)

        rand = [i for i, p in enumerate(params) if not p.greedy]
        sampled = x.argmax(dim=-1) if len(rand) < len(rows) else None  # greedy rows keep this
        if rand:
            # Fewer host->device copies in the common cases: every row sampled, one temperature for all.
            idx = torch.tensor(rand, device=dev) if sampled is not None else None
            sub = x[idx] if idx is not None else x
            temps = [params[i].temperature for i in rand]
            top_k, top_p, min_p = ([getattr(params[i], name) for i in rand] for name in ("top_k", "top_p", "min_p"))
            filtered = not _no_filter(top_k, top_p, min_p)
            if self.kernel is not None and not filtered:  # the kernel divides by the temperature itself
                drawn = self._kernel_sample(sub, rows, rand, temps)
            else:
                temp = temps[0] if len(set(temps)) == 1 else torch.tensor(temps, device=dev)[:, None]
                scaled = sub / temp
                weights = _filtered_probs(sub, scaled, top_k, top_p, min_p) if filtered else scaled
                if self.kernel is not None:  # the Gumbel race on log p (T = 1) draws token i with probability p_i
                    drawn = self._kernel_sample(weights.log_(), rows, rand, [1.0] * len(rand))
                else:
                    drawn = self._torch_race(weights, filtered, [rows[i] for i in rand])
            if sampled is None:
                sampled = drawn
            else:
                sampled[idx] = drawn

        if not asked:
            return SamplerOutput(sampled, None, None, None, None)
        sampled_lp = raw_lp.gather(1, sampled[:, None])
        ranks = torch.count_nonzero(raw_lp > sampled_lp, dim=-1) + 1
        topk_lp, topk_ids = torch.topk(raw_lp, min(max(asked), raw_lp.shape[-1]), dim=-1)
        return SamplerOutput(sampled, sampled_lp[:, 0], ranks, topk_ids, topk_lp)

    def _kernel_sample(self, scores, rows, idx, temps) -> torch.Tensor:
        """The kernel's tokens for rows[idx] (scores: one row each, in that order). Keys: (seed, tokens generated
        so far) for a seeded request, else (this step's seed, its row in the batch): host ints, one copy each."""
        step_seed = self.step_rng.getrandbits(63)
        seeds, offsets = [], []
        for i in idx:
            seed = rows[i].sampling_params.seed
            if seed is None:
                seeds.append(step_seed)
                offsets.append(i)
            else:
                seeds.append(seed - 2**64 if seed >= 2**63 else seed)  # the same 64 bits as an int64
                offsets.append(tokens_before(rows[i]))
        dev = scores.device
        keys = torch.tensor([seeds, offsets], dtype=torch.int64, device=dev)
        return self.kernel(scores, torch.tensor(temps, dtype=torch.float32, device=dev), keys[0], keys[1])

    def _torch_race(self, weights, filtered, rows) -> torch.Tensor:
        """Exponential race: argmax(p / E), E ~ Exp(1), draws token i with probability p_i. Seeded rows draw from
        their own generator; the rest share one batched draw (one launch, not one per row)."""
        q = torch.empty_like(weights)
        seeded = [j for j, r in enumerate(rows) if getattr(r, "generator", None) is not None]
        if len(seeded) < len(rows):
            _exponential_(q, self.generator)
        for j in seeded:
            _exponential_(q[j], rows[j].generator)
        q.clamp_(min=1e-30)  # E == 0 would give 0/0
        if filtered:
            return weights.div_(q).argmax(dim=-1)
        # argmax(softmax(s) / E) = argmax(s - log E): the same race without the softmax, whose CUDA kernel runs
        # one block per row (67 us for one 152K-vocab row on the H100, 5% of a batch-1 step)
        return weights.sub_(q.log_()).argmax(dim=-1)

    def _apply_min_tokens(self, x, rows, params):
        # Like vLLM, eos is masked even with ignore_eos (it's in the request's stop set either way).
        r_idx, t_idx = [], []
        for i, (row, p) in enumerate(zip(rows, params)):
            if _min_tokens_in_force(row, p):
                r_idx += [i] * len(row.all_stop_token_ids)
                t_idx += sorted(row.all_stop_token_ids)
        if r_idx:
            x[torch.tensor(r_idx, device=x.device), torch.tensor(t_idx, device=x.device)] = float("-inf")

    def _apply_penalties(self, x, rows, params):
        B, V = x.shape
        dev = x.device
        rep = [p.repetition_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        if any(r != 1.0 for r in rep):
            # Repetition penalty (HF/vLLM): over prompt + output tokens.
            seen = _token_counts(
                [list(r.prompt_token_ids) + list(r.output_token_ids) if rp != 1.0 else [] for r, rp in zip(rows, rep)],
                V, dev,
            ) > 0
            pen = torch.tensor(rep, device=dev)[:, None].expand(B, V)
            pen = torch.where(seen, pen, 1.0)
            x.copy_(torch.where(x > 0, x / pen, x * pen))
        if any(pres) or any(freq):
            # OpenAI presence/frequency penalties: over output tokens only.
            counts = _token_counts(
                [list(r.output_token_ids) if (pp or fp) else [] for r, pp, fp in zip(rows, pres, freq)], V, dev
            )
            x -= torch.tensor(freq, device=dev)[:, None] * counts
            x -= torch.tensor(pres, device=dev)[:, None] * (counts > 0)


def _exponential_(q: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """q filled with Exp(1) draws. On CPU as -log(U), U uniform: ATen's CPU exponential_ calls libm's scalar log1p on
    one thread, 51 ms for a batch of 64 SmolLM2 rows (half a batch-64 decode step) against 10 ms for uniform_ and a
    vectorized log (docs/bench/cpu_sampler_exponential_2026-12-02_zen5.json)."""
    if q.device.type == "cpu":
        return q.uniform_(generator=generator).log_().neg_()
    return q.exponential_(generator=generator)


def _allowed_bitmask(p, V: int) -> np.ndarray:
    """The request's allowed_token_ids as an int32 bitmask row (apply_token_bitmask's layout), made once per params."""
    words = getattr(p, "_allowed_words", None)
    if words is None or words.shape[0] != -(-V // 32):
        ids = np.asarray(p.allowed_token_ids, dtype=np.int64)
        ids = ids[ids < V]
        bits = np.zeros(-(-V // 32), dtype=np.uint32)
        np.bitwise_or.at(bits, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
        words = bits.view(np.int32)
        p._allowed_words = words
    return words


def _apply_allowed_token_ids(x, params) -> None:
    """-inf wherever a row with allowed_token_ids does not allow the token (other rows: all bits set)."""
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
    if not rows:
        return
    B, V = x.shape
    mask = np.full((B, -(-V // 32)), -1, dtype=np.int32)
    for i in rows:
        mask[i] = _allowed_bitmask(params[i], V)
    torch.ops.graphinfer.apply_token_bitmask(x, torch.from_numpy(mask).to(x.device))


def _apply_bad_words(x, rows, params) -> None:
    """vLLM's bad words: a word's last token is banned (-inf) where the row's generated tokens end with its others."""
    r_idx, t_idx = [], []
    for i, (row, p) in enumerate(zip(rows, params)):
        words = p._bad_words_token_ids
        if not words:
            continue
        out = row.output_token_ids
        for word in words:
            k = len(word) - 1
            if k == 0 or (k <= len(out) and list(out[len(out) - k:]) == word[:-1]):
                r_idx.append(i)
                t_idx.append(word[-1])
    if r_idx:
        x[torch.tensor(r_idx, device=x.device), torch.tensor(t_idx, device=x.device)] = float("-inf")


def _apply_logit_bias(x, params) -> None:
    """logit_bias added to the logits (vLLM: after the masks; a banned token stays -inf)."""
    r_idx, t_idx, vals = [], [], []
    for i, p in enumerate(params):
        if p.logit_bias:
            r_idx += [i] * len(p.logit_bias)
            t_idx += list(p.logit_bias)
            vals += list(p.logit_bias.values())
    if r_idx:
        dev = x.device
        x.index_put_((torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)),
                     torch.tensor(vals, dtype=x.dtype, device=dev), accumulate=True)


def tokens_before(row) -> int:
    """Output tokens before the one a row samples: its scheduled placeholder for this token (engine/scheduler.py)
    counts in num_output_tokens, as do tokens still on their way to the host from earlier steps."""
    return row.num_output_tokens - 1


def _min_tokens_in_force(row, p) -> bool:
    """Whether the row's stop tokens (the request's and the model's EOS: row.all_stop_token_ids) are masked
    (min_tokens not yet reached). Not for a structured-output row: its grammar decides where the output ends (once
    complete it allows only the stop tokens, so masking them too would leave nothing to sample)."""
    return tokens_before(row) < p.min_tokens and p.structured_outputs is None


def _argmax_only(row, p) -> bool:
    """Greedy, no logprobs, no penalties, no min_tokens mask in force: the token is the logits' argmax."""
    return (p.greedy and p.logprobs is None and not p.has_penalties and not p.has_logits_processors
            and not _min_tokens_in_force(row, p))


def _temperature_only(row, p) -> bool:
    """Nothing but a temperature to apply: the fused kernel samples the row from the logits as they are."""
    return (p.logprobs is None and not p.has_penalties and not p.has_logits_processors
            and not _min_tokens_in_force(row, p) and (p.greedy or (p.top_k == 0 and p.top_p >= 1.0 and p.min_p == 0)))


def _token_counts(token_lists: list[list[int]], V: int, device) -> torch.Tensor:
    """[B, V] float32 occurrence counts; ragged lists are padded with id V into a discarded extra column."""
    L = max(map(len, token_lists))
    ids = torch.tensor([t + [V] * (L - len(t)) for t in token_lists], dtype=torch.int64, device=device)
    counts = torch.zeros(len(token_lists), V + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :V]


def _no_filter(top_k, top_p, min_p) -> bool:
    return all(k == 0 for k in top_k) and all(p >= 1.0 for p in top_p) and all(m == 0 for m in min_p)


def _filtered_probs(order_logits, scaled, top_k, top_p, min_p) -> torch.Tensor:
    """softmax(scaled) restricted by min_p, then top_k, then top_p (vLLM v1 order), renormalised.

    Tokens are ranked by `order_logits` (pre-temperature, same order mathematically) with a stable sort, so
    top_k=1 keeps exactly the greedy argmax even where temperature scaling rounds two logits together.
    """
    R, V = scaled.shape
    dev = scaled.device
    order = torch.sort(order_logits, dim=-1, descending=True, stable=True).indices
    s = scaled.gather(1, order)  # descending
    if any(min_p):
        # min_p: drop tokens below min_p * the top probability.
        probs = torch.softmax(s, dim=-1)
        mp = torch.tensor(min_p, device=dev)[:, None]
        s = s.masked_fill(probs < mp * probs[:, :1], float("-inf"))
    if any(top_k):
        # top_k by position in the sorted order: keeps exactly k tokens.
        k = torch.tensor([kk if 0 < kk < V else V for kk in top_k], device=dev)[:, None]  # also keeps huge k in int64
        s = s.masked_fill(torch.arange(V, device=dev)[None] >= k, float("-inf"))
    probs = torch.softmax(s, dim=-1)
    if any(p < 1.0 for p in top_p):
        # top_p: drop a token once the mass above it reaches p (vLLM: tail mass <= 1 - p); the top token stays.
        # Rows with top_p = 1 get p = inf: the float cumsum may reach 1 early, yet they must drop nothing.
        tp = torch.tensor([p if p < 1.0 else float("inf") for p in top_p], device=dev)[:, None]
        drop = probs.cumsum(dim=-1) - probs >= tp
        drop[:, 0] = False
        probs = torch.softmax(s.masked_fill(drop, float("-inf")), dim=-1)
    return torch.empty_like(probs).scatter_(1, order, probs)  # back to vocab order
