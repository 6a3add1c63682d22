"""PassManager: runs an ordered list of passes, recording what each did and checking it numerically."""
import os
import time
import traceback
from collections.abc import Sequence

import torch
from torch import fx
from torch.utils import _pytree as pytree

from graphinfer.passes.base import Pass, PassError, PassReport, PassReports
from graphinfer.passes.check import compare


class PassManager:
    """check_inputs: a list of steps, each the positional args of one forward call, run in order on the
    graph before and after every pass (the steps may depend on each other through the KV cache, e.g. a
    prefill then a decode). Each pass is compared with the graph before it, and the final graph with the
    unfused one (`reports.end_to_end`); see graphinfer.passes.check for the errors and the tolerances
    (atol / rtol None: the outputs' dtype's defaults). A pass that reports no matches and leaves the graph's code
    as it was is not run again (6 of the 10 default passes on a dense model: 5 forward pairs instead of 11 at every
    engine start from a checkpoint): its check compares the outputs before it with themselves. The manager reports;
    whoever runs it decides what a failed check stops (`passes verify` exits non-zero, `compile` writes no artifact).

    dump_dir: write the graph as traced and after each pass there (NN-<pass>.py: the code, .txt: the nodes),
    and the graph a pass left broken (NN-<pass>.failed.txt)."""

    def __init__(self, passes: Sequence[Pass], check_inputs: list[tuple] | None = None, *,
                 atol: float | None = None, rtol: float | None = None, dump_dir: str | None = None):
        self.passes = list(passes)
        self.check_inputs = check_inputs
        self.atol, self.rtol = atol, rtol
        self.dump_dir = dump_dir

    @torch.inference_mode()
    def _outputs(self, gm: fx.GraphModule) -> list | None:
        if self.check_inputs is None:
            return None
        # Cloned: an output may alias a buffer that the next step overwrites.
        return [pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, gm(*args))
                for args in self.check_inputs]

    def _dump(self, gm: fx.GraphModule, stem: str, code: bool = True) -> None:
        if not self.dump_dir:
            return
        os.makedirs(self.dump_dir, exist_ok=True)
        with open(os.path.join(self.dump_dir, stem + ".txt"), "w") as f:
            f.write(str(gm.graph) + "\n")
        if code:
            with open(os.path.join(self.dump_dir, stem + ".py"), "w") as f:
                f.write(gm.code)

    def run(self, gm: fx.GraphModule) -> PassReports:
        from graphinfer.passes.registry import pass_origin

        reports = PassReports()
        unfused = reference = self._outputs(gm)
        self._dump(gm, "00-traced")
        origins = gm.meta.setdefault("plugin_passes", [])
        for i, p in enumerate(self.passes, 1):
            name = p.name or type(p).__name__
            p.declined = []
            before, code = len(gm.graph.nodes), gm.code
            t = time.perf_counter()
            stage = "apply()"
            try:
                matches = p.apply(gm)
                stage = "graph.lint() after apply()"
                gm.graph.lint()
                gm.recompile()
            except Exception as e:
                self._dump(gm, f"{i:02d}-{name}.failed", code=False)
                raise _pass_error(name, stage, e) from e
            elapsed = time.perf_counter() - t
            report = PassReport(name, int(matches or 0), before, len(gm.graph.nodes), elapsed, None, list(p.declined))
            self._dump(gm, f"{i:02d}-{name}")
            if reference is not None:
                try:  # a pass that matched nothing and left the code as it was computes what the graph did before
                    outputs = reference if not matches and gm.code == code else self._outputs(gm)
                except Exception as e:
                    raise _pass_error(name, "running the rewritten graph", e) from e
                report.set_check(compare(reference, outputs, self.atol, self.rtol))
                reference = outputs
            reports.append(report)
            if (origin := pass_origin(p)) is not None and origin not in origins:
                origins.append(origin)  # what an artifact of this graph must import to load (see artifact.py)
        if unfused is not None and self.passes:
            reports.end_to_end = compare(unfused, reference, self.atol, self.rtol)
        return reports


def _pass_error(name: str, stage: str, e: Exception) -> PassError:
    """PassError naming the pass and, where the error came from a pass's own code, the line."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f"{os.sep}torch{os.sep}" not in f.filename]
    where = f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    text = str(e)
    if len(text) > 600:  # fx's lint errors carry the whole graph: --dump-dir writes it to a file instead
        text = text[:600] + " [...]"
    return PassError(f"pass {name!r} failed in {stage}: {type(e).__name__}: {text}{where}")
