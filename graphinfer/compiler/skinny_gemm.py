"""Decode linears on the skinny GEMM kernel where the device itself measures it faster than cuBLAS.

At start-up (before warm-up and capture) every distinct linear shape in the fused graph (N, K, dtype, bias)
is timed at each row bucket M in ROW_BUCKETS that the engine's decode batches reach (max_num_seqs): F.linear
(cuBLAS) against each of the kernel's candidate configs (ops/triton/skinny_gemm.py CONFIGS), with device
events, a few warm-up and REPS timed calls. The kernel is kept for a (shape, bucket) only where its best config
beats cuBLAS by MARGIN; a batch of M rows uses the decision of the smallest bucket >= M. The runner then gets
a copy of the graph whose Linear modules of the winning shapes are SkinnyLinear (same parameters, a dispatch
on the row count: static inside a captured graph, so the choice is fixed per graph). The engine's own graph,
which artifacts save, keeps plain nn.Linear: graph.py and the weights are unchanged, and nothing is measured
on cpu, whose default path never sees this. The LM head (outside the graph, already near bandwidth) and the
fused MoE experts are left alone.

GRAPHINFER_SKINNY_GEMM: unset / "auto" measure as above on GPU platforms; "0" / "off" never use the kernel;
"force" use it with the default config for every shape and bucket, unmeasured (tests under TRITON_INTERPRET=1
with kernels="triton" on cpu; comparisons on a device).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx, nn

from graphinfer import envs
from graphinfer.compiler.trace import is_leaf_layer, with_modules
from graphinfer.errors import InvalidConfigError

logger = logging.getLogger(__name__)

ENV = "GRAPHINFER_SKINNY_GEMM"
ROW_BUCKETS = (1, 2, 4, 8)
MARGIN = 0.05  # the kernel must be at least 5% faster than cuBLAS: noise must not flip a shape back and forth
WARMUP, REPS = 3, 20

# timer(run, shape, rows, candidate) -> seconds per call of run(i) (i: the rep); candidate: "cublas" or a
# SkinnyGemmConfig (shape, rows and candidate say what is timed; the event timer needs only run)
Timer = Callable[[Callable[[int], object], "LinearShape", int, object], float]


def skinny_gemm_mode() -> str:
    """'auto', 'off' or 'force', from GRAPHINFER_SKINNY_GEMM."""
    value = envs.get(ENV).strip().lower()
    if value in ("", "auto", "1", "on", "true", "yes"):
        return "auto"
    if value in ("0", "off", "false", "no"):
        return "off"
    if value == "force":
        return "force"
    raise InvalidConfigError(f"{ENV}={value!r}: use auto (measure at start-up, the default), off, or force")


def bucket_for(rows: int) -> int | None:
    """The smallest row bucket >= rows (None: too many rows for the kernel)."""
    return next((b for b in ROW_BUCKETS if b >= rows), None)


def row_buckets(max_rows: int) -> list[int]:
    """The buckets a batch of at most max_rows rows can fall in."""
    top = bucket_for(min(max_rows, ROW_BUCKETS[-1]))
    return [b for b in ROW_BUCKETS if b <= top]


@dataclass(frozen=True)
class LinearShape:
    n: int
    k: int
    dtype: torch.dtype
    bias: bool

    def __str__(self) -> str:
        return f"{self.n}x{self.k} {str(self.dtype).removeprefix('torch.')}{' +bias' if self.bias else ''}"


@dataclass
class SkinnyGemmChoice:
    shape: LinearShape
    rows: int  # the bucket
    config: object | None  # the SkinnyGemmConfig used, or None: cuBLAS
    cublas_s: float | None  # None: not measured (force)
    kernel_s: float | None  # the best config's time

    def to_json(self) -> dict:
        return {"n": self.shape.n, "k": self.shape.k, "dtype": str(self.shape.dtype).removeprefix("torch."),
                "bias": self.shape.bias, "rows": self.rows, "kernel": str(self.config) if self.config else None,
                "cublas_us": _us(self.cublas_s), "kernel_us": _us(self.kernel_s)}


@dataclass
class SkinnyGemmTable:
    """What start-up decided, per linear shape and row bucket (LLMEngine.skinny_gemm; for reports)."""
    mode: str
    choices: list[SkinnyGemmChoice] = field(default_factory=list)
    seconds: float = 0.0  # measuring, compiles included

    def configs_for(self, shape: LinearShape) -> dict[int, object]:
        """rows (1..8) -> the config serving that many rows of this shape, for the rows the kernel serves."""
        out, lo = {}, 0
        for c in sorted((c for c in self.choices if c.shape == shape), key=lambda c: c.rows):
            if c.config is not None:
                out.update({m: c.config for m in range(lo + 1, c.rows + 1)})
            lo = c.rows
        return out

    def summary(self) -> str:
        won = [c for c in self.choices if c.config is not None]
        parts = [f"{c.shape} M{c.rows}: {c.config}"
                 + (f" {_us(c.kernel_s):.1f} us vs cuBLAS {_us(c.cublas_s):.1f} us" if c.cublas_s else "")
                 for c in won]
        head = f"skinny gemm ({self.mode}): kernel for {len(won)} of {len(self.choices)} (shape, rows) in {self.seconds:.2f} s"
        return head + (": " + "; ".join(parts) if parts else "")

    def to_json(self) -> dict:
        return {"mode": self.mode, "seconds": self.seconds, "choices": [c.to_json() for c in self.choices]}


def _us(s: float | None) -> float | None:
    return None if s is None else s * 1e6


class SkinnyLinear(nn.Linear):
    """An nn.Linear (the same parameters) that runs the skinny GEMM kernel for the row counts in `configs`."""

    def __init__(self, linear: nn.Linear, configs: dict[int, object]):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                         dtype=linear.weight.dtype)
        self.weight, self.bias = linear.weight, linear.bias
        self.configs = configs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        config = self.configs.get(x.shape[0]) if x.dim() == 2 else None
        if config is None:
            return F.linear(x, self.weight, self.bias)
        from graphinfer.ops.triton.skinny_gemm import skinny_gemm

        return skinny_gemm(x, self.weight, self.bias, config)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, skinny rows={sorted(self.configs)}"


def linear_shapes(gm: fx.GraphModule) -> dict[LinearShape, list[str]]:
    """Each distinct Linear shape the graph calls -> the targets of its modules, in graph order."""
    shapes: dict[LinearShape, list[str]] = {}
    for node in gm.graph.nodes:
        mod = gm.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(mod, nn.Linear) and not isinstance(mod, SkinnyLinear) and is_leaf_layer(mod):
            shape = LinearShape(mod.out_features, mod.in_features, mod.weight.dtype, mod.bias is not None)
            shapes.setdefault(shape, []).append(node.target)
    return shapes


def choose(cublas_s: float, kernel_s: dict, margin: float = MARGIN):
    """The fastest config if it beats cuBLAS by `margin`, else None (cuBLAS)."""
    if not kernel_s:
        return None
    best = min(kernel_s, key=kernel_s.get)
    return best if kernel_s[best] <= cublas_s * (1 - margin) else None


def event_timer(device_module) -> Timer:
    """Device time per call with the device's events: WARMUP calls (compiles; their host time measured), then
    REPS calls queued behind a sleep kernel where the device has one, long enough that the host's launch cost
    does not pace the device (a fixed ~1 ms was too short for split-K configs' launches on the H200: it timed
    the host, 16-28 us a call, where a CUDA graph timed 6-7 us)."""
    sleep = getattr(device_module, "_sleep", None)

    def timer(run, shape, rows, candidate) -> float:
        run(0)
        started = time.perf_counter()
        for i in range(1, WARMUP):
            run(i)
        host_s = (time.perf_counter() - started) / max(WARMUP - 1, 1)
        start, end = device_module.Event(enable_timing=True), device_module.Event(enable_timing=True)
        if sleep is not None:  # cycles at up to ~2 GHz: twice the launches' host time, at least 1 ms
            sleep(int(max(1e-3, 2 * REPS * host_s) * 2e9))
        start.record()
        for i in range(REPS):
            run(i)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / REPS

    return timer


@torch.inference_mode()
def measure(gm: fx.GraphModule, buckets: list[int], timer: Timer, margin: float = MARGIN,
            configs=None) -> SkinnyGemmTable:
    """Time cuBLAS against every candidate config per linear shape and bucket. Rep i uses the weights of the
    shape's i-th layer (cyclically), so the weights stream from memory as in a decode step, not from L2."""
    from graphinfer.ops.triton.skinny_gemm import CONFIGS, skinny_gemm

    configs = CONFIGS if configs is None else configs
    started = time.perf_counter()
    table = SkinnyGemmTable("auto")
    for shape, targets in linear_shapes(gm).items():
        mods = [gm.get_submodule(t) for t in targets]
        for rows in buckets:
            x = torch.randn(rows, shape.k, dtype=shape.dtype, device=mods[0].weight.device)

            def cublas(i, x=x):
                m = mods[i % len(mods)]
                return F.linear(x, m.weight, m.bias)

            cublas_s = timer(cublas, shape, rows, "cublas")
            kernel_s = {}
            for config in configs:
                def kernel(i, x=x, config=config):
                    m = mods[i % len(mods)]
                    return skinny_gemm(x, m.weight, m.bias, config)

                kernel_s[config] = timer(kernel, shape, rows, config)
            best = min(kernel_s, key=kernel_s.get) if kernel_s else None
            table.choices.append(SkinnyGemmChoice(shape, rows, choose(cublas_s, kernel_s, margin), cublas_s,
                                                  kernel_s.get(best)))
    table.seconds = time.perf_counter() - started
    return table


def forced(gm: fx.GraphModule, buckets: list[int]) -> SkinnyGemmTable:
    """GRAPHINFER_SKINNY_GEMM=force: the default config for every shape and bucket, unmeasured."""
    from graphinfer.ops.triton.skinny_gemm import DEFAULT_CONFIG

    return SkinnyGemmTable("force", [SkinnyGemmChoice(shape, rows, DEFAULT_CONFIG, None, None)
                                     for shape in linear_shapes(gm) for rows in buckets])


def apply(gm: fx.GraphModule, table: SkinnyGemmTable) -> fx.GraphModule:
    """A copy of gm (same parameters, own module tree) whose Linears of the shapes the kernel won are
    SkinnyLinear; gm itself is left as it is (artifacts save it). gm when the kernel won nothing."""
    shapes = linear_shapes(gm)
    swaps = {t: table.configs_for(shape) for shape, targets in shapes.items() for t in targets}
    swaps = {t: c for t, c in swaps.items() if c}
    if not swaps:
        return gm
    return with_modules(gm, {t: SkinnyLinear(gm.get_submodule(t), c) for t, c in swaps.items()})


def lower_skinny_gemm(gm: fx.GraphModule, max_rows: int, timer: Timer | None, mode: str | None = None
                      ) -> tuple[SkinnyGemmTable | None, fx.GraphModule]:
    """(the decision table, the graph the runner should execute). timer: None where nothing can be measured
    (cpu): there only "force" applies. The table is None when the path is off."""
    mode = mode or skinny_gemm_mode()
    buckets = row_buckets(max_rows)
    if mode == "off" or (mode == "auto" and timer is None):
        return None, gm
    table = forced(gm, buckets) if mode == "force" else measure(gm, buckets, timer)
    logger.info("%s", table.summary())
    return table, apply(gm, table)
