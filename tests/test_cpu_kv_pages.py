"""The cpu platform commits the KV cache's pages (platforms/cpu.populate_pages, in a thread from start-up on) instead
of page-faulting them in as requests first write them."""
import ctypes
import ctypes.util
import mmap
import os
import threading

import pytest
import torch

from graphinfer import LLM, SamplingParams
from graphinfer.engine_args import create_engine_config
from graphinfer.platforms.cpu import populate_pages
from graphinfer.runtime.entrypoints.llm_engine import LLMEngine

PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident_pages(t: torch.Tensor) -> int:
    """Pages of t's (page-aligned) memory that are mapped now, by mincore(2)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    start = t.data_ptr() // PAGE * PAGE
    length = t.data_ptr() + t.numel() * t.element_size() - start
    vec = (ctypes.c_ubyte * -(-length // PAGE))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec)


def test_populate_pages_maps_every_page_and_keeps_the_contents():
    buf = mmap.mmap(-1, 256 * PAGE)  # fresh anonymous memory: nothing mapped until written
    t = torch.frombuffer(buf, dtype=torch.uint8)
    t[5 * PAGE + 7] = 42
    assert _resident_pages(t) == 1
    assert populate_pages(t)
    assert _resident_pages(t) == 256
    assert int(t[5 * PAGE + 7]) == 42 and int(t.sum()) == 42
    del t
    buf.close()


def test_populate_pages_stops_between_chunks():
    buf = mmap.mmap(-1, 8 << 20)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    stop = threading.Event()
    stop.set()
    assert not populate_pages(t, stop)
    assert _resident_pages(t) == 0
    del t
    buf.close()


@pytest.mark.parametrize("populate", ["1", "0"])
def test_llm_returns_with_the_cache_pages_committed(monkeypatch, populate):
    """GRAPHINFER_CPU_POPULATE_KV_CACHE=1 (the default outside tests): a thread commits the cache's pages from start-up
    on and LLM() waits for it before returning (issue 55: its time is not counted in the first timed batch), so the
    whole cache is mapped when LLM() returns; 0: no thread. The engine alone (the server's) does not wait."""
    monkeypatch.setenv("GRAPHINFER_CPU_POPULATE_KV_CACHE", populate)
    engine = LLMEngine(create_engine_config(dict(model="tiny-llama", device="cpu", dtype="float32",
                                                 kv_cache_memory_bytes=8 << 20, max_model_len=256)))
    assert (engine.worker.model_runner.kv_pages is not None) == (populate == "1")
    engine.shutdown()
    llm = LLM("tiny-llama", device="cpu", dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=256)
    runner = llm.llm_engine.worker.model_runner
    assert runner.kv_pages is None
    if populate == "1":
        kv = runner.kv_cache
        assert _resident_pages(kv) == -(-(kv.data_ptr() % PAGE + kv.numel() * kv.element_size()) // PAGE)
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def test_shutdown_stops_the_page_thread(monkeypatch):
    """An engine shut down while its thread still runs stops it (which drops the cache it holds)."""
    from graphinfer.platforms import cpu

    class Slow(cpu.PagePopulator):
        def run(self):
            self.stopping.wait(600)
            self.t = None

    def start(self, t):
        thread = Slow(t)
        thread.start()
        return thread

    monkeypatch.setattr(cpu.CpuPlatform, "populate_in_background", start)
    engine = LLMEngine(create_engine_config(dict(model="tiny-llama", device="cpu", dtype="float32",
                                                 kv_cache_memory_bytes=8 << 20, max_model_len=256)))
    thread = engine.worker.model_runner.kv_pages  # LLM() would wait for it: the engine alone (a server's) does not
    assert thread.is_alive()
    engine.shutdown()
    assert thread.stopping.is_set() and not thread.is_alive() and thread.t is None
