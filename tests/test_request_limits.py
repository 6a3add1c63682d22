"""Small server guarantees of issue 51 that need no model: the API key compared in constant time, a second signal's
message, the bounded structured-output compile (time-out, one queue), the messages for unreadable bodies. The served
budgets and fields: test_request_fields.py."""
import asyncio
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from graphinfer.server.api_server import GateState, _key_matches
from graphinfer.server.request_limits import body_error_message
from graphinfer.server.serve import drain


def test_api_key_compare():
    assert _key_matches("Bearer secret", "secret")
    for wrong in (None, "", "Bearer secre", "Bearer secret2", "secret", "bearer secret"):
        assert not _key_matches(wrong, "secret"), wrong


def test_a_second_signal_says_so():
    messages = []

    async def run(second_signal: bool, timeout: float):
        gate = GateState()
        gate.in_flight = 1
        gate.idle.clear()

        def end_all(message):
            messages.append(message)
            gate.in_flight = 0
            gate.idle.set()

        app = SimpleNamespace(state=SimpleNamespace(gate=gate, engine=SimpleNamespace(end_all=end_all)))
        stop_now = asyncio.Event()
        if second_signal:
            stop_now.set()
        return await drain(app, timeout, stop_now)

    assert asyncio.run(run(True, 30)) == (0, 1)
    assert asyncio.run(run(False, 0.05)) == (0, 1)
    assert "second Ctrl-C / SIGTERM" in messages[0] and "timeout" not in messages[0], messages[0]
    assert "shutdown timeout (0.05 s)" in messages[1], messages[1]


def test_body_error_messages():
    deep = "[" * 100_000
    try:
        json.loads(deep + "]" * 100_000)
    except RecursionError as e:
        assert "nests" in body_error_message(e)
    assert "UTF-8" in body_error_message(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"))


def test_compile_time_out_and_queue():
    """A slow compile: its waiter gets CompileTimeout, a second key queued behind it is dropped (never compiled), and
    the first still lands in the cache for the next request."""
    xgr = pytest.importorskip("xgrammar")  # noqa: F841 (the backend module imports it)
    from graphinfer.runtime.structured_output.backend_xgrammar import XgrammarBackend
    from graphinfer.runtime.structured_output.request import CompileTimeout

    backend = XgrammarBackend.__new__(XgrammarBackend)  # no tokenizer: _compile is replaced
    backend.cache_size, backend._cache, backend._lock = 8, OrderedDict(), threading.Lock()
    backend.num_compiles = backend.num_cache_hits = 0
    backend.compile_s = 0.0
    compiled = []

    def slow(kind, spec, ws):
        time.sleep(0.4)
        compiled.append(spec)
        return f"grammar of {spec}"

    backend._compile = slow
    pool = ThreadPoolExecutor(1)
    with pytest.raises(CompileTimeout):
        backend.compile("json", "A", executor=pool, timeout=0.05)
    with pytest.raises(CompileTimeout):  # queued behind A: dropped at its time-out
        backend.compile("json", "B", executor=pool, timeout=0.05)
    time.sleep(0.6)
    assert compiled == ["A"]
    assert backend.compile("json", "A", executor=pool, timeout=0.05) == "grammar of A"  # from the cache
    assert backend.compile("json", "B", executor=pool, timeout=2) == "grammar of B"  # dropped, so compiled anew
    pool.shutdown()
