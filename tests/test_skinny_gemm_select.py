"""Choosing the skinny GEMM per linear shape and row bucket (graphinfer.compiler.skinny_gemm), with a fake timer:
no real timings; the kernel runs under TRITON_INTERPRET=1 where a lowered graph is executed."""
import os

import pytest
import torch
from torch import fx, nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # triton reads it when @triton.jit decorates: set before import

from graphinfer.compiler import skinny_gemm as sg  # noqa: E402
from graphinfer.errors import InvalidConfigError  # noqa: E402
from graphinfer.ops.triton.skinny_gemm import CONFIGS, DEFAULT_CONFIG  # noqa: E402

FAST, SLOW = CONFIGS[1], CONFIGS[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel runs where Triton does (interpreted on cpu)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(40, 24)  # 24x40 +bias, used twice
        self.b = nn.Linear(24, 40, bias=False)
        self.c = nn.Linear(40, 24)

    def forward(self, x):
        return self.c(self.b(self.a(x))) + self.a(x)


def _gm():
    torch.manual_seed(0)
    return fx.symbolic_trace(Tiny())


def fake_timer(times, calls: list | None = None):
    """Seconds from times(shape, rows, candidate) ('cublas' or a config); never runs anything."""
    def timer(run, shape, rows, candidate):
        if calls is not None:
            calls.append(candidate)
        return times(shape, rows, candidate)
    return timer


def test_choose_keeps_the_fastest_beyond_the_margin():
    assert sg.choose(10.0, {FAST: 8.0, SLOW: 9.0}) == FAST
    assert sg.choose(10.0, {FAST: 9.6, SLOW: 9.9}) is None  # 4% faster: within the 5% margin, cuBLAS stays
    assert sg.choose(10.0, {FAST: 9.5}) == FAST  # exactly 5%
    assert sg.choose(10.0, {FAST: 9.6}, margin=0.0) == FAST
    assert sg.choose(10.0, {}) is None


def test_row_buckets_follow_max_num_seqs():
    assert sg.row_buckets(256) == [1, 2, 4, 8]
    assert sg.row_buckets(3) == [1, 2, 4]
    assert sg.row_buckets(1) == [1]
    assert [sg.bucket_for(m) for m in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]


def test_measure_times_every_shape_bucket_and_config():
    gm, calls = _gm(), []
    table = sg.measure(gm, [1, 2], fake_timer(lambda shape, rows, c: 1.0 if c == "cublas" else 2.0, calls))
    shapes = {c.shape for c in table.choices}
    assert shapes == {sg.LinearShape(24, 40, torch.float32, True), sg.LinearShape(40, 24, torch.float32, False)}
    assert len(table.choices) == 2 * 2 and all(c.config is None for c in table.choices)  # cuBLAS faster everywhere
    assert len(calls) == 4 * (1 + len(CONFIGS))
    assert sg.apply(gm, table) is gm  # nothing won: the graph as it was


def test_kernel_where_faster_and_lowered_graph_runs_it():
    gm = _gm()
    # the kernel wins at 1 and 4 rows (by 20%), loses at 2 and 8 (by 4%: inside the margin)
    def times(shape, rows, candidate):
        if candidate == "cublas":
            return 1.0
        if candidate == FAST:
            return 0.8 if rows in (1, 4) else 0.96
        return 1.5

    table = sg.measure(gm, [1, 2, 4, 8], fake_timer(times))
    won = {(c.shape.n, c.rows): c.config for c in table.choices if c.config is not None}
    assert won == {(24, 1): FAST, (24, 4): FAST, (40, 1): FAST, (40, 4): FAST}
    shape = sg.LinearShape(24, 40, torch.float32, True)
    assert table.configs_for(shape) == {1: FAST, 3: FAST, 4: FAST}  # 3 rows run in the 4-row bucket
    assert "kernel for 4 of 8" in table.summary() and table.to_json()["choices"][0]["cublas_us"] == 1e6

    lowered = sg.apply(gm, table)
    assert lowered is not gm and all(type(m) is nn.Linear for m in (gm.a, gm.b, gm.c))  # the engine's graph kept
    assert isinstance(lowered.a, sg.SkinnyLinear) and lowered.a.weight is gm.a.weight
    lowered.to(DEVICE), gm.to(DEVICE)  # shares the weights: both move
    for rows in (1, 2, 3, 9):
        x = torch.randn(rows, 40, device=DEVICE)
        torch.testing.assert_close(lowered(x), gm(x), atol=1e-5, rtol=1e-5)


def test_off_switch_and_force(monkeypatch):
    gm = _gm()
    calls = []
    monkeypatch.setenv(sg.ENV, "0")
    assert sg.lower_skinny_gemm(gm, 8, fake_timer(None, calls)) == (None, gm) and calls == []
    monkeypatch.setenv(sg.ENV, "auto")
    assert sg.lower_skinny_gemm(gm, 8, None) == (None, gm)  # nothing to measure with (cpu): plain linears
    monkeypatch.setenv(sg.ENV, "force")
    table, lowered = sg.lower_skinny_gemm(gm, 2, None)
    assert table.mode == "force" and {c.config for c in table.choices} == {DEFAULT_CONFIG}
    assert isinstance(lowered.b, sg.SkinnyLinear) and sorted(lowered.b.configs) == [1, 2]
    monkeypatch.setenv(sg.ENV, "sometimes")
    with pytest.raises(InvalidConfigError, match="auto .* off, or force"):
        sg.skinny_gemm_mode()
