"""The numeric check: a graph's outputs before and after a rewrite, compared with NaN / inf in mind.

Outputs may be any pytree (a tensor, tuples, lists, dicts of them, plain values); each run of the check is a
list of such outputs, one per forward step. The comparison gives

- max_abs_error: max |after - before| over every tensor element where both are finite;
- max_rel_error: max over tensors of (that tensor's max abs error / its largest finite |before|);
- nonfinite: elements where the runs disagree on being NaN / inf (NaN vs a number, inf vs a number,
  +inf vs -inf); both NaN, or the same inf, agree. Any such element makes both errors NaN;
- mismatch: outputs of another structure, shape or dtype, or plain values that differ (then the errors are NaN).

A check passes when there is no mismatch and no nonfinite disagreement, and max_abs_error <= atol or
max_rel_error <= rtol. Default tolerances depend on the outputs' (least precise floating) dtype:
DEFAULT_TOLERANCES, overridable per run (`--atol` / `--rtol`).

Graphs with int8 / fp8 activations (w8a8, fp8) are judged with the same tolerances, on purpose: the fused norm /
activation + quant ops must give the unfused graph's codes and scales bit for bit on every implementation
(tests/test_fused_quant_codes.py), so their passes check exact (max abs error 0 on SmolLM2, fp32 and bf16). A
tolerance of "one quantization step" cannot be derived for the final outputs: one flipped code in an early layer
moves the logits through every later layer (2.86 in SmolLM2's logits, issue 55), as much as a real bug would. A pass
that changes codes fails, and the engine declines it (compiler/pipeline.py).
"""
import math
from dataclasses import asdict, dataclass

import torch
from torch.utils import _pytree as pytree

# dtype -> (atol, rtol). Loose enough for a fusion's reassociated sums over a deep model, tight enough that a
# wrong rewrite (a swapped weight, a dropped term) fails by orders of magnitude.
DEFAULT_TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-3, 1e-2),
    torch.bfloat16: (1e-2, 5e-2),
}


def default_tolerances(dtype: torch.dtype | None) -> tuple[float, float]:
    if dtype in DEFAULT_TOLERANCES:
        return DEFAULT_TOLERANCES[dtype]
    if dtype is not None and dtype.is_floating_point:  # fp8 and other narrow types: relative to their eps
        eps = torch.finfo(dtype).eps
        return 10 * eps, 10 * eps
    return DEFAULT_TOLERANCES[torch.float32]


@dataclass
class CheckResult:
    max_abs_error: float
    max_rel_error: float
    nonfinite: int = 0
    mismatch: str = ""
    atol: float = 0.0
    rtol: float = 0.0
    dtype: str = ""  # the outputs' least precise floating dtype (what the default tolerances came from)

    @property
    def passed(self) -> bool:
        return not self.mismatch and not self.nonfinite and (
            self.max_abs_error <= self.atol or self.max_rel_error <= self.rtol)

    def why(self) -> str:
        """'' when passed, else what failed."""
        if self.mismatch:
            return self.mismatch
        if self.nonfinite:
            return f"{self.nonfinite} output elements are NaN/inf in one graph and not in the other"
        if not self.passed:
            return (f"max abs error {self.max_abs_error:.3g} > atol {self.atol:.3g} and max rel error "
                    f"{self.max_rel_error:.3g} > rtol {self.rtol:.3g}")
        return ""

    def to_json(self) -> dict:
        return {**asdict(self), "passed": self.passed}

    @classmethod
    def from_json(cls, d: dict) -> "CheckResult":
        return cls(**{k: v for k, v in d.items() if k != "passed"})


def _worst(a: float, b: float) -> float:
    """max that keeps NaN (Python's max drops a NaN that is not first)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _least_precise(dtypes: list[torch.dtype]) -> torch.dtype | None:
    floats = [d for d in dtypes if d.is_floating_point]
    return max(floats, key=lambda d: torch.finfo(d).eps) if floats else None


def _compare_tensors(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, int]:
    """(max abs error, max rel error, nonfinite disagreements) of b against the reference a."""
    if a.numel() == 0:
        return 0.0, 0.0, 0
    if not (a.is_floating_point() or a.is_complex()):
        diff = int((a != b).sum())
        err = float((a.long() - b.long()).abs().max()) if diff else 0.0
        scale = float(a.long().abs().max())
        return err, (err / scale if scale else (0.0 if not err else math.inf)), 0
    a, b = a.float(), b.float()  # fp32, not fp64: not every device has fp64
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    both = fa & fb
    agree = (torch.isnan(a) & torch.isnan(b)) | (torch.isinf(a) & (a == b))
    nonfinite = int((~both & ~agree).sum())
    if nonfinite:
        return math.nan, math.nan, nonfinite
    zero = torch.zeros((), device=a.device)
    err = float(torch.where(both, (a - b).abs(), zero).max())
    scale = float(torch.where(fa, a.abs(), zero).max())
    rel = err / scale if scale else (0.0 if err == 0 else math.inf)
    return err, rel, 0


def compare(reference: list, outputs: list, atol: float | None = None, rtol: float | None = None) -> CheckResult:
    """Compare two runs (lists of per-step outputs, any pytrees); atol / rtol None: the dtype's defaults."""
    ref_leaves, ref_spec = pytree.tree_flatten(reference)
    out_leaves, out_spec = pytree.tree_flatten(outputs)
    dtype = _least_precise([t.dtype for t in ref_leaves if isinstance(t, torch.Tensor)])
    d_atol, d_rtol = default_tolerances(dtype)
    result = CheckResult(0.0, 0.0, atol=d_atol if atol is None else atol, rtol=d_rtol if rtol is None else rtol,
                         dtype=str(dtype).removeprefix("torch.") if dtype is not None else "")
    if ref_spec != out_spec:
        result.mismatch = f"the outputs' structure changed: {_short(ref_spec)} -> {_short(out_spec)}"
    for i, (a, b) in enumerate(zip(ref_leaves, out_leaves)):
        if result.mismatch:
            break
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            result.mismatch = f"output {i}: {type(a).__name__} -> {type(b).__name__}"
        elif not isinstance(a, torch.Tensor):
            if a != b:
                result.mismatch = f"output {i}: {a!r} -> {b!r}"
        elif a.shape != b.shape or a.dtype != b.dtype:
            result.mismatch = f"output {i}: {a.dtype}{list(a.shape)} -> {b.dtype}{list(b.shape)}"
        else:
            err, rel, nonfinite = _compare_tensors(a.detach(), b.detach())
            result.max_abs_error = _worst(result.max_abs_error, err)
            result.max_rel_error = _worst(result.max_rel_error, rel)
            result.nonfinite += nonfinite
    if result.mismatch:
        result.max_abs_error = result.max_rel_error = math.nan
    return result


def _short(spec) -> str:
    text = str(spec).replace("\n", " ")
    return text if len(text) < 120 else text[:117] + "..."
