"""The Pass interface and the per-pass report."""
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from torch import fx


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
        self.declined.append(reason)

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
    max_abs_error: float | None  # fused vs unfused outputs on the same random inputs; None if not checked
    declined: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return dict(self.__dict__)
