"""Structured outputs (vLLM's vllm/v1/structured_output/): the output constrained to a JSON schema, a regex, a choice, a
grammar or a structural tag by masking the logits with the grammar's allowed tokens at every step.

Flow: the front end compiles the request's constraint (compile: cached per constraint,
entrypoints/input_processor.py), so a constraint that cannot compile is refused there with
InvalidStructuredOutputError (the server: a 400); the engine core gives each request a matcher of its own over that
grammar (matcher: seq.grammar; from another process the grammar arrives as xgrammar's serialization,
serialize_grammar). Each step, once the forward is launched, mask_logits fills the grammar rows' bitmasks on the host
(xgrammar, into pinned memory), copies them without blocking and applies graphinfer::apply_token_bitmask to the
logits before the sampler reads them (rows without a grammar get all bits set; a step without grammar rows costs
nothing). Each appended token is accepted by its request's matcher (accept_token). Once the grammar is complete it
allows only the stop (EOS) tokens, and having accepted one it is terminated: the request ends "stop". The matcher
goes with the sequence (Scheduler.finish drops it).
"""
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

from graphinfer.errors import InvalidStructuredOutputError
from graphinfer.runtime.structured_output.request import CompileTimeout, structured_output_key
from graphinfer.sampling_params import StructuredOutputsParams


@dataclass
class StructuredOutputStats:
    """Cumulative per-engine counters of the structured-output work (the bench reports their deltas per step)."""
    steps: int = 0  # steps whose logits were masked
    rows: int = 0  # logits rows masked (rows of those steps that have a grammar)
    fill_s: float = 0.0  # host: xgrammar filling the bitmasks
    apply_s: float = 0.0  # device: the host -> device copy and the op (device events; the host's wall time on cpu)
    accept_s: float = 0.0  # host: the matchers accepting the sampled tokens
    compiles: int = 0  # grammars compiled, and requests served from the cache
    cache_hits: int = 0
    compile_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)

    def since(self, before: "StructuredOutputStats") -> dict:
        return {k: v - getattr(before, k) for k, v in asdict(self).items()}


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, device: torch.device, device_module=None):
        """vocab_size: the logits' width (hf_config.vocab_size); stop_token_ids: the model's EOS ids; device_module:
        the platform's (torch.cuda, torch.npu) for timing the device work, None on cpu."""
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.words = -(-vocab_size // 32)
        self.device, self.device_module = device, device_module
        self.backend = None  # made at the first structured request (building the TokenizerInfo reads the vocab)
        self._batch = None  # xgr.BatchGrammarMatcher: fills a step's masks on several threads
        self._lock = threading.Lock()
        self._stats = StructuredOutputStats()
        self._timings: deque = deque()  # (start, end) device events of copies + applies not yet read
        self.compile_timeout: float | None = None  # bound_compiles
        self._compile_pool: ThreadPoolExecutor | None = None

    def bound_compiles(self, timeout: float, max_compiles: int) -> None:
        """Compile constraints on a pool of max_compiles threads, each request waiting at most `timeout` s for its
        own (queue included): EngineConfig.structured_outputs_compile_timeout / structured_outputs_max_compiles."""
        self.compile_timeout = timeout
        self._compile_pool = ThreadPoolExecutor(max_compiles, thread_name_prefix="graphinfer-grammar-compile",
                                                initializer=_lower_priority)

    # ----- requests -----
    def compile(self, params: StructuredOutputsParams):
        """The request's constraint compiled (from the cache when it can; the server calls this on its preprocessing
        threads)."""
        if params.whitespace_pattern is not None:
            raise InvalidStructuredOutputError(
                "structured outputs: whitespace_pattern (guided_whitespace_pattern) is not supported by the xgrammar "
                "backend; leave it out (JSON may then hold any whitespace) or set disable_any_whitespace=true for "
                "compact JSON.")
        kind, spec = structured_output_key(params)
        try:
            return self._get_backend().compile(kind, spec, any_whitespace=not params.disable_any_whitespace,
                                               executor=self._compile_pool, timeout=self.compile_timeout)
        except CompileTimeout:
            raise InvalidStructuredOutputError(
                f"structured outputs: the {kind} constraint did not compile within {self.compile_timeout:g} s "
                f"(--structured-outputs-compile-timeout / structured_outputs_compile_timeout; compiles wait for one "
                f"of --structured-outputs-max-compiles slots). Simplify it (a JSON schema this deep or large is "
                f"costly to turn into a grammar), or raise the limit.") from None

    def matcher(self, grammar):
        """A fresh matcher (seq.grammar) over a compiled grammar, or over serialize_grammar's form of one."""
        return self._get_backend().matcher(grammar)

    def _get_backend(self):
        if self.backend is None:
            if self.tokenizer is None:
                raise InvalidStructuredOutputError(
                    "structured outputs need the model's tokenizer (a grammar is matched against token strings), and "
                    "this model ships none: serve a checkpoint with a tokenizer, or leave structured outputs out.")
            with self._lock:
                if self.backend is None:
                    try:
                        import xgrammar as xgr
                    except ImportError as e:  # a GPU image where graphinfer was installed with --no-deps
                        raise InvalidStructuredOutputError(
                            f"structured outputs need the xgrammar package ({e}): pip install 'xgrammar>=0.2.8' "
                            f"and restart, or leave structured outputs out.") from None

                    from graphinfer.runtime.structured_output.backend_xgrammar import XgrammarBackend

                    self._batch = xgr.BatchGrammarMatcher()
                    self.backend = XgrammarBackend(self.tokenizer, self.vocab_size, self.stop_token_ids)
        return self.backend

    def accept_token(self, grammar, token: int) -> bool:
        started = time.perf_counter()
        ok = grammar.accept_token(token)
        self._stats.accept_s += time.perf_counter() - started
        return ok

    # ----- steps -----
    def wants_mask(self, rows) -> bool:
        """Whether any row of the step has a grammar (False at once while no structured request ever came)."""
        return self.backend is not None and any(seq.grammar is not None for seq in rows)

    def mask_logits(self, logits: torch.Tensor, rows, spec_lens: list[int] | None) -> None:
        """Mask the logits rows of the sequences with a grammar (row i of `rows` owns 1 + spec_lens[i] logits rows:
        speculative decoding; a structured request has no drafts, so its one row is its first)."""
        matchers, indices, r = [], [], 0
        for i, seq in enumerate(rows):
            if seq.grammar is not None:  # None: finished meanwhile (async scheduling): unmasked
                matchers.append(seq.grammar.matcher)
                indices.append(r)
            r += 1 + (spec_lens[i] if spec_lens else 0)
        if not matchers:
            return
        if logits.shape != (r, self.vocab_size):
            raise RuntimeError(f"structured outputs: logits {tuple(logits.shape)}, expected ({r}, {self.vocab_size})")
        started = time.perf_counter()
        bitmask = torch.full((r, self.words), -1, dtype=torch.int32, pin_memory=self.device.type != "cpu")
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices)
        filled = time.perf_counter()
        self._stats.fill_s += filled - started
        self._stats.steps += 1
        self._stats.rows += len(matchers)
        if self.device_module is None:
            torch.ops.graphinfer.apply_token_bitmask(logits, bitmask)
            self._stats.apply_s += time.perf_counter() - filled
            return
        start, end = self.device_module.Event(enable_timing=True), self.device_module.Event(enable_timing=True)
        start.record()
        # the caching host allocator keeps the pinned buffer until this copy has run
        torch.ops.graphinfer.apply_token_bitmask(logits, bitmask.to(self.device, non_blocking=True))
        end.record()
        self._timings.append((start, end))
        self._read_timings(wait=False)

    def _read_timings(self, wait: bool) -> None:
        while self._timings and (wait or self._timings[0][1].query()):
            start, end = self._timings.popleft()
            end.synchronize()
            self._stats.apply_s += start.elapsed_time(end) / 1e3

    def stats(self) -> StructuredOutputStats:
        """The counters so far (waits for the device work they time). A copy."""
        self._read_timings(wait=True)
        backend = self.backend
        if backend is not None:
            self._stats.compiles, self._stats.cache_hits = backend.num_compiles, backend.num_cache_hits
            self._stats.compile_s = backend.compile_s
        return StructuredOutputStats(**asdict(self._stats))


COMPILE_NICENESS = 10


def _lower_priority() -> None:
    """A compile thread runs at a lower CPU priority (Linux: a thread's own nice value) than the engine's and the
    server's threads: where the CPUs are busy, running streams keep their pace and compiles take longer (within their
    time-out)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not permitted: the default priority
        pass


def serialize_grammar(compiled) -> str:
    """A compiled grammar as xgrammar's JSON (for another process's engine core; its tokenizer info is not in it)."""
    return compiled if isinstance(compiled, str) else compiled.serialize_json()
