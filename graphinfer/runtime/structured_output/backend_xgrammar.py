"""The xgrammar backend (vLLM's default, vllm/v1/structured_output/backend_xgrammar.py): compiles a request's
constraint into a grammar over the model's vocabulary, once per (kind, spec, options) in a bounded LRU, and gives
each request a GrammarMatcher of its own."""
import json
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, TimeoutError as FutureTimeout

import xgrammar as xgr

from graphinfer.errors import InvalidStructuredOutputError
from graphinfer.runtime.structured_output.request import CompileTimeout

_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice",
         "grammar": "grammar", "structural_tag": "structural tag"}
# JSON: whitespace between elements allowed, but at most this many characters per gap, so that sampling cannot stall
# in whitespace (at temperature 1.0 a small model fills max_tokens with newlines otherwise); pretty-printed JSON
# three levels deep fits. disable_any_whitespace: none at all (compact JSON).
MAX_JSON_WHITESPACE = 16
# "[09:49:03] /project/cpp/regex_converter.cc:83: ",
# "Check failed: (std::holds_alternative<Grammar>(result)) is false: "
_CPP_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: |Check failed: .*? is false: ")


class XgrammarGrammar:
    """One request's matcher: the grammar state after the tokens generated so far."""
    __slots__ = ("matcher",)

    def __init__(self, compiled: "xgr.CompiledGrammar"):
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept_token(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def is_terminated(self) -> bool:
        """Whether the grammar has accepted its stop token (EOS): the output is complete."""
        return self.matcher.is_terminated()


class XgrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_size: int = 128):
        """vocab_size: the width of the model's logits (hf_config.vocab_size), which may exceed len(tokenizer):
        ids past the tokenizer's are never allowed. stop_token_ids: what ends a complete output (the EOS ids)."""
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=stop_token_ids)
        # our own LRU below bounds the memory; xgrammar's cache would keep every grammar ever compiled
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=min(8, os.cpu_count() or 1),
                                            cache_enabled=False)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = self.num_cache_hits = 0
        self.compile_s = 0.0

    def compile(self, kind: str, spec: str, any_whitespace: bool = True, executor=None,
                timeout: float | None = None) -> "xgr.CompiledGrammar":
        """The compiled grammar, from the cache or compiled now (thread-safe: concurrent requests for one key wait for
        a single compile). Raises InvalidStructuredOutputError naming the problem. executor: where the compile runs
        (a bounded pool: StructuredOutputManager.bound_compiles), else on this thread; timeout: seconds to wait for
        it, raising CompileTimeout past them (the compile, once started, still finishes into the cache; one still
        queued is dropped)."""
        key = (kind, spec, any_whitespace)
        with self._lock:
            future = self._cache.get(key)
            owner = future is None
            if owner:
                future = self._cache[key] = Future()
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
        task = None
        if owner:
            if executor is None:
                self._run(key, future)
            else:
                task = executor.submit(self._run, key, future)
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            if task is not None and task.cancel():  # never started: nobody else will start it
                self._forget(key, future)
                future.set_exception(CompileTimeout(timeout))
            raise CompileTimeout(timeout) from None

    def _run(self, key: tuple, future: Future) -> None:
        """Compile key's grammar into future (its error too; a failure is not cached: the error reaches each waiter
        once)."""
        if future.done():
            return
        started = time.perf_counter()
        try:
            compiled = self._compile(*key)
        except BaseException as e:
            self._forget(key, future)
            future.set_exception(e)
            return
        with self._lock:
            self.num_compiles += 1
            self.compile_s += time.perf_counter() - started
        future.set_result(compiled)

    def _forget(self, key: tuple, future: Future) -> None:
        with self._lock:
            if self._cache.get(key) is future:
                del self._cache[key]

    def matcher(self, grammar: "xgr.CompiledGrammar | str") -> XgrammarGrammar:
        """A request's matcher over a compiled grammar, or over its serialization (serialize_json) from another
        process, read against this backend's tokenizer info."""
        if isinstance(grammar, str):
            grammar = xgr.CompiledGrammar.deserialize_json(grammar, self.tokenizer_info)
        return XgrammarGrammar(grammar)

    def _compile(self, kind: str, spec: str, any_whitespace: bool) -> "xgr.CompiledGrammar":
        c = self.compiler
        whitespace = MAX_JSON_WHITESPACE if any_whitespace else None
        try:
            if kind == "json":
                json.loads(spec)  # xgrammar's own message for bad JSON text is a C++ parser's
                return c.compile_json_schema(spec, any_whitespace=any_whitespace, max_whitespace_cnt=whitespace)
            if kind == "json_object":  # OpenAI's JSON mode: an object (vLLM's)
                return c.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace,
                                             max_whitespace_cnt=whitespace)
            if kind == "regex":
                return c.compile_regex(spec)
            if kind == "choice":
                return c.compile_grammar(spec)
            if kind == "grammar":  # EBNF / GBNF (rules with ::=); otherwise Lark (vLLM converts it; xgrammar reads it)
                return c.compile_grammar(spec) if "::=" in spec else c.compile_lark(spec)
            if kind == "structural_tag":
                tag = json.loads(spec)
                if isinstance(tag, dict) and "structures" in tag:  # the older {"structures", "triggers"} form
                    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                             for s in tag["structures"]]
                    return c.compile_structural_tag(items, tag["triggers"])
                return c.compile_structural_tag(spec)
        except Exception as e:  # xgrammar's errors (RuntimeError and its own classes), bad JSON, a missing key
            detail = _CPP_NOISE.sub("", str(e)).strip() or type(e).__name__
            raise InvalidStructuredOutputError(
                f"structured outputs: the {_WHAT[kind]} cannot be compiled into a grammar: {detail}. Fix the "
                f"{_WHAT[kind]} (xgrammar {_xgrammar_version()} reads it) and send the request again.") from None
        raise InvalidStructuredOutputError(f"structured outputs: unknown kind {kind!r}.")


def _xgrammar_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("xgrammar")
    except PackageNotFoundError:
        return "?"
