"""The Pass interface, the per-pass report and the errors a pass pipeline raises."""
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from torch import fx

from graphinfer.errors import GraphinferError
from graphinfer.passes.check import CheckResult


class Pass(ABC):
    """A graph rewrite. Subclasses set `name` and `description` and implement `apply`.

    apply(gm) rewrites gm.graph in place (adding submodules such as fused Linears to gm as needed) and
    returns how many times it matched. Where it sees a candidate it does not cover, it says why with
    `self.decline(reason)`; the reasons end up in the pass report. The manager recompiles gm afterwards.
    """

    name: str = ""
    description: str = ""

    def __init__(self):
        self.declined: list[str] = []

    def decline(self, reason: str) -> None:
        # Works even where a subclass's __init__ did not call super().__init__().
        self.__dict__.setdefault("declined", []).append(reason)

    @abstractmethod
    def apply(self, gm: fx.GraphModule) -> int:
        """Rewrite gm.graph in place; return the number of matches."""


@dataclass
class PassReport:
    name: str
    matches: int
    nodes_before: int
    nodes_after: int
    time_s: float
    max_abs_error: float | None  # vs the graph before this pass, on the same inputs; None if not checked
    declined: list[str] = field(default_factory=list)
    max_rel_error: float | None = None  # max abs error / the largest |output| (per output tensor)
    nonfinite: int = 0  # output elements NaN/inf in one graph and not in the other
    mismatch: str = ""  # outputs of another structure, shape or dtype
    atol: float | None = None  # the tolerances the check was judged with
    rtol: float | None = None
    passed: bool | None = None  # None: not checked

    def to_json(self) -> dict:
        return dict(self.__dict__)

    @property
    def check(self) -> CheckResult | None:
        if self.passed is None or self.max_abs_error is None:
            return None
        return CheckResult(self.max_abs_error, self.max_rel_error if self.max_rel_error is not None else self.max_abs_error,
                           self.nonfinite, self.mismatch, self.atol or 0.0, self.rtol or 0.0)

    def set_check(self, check: CheckResult) -> None:
        self.max_abs_error, self.max_rel_error = check.max_abs_error, check.max_rel_error
        self.nonfinite, self.mismatch, self.atol, self.rtol = check.nonfinite, check.mismatch, check.atol, check.rtol
        self.passed = check.passed


class PassReports(list):
    """The reports of a pipeline, in order, plus `end_to_end`: the final graph against the unfused one (None
    when nothing was checked or no pass ran)."""

    def __init__(self, reports=(), end_to_end: CheckResult | None = None):
        super().__init__(reports)
        self.end_to_end = end_to_end

    @property
    def passed(self) -> bool:
        """No pass and not the end-to-end comparison failed its check (unchecked ones count as passed)."""
        return not self.failures()

    def failures(self) -> list[str]:
        """'<pass>: <why>' for every failed check."""
        out = [f"{r.name}: {r.check.why()}" for r in self if r.check is not None and not r.check.passed]
        if self.end_to_end is not None and not self.end_to_end.passed:
            out.append(f"end-to-end (fused vs unfused): {self.end_to_end.why()}")
        return out

    def rejudge(self, atol: float | None = None, rtol: float | None = None) -> "PassReports":
        """The same reports judged with other tolerances (None keeps each check's own)."""
        def again(check: CheckResult) -> CheckResult:
            return CheckResult(check.max_abs_error, check.max_rel_error, check.nonfinite, check.mismatch,
                               check.atol if atol is None else atol, check.rtol if rtol is None else rtol, check.dtype)

        reports = []
        for r in self:
            r = PassReport(**r.to_json())
            if r.check is not None:
                r.set_check(again(r.check))
            reports.append(r)
        return PassReports(reports, again(self.end_to_end) if self.end_to_end is not None else None)


class PassError(GraphinferError, RuntimeError):
    """A pass raised, or left a graph that does not lint or run; the message names the pass."""


class PassCheckError(GraphinferError, ValueError):
    """A pass (or the pipeline end to end) changed the graph's outputs beyond the check's tolerances."""
