"""The cpu platform commits the KV cache's pages at start-up (platforms/cpu.populate_pages, in a thread beside
warm-up) instead of page-faulting them in as requests first write them."""
import ctypes
import ctypes.util
import mmap
import os

import pytest
import torch

from graphinfer import LLM, SamplingParams
from graphinfer.platforms.cpu import populate_pages

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


@pytest.mark.parametrize("populate", ["1", "0"])
def test_engine_start_up_waits_for_the_cache_pages(monkeypatch, populate):
    """GRAPHINFER_CPU_POPULATE_KV_CACHE=1 (the default outside tests): start-up has a phase that waits for the thread,
    and the whole cache is mapped when the engine is ready; 0: no thread. Either way the engine serves."""
    monkeypatch.setenv("GRAPHINFER_CPU_POPULATE_KV_CACHE", populate)
    llm = LLM("tiny-llama", device="cpu", dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=256)
    engine = llm.llm_engine
    assert ("KV cache pages (wait for its thread)" in engine.startup.seconds) == (populate == "1")
    kv = engine.model_runner.kv_cache
    if populate == "1":
        assert _resident_pages(kv) == -(-(kv.data_ptr() % PAGE + kv.numel() * kv.element_size()) // PAGE)
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
