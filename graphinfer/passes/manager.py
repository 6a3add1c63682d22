"""PassManager: runs an ordered list of passes, recording what each did and checking it numerically."""
import time
from collections.abc import Sequence

import torch
from torch import fx

from graphinfer.passes.base import Pass, PassReport


class PassManager:
    """check_inputs: a list of steps, each the positional args of one forward call, run in order on the
    graph before and after every pass (the steps may depend on each other through the KV cache, e.g. a
    prefill then a decode); each pass's max_abs_error compares all outputs of the two runs."""

    def __init__(self, passes: Sequence[Pass], check_inputs: list[tuple] | None = None):
        self.passes = list(passes)
        self.check_inputs = check_inputs

    @torch.inference_mode()
    def _outputs(self, gm: fx.GraphModule) -> list[torch.Tensor] | None:
        if self.check_inputs is None:
            return None
        return [gm(*args) for args in self.check_inputs]

    def run(self, gm: fx.GraphModule) -> list[PassReport]:
        reports = []
        reference = self._outputs(gm)
        for p in self.passes:
            before = len(gm.graph.nodes)
            t = time.perf_counter()
            matches = p.apply(gm)
            gm.graph.lint()
            gm.recompile()
            elapsed = time.perf_counter() - t
            error = None
            if reference is not None:
                outputs = self._outputs(gm)
                error = max((a.float() - b.float()).abs().max().item() for a, b in zip(reference, outputs))
                reference = outputs
            reports.append(PassReport(p.name, matches, before, len(gm.graph.nodes), elapsed, error, list(p.declined)))
        return reports
