"""Data parallel on CPU (gloo, real replica processes): two replicas behind one front end.

MoE + expert parallel (tiny Qwen3-MoE from an HF checkpoint, EP 2 over DP 2 x TP 1): greedy tokens identical to
one plain engine, with requests on both replicas, on one replica only (the other runs padding-only steps in
lockstep: no hang), in NONE and under the recorded-op capture stand-in with async scheduling (decode graphs and
pieces replayed on both replicas with the same buckets); the expert counts, summed over the replicas, are the
tokens computed x top_k in every layer. A dense server with --data-parallel-size 2 serves two clients' requests on
different replicas (the per-replica gauges of /metrics) and ends when a replica dies.
"""
import signal
import threading
import time

import httpx
import psutil
import pytest
from capture_standin import OpTapePlatform
from server_utils import Server, metric, metric_samples, processes_running

import graphinfer.runtime.entrypoints.llm_engine as llm_engine
from graphinfer import LLM, SamplingParams
from graphinfer.sampling_params import RequestOutputKind

KW = dict(device="cpu", dtype="float32", block_size=4, num_gpu_blocks_override=64, max_num_seqs=4,
          max_num_batched_tokens=16)
PROMPTS = [[3 + i] * (2 + 5 * i) for i in range(4)] + [list(range(100, 121))]  # prefill chunks of up to 16 tokens


def _params():
    return [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(len(PROMPTS))]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def moe(tiny_checkpoint):
    path, hf = tiny_checkpoint("qwen3_moe")
    ref = LLM(path, **KW)
    tokens = {"all": _tokens(ref.generate(PROMPTS, _params(), use_tqdm=False)),
              "one": _tokens(ref.generate(PROMPTS[-1:], _params()[-1:], use_tqdm=False))}
    ref.shutdown()
    return path, hf.config.num_experts_per_tok, tokens


@pytest.mark.parametrize("mode", ["NONE", "capture-standin"])
def test_dp2_ep2_matches_one_engine(mode, moe, monkeypatch):
    path, top_k, ref = moe
    kw = dict(KW)
    if mode != "NONE":  # the replicas get the front end's platform class: the stand-in replays on both
        monkeypatch.setattr(llm_engine, "platform_for_device", lambda device_type: OpTapePlatform())
        kw.update(graph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4, 8], async_scheduling=True)
    with LLM(path, data_parallel_size=2, enable_expert_parallel=True, **kw) as llm:
        engine = llm.llm_engine
        dp = engine.engine_core  # the data-parallel front end (engine/dp_core.py)
        assert dp.local.dp_lockstep and engine.expert_load_summary()["ep_size"] == 2
        both = llm.generate(PROMPTS, _params(), use_tqdm=False)
        assert dp.requests_routed[0] > 0 and dp.requests_routed[1] > 0
        routed = list(dp.requests_routed)
        one = llm.generate(PROMPTS[-1:], _params()[-1:], use_tqdm=False)  # one replica works, the other pads
        assert sum(dp.requests_routed) - sum(routed) == 1
        load = engine.expert_load()
        if mode == "NONE":
            # parallel sampling on replica 1: the request runs there whole, its children gathered into one output
            two = engine.make_request(PROMPTS[-1], SamplingParams(n=2, temperature=0, max_tokens=4, ignore_eos=True,
                                                                    output_kind=RequestOutputKind.FINAL_ONLY))
            engine.add(two, dp_rank=1)
            outs = []
            while engine.has_unfinished_requests():
                outs += engine.step()
            assert len(outs) == 1 and outs[0].finished
            assert [c.token_ids for c in outs[0].outputs] == [ref["one"][0][:4]] * 2
            # a request aborted on replica 1 (n=2: both children) stays outstanding until that replica freed it
            seq = engine.make_request(PROMPTS[0], SamplingParams(n=2, max_tokens=50, ignore_eos=True))
            engine.add(seq, dp_rank=1)
            engine.step()
            # Replica 0's rounds end slowly, so the acknowledgement arrives within the round after the abort: the front
            # end then stops stepping, and a load report that waited for the replica's next round never came (CI).
            local_step = dp.local.step

            def slow_step():
                outs = local_step()
                time.sleep(0.3)
                return outs

            monkeypatch.setattr(dp.local, "step", slow_step)
            engine.abort_request(seq.request_id)
            for _ in range(200):
                if not engine.has_unfinished_requests():
                    break
                engine.step()
            assert not engine.has_unfinished_requests() and dp.outstanding == [0, 0]
            assert engine.stats()["engines"][1]["running"] == 0  # the acknowledgement carried its load
    assert _tokens(both) == ref["all"] and _tokens(one) == ref["one"]
    computed = sum(len(o.prompt_token_ids) - o.num_cached_tokens + len(o.outputs[0].token_ids) - 1
                   for o in both + one)
    assert load and all(sum(counts) == computed * top_k for counts in load.values()), (load, computed)


def test_dense_dp2_server_spreads_clients_and_ends_when_a_replica_dies(tmp_path):
    from openai import OpenAI

    server = Server(["tiny-qwen3", "--device", "cpu", "--dtype", "float32", "--max-model-len", "128",
                     "--data-parallel-size", "2"], tmp_path / "dp.log").launch()
    try:
        server.wait_ready(180)
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        prompt = [5, 9, 2, 7, 7]
        ref = LLM("tiny-qwen3", device="cpu", dtype="float32", max_model_len=128).generate(
            [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
        answers = [None, None]

        def ask(i):  # two clients at once: the second goes to the replica with fewer outstanding tokens
            answers[i] = client.completions.create(model="tiny-qwen3", prompt=prompt, max_tokens=24, temperature=0,
                                                   extra_body={"ignore_eos": True})

        clients = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(120)
        assert [a.usage.completion_tokens for a in answers] == [24, 24]
        text = httpx.get(f"{server.url}/metrics").text
        samples = metric_samples(text)
        routed = [metric(samples, "graphinfer:engine_requests_routed", engine=str(d)) for d in range(2)]
        assert routed == [1, 1], text
        assert metric(samples, "graphinfer:generation_tokens_total") == 48
        if ref.outputs[0].text:  # a preset has no tokenizer: its texts are empty, the token counts say it all
            assert all(a.choices[0].text == ref.outputs[0].text for a in answers)
        # KV usage covers every replica: two streams running, one on each, both replicas' blocks in use
        streams = [client.completions.create(model="tiny-qwen3", prompt=prompt, max_tokens=100, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True}) for _ in range(2)]
        for stream in streams:
            next(iter(stream))
        samples = metric_samples(httpx.get(f"{server.url}/metrics").text)
        per_engine = [metric(samples, "graphinfer:engine_kv_cache_usage_perc", engine=str(d)) for d in range(2)]
        assert all(u > 0 for u in per_engine), per_engine
        assert metric(samples, "graphinfer:kv_cache_usage_perc") == pytest.approx(sum(per_engine) / 2)
        for stream in streams:
            assert sum(len(c.choices[0].text) >= 0 for c in stream) > 0
        # replica 1 dies: the front end learns it from its connection and the server exits non-zero. The server's
        # engine core (the data-parallel front end with replica 0) is a core process; replica 1 is its child.
        cores = processes_running(server.proc.pid, "graphinfer.runtime.engine.core_proc")
        replica = [p for p in cores if p.parent().pid != server.proc.pid]
        assert len(replica) == 1
        replica[0].send_signal(signal.SIGKILL)
        started = time.monotonic()
        assert server.proc.wait(30) != 0
        assert time.monotonic() - started < 20
        assert "data-parallel replica" in server.log()
    finally:
        server.stop()
