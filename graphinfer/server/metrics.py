"""Prometheus metrics, named like vLLM's (`vllm:...` -> `graphinfer:...`), on a registry per server."""
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from graphinfer.errors import GraphinferError

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}
        self._labels = labels
        self.http_requests = Counter("graphinfer:http_requests", "HTTP requests by endpoint and status code",
                                     ["model_name", "endpoint", "status"], registry=r)
        self.request_success = Counter("graphinfer:request_success", "Finished requests by finish reason",
                                       ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = Counter("graphinfer:prompt_tokens", "Prompt tokens processed", ["model_name"],
                                     registry=r).labels(**labels)
        self.generation_tokens = Counter("graphinfer:generation_tokens", "Tokens generated", ["model_name"],
                                         registry=r).labels(**labels)
        self.ttft = Histogram("graphinfer:time_to_first_token_seconds", "Time to first token", ["model_name"],
                              buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.tpot = Histogram("graphinfer:time_per_output_token_seconds", "Time per output token after the first",
                              ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.e2e = Histogram("graphinfer:e2e_request_latency_seconds", "Request latency", ["model_name"],
                             buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)

    def watch_engine(self, engine) -> None:
        """Read the scheduler and cache gauges from engine.stats() at each scrape (an EngineClient: summed over
        data-parallel replicas, KV usage their mean, each replica's own with label engine=<dp rank>)."""
        self.registry.register(EngineStatsCollector(engine, self._labels["model_name"]))

    def watch_expert_load(self, engine) -> None:
        """Export a MoE engine's expert load (runtime/worker/expert_load.py) at each scrape; nothing for a dense
        model. engine: the EngineClient (entrypoints/llm_engine.py)."""
        if engine.info.num_moe_layers:
            self.registry.register(ExpertLoadCollector(engine, self._labels["model_name"]))

    def watch_eplb(self, engine) -> None:
        """Export EPLB's rearrangements, moved bytes and EP-rank imbalance at each scrape, with it on."""
        if engine.info.num_moe_layers and engine.eplb_stats().get("enabled"):
            self.registry.register(EplbCollector(engine, self._labels["model_name"]))

    def watch_spec_decode(self, engine) -> None:
        """Export speculative decoding's counters (vLLM's spec_decode_* names) at each scrape, with it on."""
        if engine.info.spec_decode:
            self.registry.register(SpecDecodeCollector(engine, self._labels["model_name"]))

    def http(self, endpoint: str, status: int) -> None:
        self.http_requests.labels(endpoint=endpoint, status=str(status), **self._labels).inc()

    def finished(self, reason: str) -> None:
        self.request_success.labels(finished_reason=reason, **self._labels).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineStatsCollector:
    """Scheduler and cache gauges, read from the engine's last reported load at scrape time (a core in another
    process reports it with every step's outputs and every abort)."""

    _TOTALS = (("num_requests_running", "running", "Requests in the running batch"),
               ("num_requests_waiting", "waiting", "Requests waiting to be scheduled"),
               ("kv_cache_usage_perc", "kv_usage", "Fraction of KV-cache blocks in use (0-1)"),
               ("num_preemptions", "preemptions", "Preemptions so far"))
    _PER_ENGINE = (("engine_num_requests_running", "running", "Requests running on each data-parallel replica"),
                   ("engine_num_requests_waiting", "waiting", "Requests waiting on each data-parallel replica"),
                   ("engine_kv_cache_usage_perc", "kv_usage", "KV-cache use of each data-parallel replica (0-1)"),
                   ("engine_requests_routed", "requests", "Requests the front end sent to each data-parallel "
                                                         "replica so far"))

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name
        lora = getattr(getattr(engine, "config", None), "lora_config", None)
        self.max_loras = lora.max_loras if lora is not None and lora.enable_lora else 0

    def describe(self):
        return [GaugeMetricFamily(f"graphinfer:{name}", "") for name, _, _ in self._TOTALS + self._PER_ENGINE]

    def collect(self):
        try:
            stats = self.engine.stats()
        except (AttributeError, GraphinferError):  # the engine is shutting down
            return
        for name, key, help_ in self._TOTALS:
            g = GaugeMetricFamily(f"graphinfer:{name}", help_, labels=["model_name"])
            g.add_metric([self.model_name], stats[key])
            yield g
        if "running_lora_adapters" in stats:  # vLLM's vllm:lora_requests_info: the value is when it was read
            g = GaugeMetricFamily("graphinfer:lora_requests_info", "Running stats on LoRA requests",
                                  labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            g.add_metric([str(self.max_loras), ",".join(stats["running_lora_adapters"]),
                          ",".join(stats["waiting_lora_adapters"])], time.time())
            yield g
        engines = stats.get("engines", [])
        for name, key, help_ in self._PER_ENGINE if engines else ():
            g = GaugeMetricFamily(f"graphinfer:{name}", help_, labels=["model_name", "engine"])
            for d, e in enumerate(engines):
                g.add_metric([self.model_name, str(d)], e[key])
            yield g


class SpecDecodeCollector:
    """Counters of speculative decoding since start (runtime/spec_decode/metrics.py), read at scrape time."""

    _HELP = {"num_drafts": "Verified drafts (a request's proposal in one step)",
             "num_draft_tokens": "Draft tokens verified", "num_accepted_tokens": "Draft tokens accepted"}

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def describe(self):
        return [CounterMetricFamily(f"graphinfer:spec_decode_{name}", "") for name in (*self._HELP, "num_accepted_tokens_per_pos")]

    def collect(self):
        try:
            stats = self.engine.spec_decode_stats()
        except (AttributeError, GraphinferError):  # the engine is shutting down
            return
        if not stats:
            return
        for name, help_ in self._HELP.items():
            yield _counter(name, help_, self.model_name, stats[name])
        per_pos = CounterMetricFamily("graphinfer:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted "
                                      "at each draft position", labels=["model_name", "position"])
        for pos, n in enumerate(stats["num_accepted_tokens_per_pos"]):
            per_pos.add_metric([self.model_name, str(pos)], n)
        yield per_pos


def _counter(name: str, help_: str, model_name: str, value: int) -> CounterMetricFamily:
    c = CounterMetricFamily(f"graphinfer:spec_decode_{name}", help_, labels=["model_name"])
    c.add_metric([model_name], value)
    return c


class ExpertLoadCollector:
    """Per MoE layer: tokens routed to each expert since the engine was ready (a counter: it restarts at
    reset_expert_load), and the imbalance (max / mean) over experts and over the EP ranks of the engine's
    expert-parallel size (1.0 with EP off). Read at scrape time: a host sync, off the engine's step path."""

    _NAMES = ("graphinfer:moe_expert_tokens", "graphinfer:moe_expert_imbalance", "graphinfer:moe_ep_rank_imbalance")

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def describe(self):
        return [GaugeMetricFamily(name, "") for name in self._NAMES]  # names only: no device read at registration

    def collect(self):
        try:
            summary = self.engine.expert_load_summary()
        except (AttributeError, RuntimeError, GraphinferError):  # the engine is shutting down: its buffers are gone
            return
        m = self.model_name
        tokens = CounterMetricFamily(self._NAMES[0], "Tokens routed to each expert of each MoE layer (each of a "
                                     "token's top_k experts counts it once)", labels=["model_name", "layer", "expert"])
        experts = GaugeMetricFamily(self._NAMES[1], "Max / mean tokens per expert of each MoE layer",
                                    labels=["model_name", "layer"])
        ranks = GaugeMetricFamily(self._NAMES[2], "Max / mean tokens per expert-parallel rank of each MoE layer "
                                  "(contiguous expert placement; 1 with expert parallelism off)",
                                  labels=["model_name", "layer", "ep_size"])
        for layer, v in summary["layers"].items():
            for expert, n in enumerate(v["tokens_per_expert"]):
                tokens.add_metric([m, layer, str(expert)], n)
            experts.add_metric([m, layer], v["expert_imbalance"])
            ranks.add_metric([m, layer, str(summary["ep_size"])], v["rank_imbalance"])
        yield from (tokens, experts, ranks)


class EplbCollector:
    """EPLB (runtime/worker/eplb_state.py): rearrangements and bytes moved between EP ranks since start, and of the
    last rearrangement: its window's EP-rank imbalance (max / mean tokens per rank under the placement in force,
    measured), the same load's under the plain contiguous placement, and its seconds. Read at scrape time."""

    _NAMES = ("graphinfer:eplb_rearrangements", "graphinfer:eplb_moved_bytes", "graphinfer:eplb_ep_rank_imbalance",
              "graphinfer:eplb_ep_rank_imbalance_without_eplb", "graphinfer:eplb_rearrangement_seconds")

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def describe(self):
        return [GaugeMetricFamily(name, "") for name in self._NAMES]

    def collect(self):
        try:
            stats = self.engine.eplb_stats()
        except (AttributeError, RuntimeError, GraphinferError):  # the engine is shutting down
            return
        if not stats.get("enabled"):
            return
        last, labels = stats["last"], ["model_name"]
        for name, help_, value in (
                (self._NAMES[0], "EPLB rearrangements (expert placements computed and applied)", stats["rearrangements"]),
                (self._NAMES[1], "Expert weight bytes moved between EP ranks by EPLB", stats["moved_bytes_total"])):
            c = CounterMetricFamily(name, help_, labels=labels)
            c.add_metric([self.model_name], value)
            yield c
        for name, help_, key in (
                (self._NAMES[2], "Max / mean tokens per EP rank over the last EPLB window (mean over MoE layers), "
                                 "under the placement in force", "rank_imbalance"),
                (self._NAMES[3], "The same window's load under the plain contiguous placement (no EPLB)",
                 "rank_imbalance_without_eplb"),
                (self._NAMES[4], "Seconds the last EPLB rearrangement took (policy and weight moves)", "seconds")):
            if last.get(key) is not None:
                g = GaugeMetricFamily(name, help_, labels=labels)
                g.add_metric([self.model_name], last[key])
                yield g
