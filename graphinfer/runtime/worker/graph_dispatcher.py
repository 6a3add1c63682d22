"""The graph dispatcher (vLLM's CudagraphDispatcher): the one owner of the graph mode, the capture sizes, the captured
graphs, and the choice, per step, of what runs.

  NONE                 every step runs the (lowered) graph eagerly
  FULL_DECODE_ONLY     one full device graph per decode batch size (the LM head inside unless capture_lm_head=False),
                       and with speculative decoding one per size of uniform 1 + k token verify batches
  PIECEWISE            the split graph's attention-free pieces per token count; attention runs eagerly between them
  FULL_AND_PIECEWISE   both (vLLM's default where graphs can be captured)

dispatch() decides from the step's shape alone (as every tensor-parallel rank can, and every data-parallel replica
in lockstep agrees to): a uniform decode batch (one token per request; 1 + k: verify) of at most the largest decode
size replays a full graph, unless the replicas agreed otherwise; any other step of at most the largest piecewise size
replays the pieces; the rest run eagerly.
"""
import logging
from dataclasses import dataclass

import numpy as np

from graphinfer.config import FULL_GRAPH_MODES, PIECEWISE_GRAPH_MODES, EngineConfig
from graphinfer.errors import GraphCaptureError, InvalidConfigError
from graphinfer.platforms import KernelBackend, Platform
from graphinfer.runtime.worker.device_graphs import CaptureStats, DecodeGraphs
from graphinfer.runtime.worker.piecewise_graphs import PiecewiseGraphs

logger = logging.getLogger(__name__)

EAGER, FULL, PIECEWISE = "eager", "full", "piecewise"


@dataclass(frozen=True)
class Dispatch:
    kind: str  # EAGER, FULL or PIECEWISE
    graphs: object = None  # FULL: the DecodeGraphs (decode or verify) that replay


def resolve_graph_mode(config: EngineConfig, platform: Platform, backend: KernelBackend) -> str:
    """The graph mode this engine runs: the configured one, else the platform's default for its kernels; refused,
    with the fix, where it cannot capture."""
    cc = config.compile_config
    mode = cc.graph_mode or backend.default_graph_mode
    if mode != "NONE" and backend.name == "reference":
        raise InvalidConfigError("kernels='reference' runs the PyTorch reference ops, which read lengths on the "
                                 "host and cannot be captured; use the platform's kernels or graph_mode='NONE'.")
    if mode not in backend.graph_modes:
        raise InvalidConfigError(f"graph_mode={mode!r}: the {platform.name} platform runs "
                                 f"{' / '.join(backend.graph_modes)} with kernels={backend.name!r}. Use one of those.")
    return mode


class GraphDispatcher:
    def __init__(self, config: EngineConfig, platform: Platform, mode: str, capture_sizes: list[int],
                 num_speculative_tokens: int | None, tp_size: int = 1):
        sc = config.scheduler_config
        self.config, self.platform, self.mode, self.capture_sizes = config, platform, mode, capture_sizes
        self.full, self.piecewise = mode in FULL_GRAPH_MODES, mode in PIECEWISE_GRAPH_MODES
        spec = config.speculative_config
        # an MTP drafter reads every step's hidden states: full graphs then end before the LM head
        # (pipeline parallel: the LM head runs on the first stage, after the last stage's rows come back)
        self.lm_head_in_graph = self.full and config.compile_config.capture_lm_head and \
            (spec is None or spec.method != "mtp") and config.parallel_config.pipeline_parallel_size == 1
        self.num_speculative_tokens, self.tp_size = num_speculative_tokens, tp_size
        # full decode graphs: the capture sizes a decode batch can have (at most max_num_seqs rows)
        self.decode_sizes = [s for s in capture_sizes if s <= sc.max_num_seqs] or [min(capture_sizes)]
        # pieces: the sizes a step can have (at most max_num_batched_tokens tokens), fitted to the platform's budget
        self.piecewise_sizes = [s for s in capture_sizes if s <= sc.max_num_batched_tokens] or [min(capture_sizes)]
        # the largest captured forward, whose activation peak the KV-cache budget profiles (0: nothing captured)
        self.max_graph_tokens = max(capture_sizes) if mode != "NONE" else 0
        self.decode_graphs: DecodeGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = None  # 1 + k tokens per request (speculative decoding)
        self.piecewise_graphs: PiecewiseGraphs | None = None
        self.capture_stats: CaptureStats | None = None  # the decode graphs' (the verify graphs' are not kept)
        self.piecewise_capture_stats: CaptureStats | None = None

    # ----- capture -----
    def capture(self, runner, split, phase) -> None:
        """Record the mode's graphs over `runner` (its KV cache allocated, its kernels warm): full decode (and verify)
        graphs first, then the pieces of `split` (the executable cut at the splitting ops). phase(name): a context
        timing a start-up phase."""
        max_blocks = -(-runner.max_model_len // runner.block_size)
        if self.full:
            forward = runner.logits_forward if self.lm_head_in_graph else runner.forward
            with phase("capture (decode graphs)"):
                graphs = DecodeGraphs(forward, self.platform, runner.device, self.decode_sizes, max_blocks)
                self.capture_stats = self._capture(graphs, "decode")
                self.decode_graphs = graphs if self.capture_stats else None
            if self.num_speculative_tokens is not None:
                with phase("capture (verify graphs)"):
                    graphs = DecodeGraphs(forward, self.platform, runner.device, self.decode_sizes, max_blocks,
                                          query_len=1 + self.num_speculative_tokens)
                    self.verify_graphs = graphs if self._capture(graphs, "verify") else None
        if self.piecewise:
            sizes = self._fit_budget(self.piecewise_sizes, split.info.num_pieces)
            with phase("capture (piecewise graphs)"):
                self.piecewise_graphs = PiecewiseGraphs(split, self.platform, runner.device, sizes)
                self.piecewise_capture_stats = self.piecewise_graphs.capture()

    def _capture(self, graphs: DecodeGraphs, kind: str) -> CaptureStats | None:
        """graphs captured; None where the platform cannot capture this forward (the cpu platform's traces: a
        forward that reads values on the host), its steps then run eagerly, the reason logged."""
        try:
            return graphs.capture()
        except GraphCaptureError as e:
            graphs.release()
            logger.warning("%s graphs not captured, those steps run eagerly: %s", kind, e)
            return None

    def _fit_budget(self, sizes: list[int], num_pieces: int) -> list[int]:
        """The piecewise sizes within the platform's graph budget (Ascend: its streams; HCCL takes some at tp > 1)
        after the full decode graphs took theirs."""
        budget = self.platform.capture_budget(int(self.tp_size > 1), num_pieces)
        if budget is None:
            return sizes
        if self.full:
            budget -= len(self.decode_sizes)
        return fit_graph_budget(sizes, num_pieces, budget)

    # ----- dispatch -----
    def dispatch(self, h) -> Dispatch:
        """What a step of host inputs h (worker/model_runner.py's HostInputs) runs."""
        b, t = len(h.seq_lens), len(h.input_ids)
        if b and h.decode_graphs:
            g = self.decode_graphs if t == b else self.verify_graphs
            if g is not None and b <= g.max_size and t == b * g.query_len and \
                    (g.query_len == 1 or (np.diff(h.query_start_loc) == g.query_len).all()):
                return Dispatch(FULL, g)
        if self.piecewise_graphs is not None and self.piecewise_graphs.bucket(t) is not None:
            return Dispatch(PIECEWISE, self.piecewise_graphs)
        return Dispatch(EAGER)

    def release(self) -> None:
        """Free the captured graphs (and their memory pool) and their static buffers."""
        for graphs in (self.decode_graphs, self.verify_graphs, self.piecewise_graphs):
            if graphs is not None:
                graphs.release()
        self.decode_graphs = self.verify_graphs = self.piecewise_graphs = None


def fit_graph_budget(sizes: list[int], graphs_per_size: int, budget: int) -> list[int]:
    """The capture sizes whose graphs fit `budget` (Ascend's stream budget, as vllm-ascend's
    update_aclgraph_sizes computed it): all of them if they fit, else as many as fit, spread evenly over the
    list with the smallest and the largest kept, and a warning that says how many were kept and why."""
    sizes = sorted(set(sizes))
    keep = max(1, budget // max(1, graphs_per_size))
    if len(sizes) <= keep:
        return sizes
    kept = sorted({sizes[round(i * (len(sizes) - 1) / max(1, keep - 1))] for i in range(keep)})
    logger.warning("Capturing %d of %d piecewise sizes: each costs %d graphs (one per piece) and the platform can "
                   "capture %d graphs in all; kept %s. Lower max_capture_size or give capture_sizes to choose.",
                   len(kept), len(sizes), graphs_per_size, budget, kept)
    return kept
