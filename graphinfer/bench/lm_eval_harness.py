"""`graphinfer bench accuracy --lm-eval TASKS`: lm-eval (EleutherAI's harness, pinned 0.4.13) against graphinfer.

Backends, each on the same weights and the same tasks in one run:
  - server: `graphinfer serve MODEL` started here, lm-eval's `local-completions` model against /v1/completions
    (loglikelihood through echo + logprobs, generation through plain completions), as a vLLM user runs it;
  - chat: the same server through `local-chat-completions` (generation tasks only: chat has no loglikelihood);
  - llm: lm-eval's Python API with GraphinferLM below, an lm-eval `LM` over graphinfer's offline `LLM`
    (loglikelihood from SamplingParams.prompt_logprobs);
  - hf: lm-eval's own `hf` backend (transformers) on the same checkpoint, the reference.
The tasks default to graphinfer's own (graphinfer/bench/lm_eval_tasks: built in code, no download); any lm-eval task
name works where its data is at hand. Scores and, per item, the chosen answer of every backend go to the JSON, with
the commit; items where two backends chose differently are counted.
"""
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

from graphinfer.errors import InvalidConfigError

TASKS_DIR = os.path.join(os.path.dirname(__file__), "lm_eval_tasks")
DEFAULT_TASKS = ("graphinfer_capitals", "graphinfer_arith", "graphinfer_arith_gen")
BACKENDS = ("server", "chat", "llm", "hf")


def _lm_eval():
    try:
        import lm_eval
    except ImportError as e:
        raise InvalidConfigError("lm-eval is not installed: pip install 'lm-eval[api,hf]==0.4.13' (the version "
                                 "graphinfer's Makefile pins)") from e
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # graphinfer's tasks build their data in code
    return lm_eval


@functools.cache
def graphinfer_lm_class():
    """GraphinferLM, defined (and registered with lm-eval) on first use, so that importing this module does not
    import lm-eval."""
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from graphinfer import LLM, SamplingParams

    @register_model("graphinfer")
    class GraphinferLM(LM):
        """An lm-eval model over graphinfer.LLM: `--model graphinfer --model_args pretrained=PATH,dtype=float32`
        once this module is imported, or GraphinferLM(llm=LLM(...)) from Python. Token handling follows lm-eval's hf
        backend (context and continuation encoded as HFLM._encode_pair does, no BOS added), so both score the
        same token sequences."""

        def __init__(self, pretrained: str | None = None, llm=None, max_gen_toks: int = 256, **engine_kwargs):
            super().__init__()
            self.llm = llm if llm is not None else LLM(pretrained, **engine_kwargs)
            self.tokenizer = self.llm.get_tokenizer()
            self.max_gen_toks = int(max_gen_toks)
            self.max_length = self.llm.llm_engine.max_model_len

        def _encode(self, text: str) -> list[int]:
            return self.tokenizer.encode(text, add_special_tokens=False)

        def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
            n_spaces = len(context) - len(context.rstrip())
            if n_spaces:
                context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
            whole, ctx = self._encode(context + continuation), self._encode(context)
            return ctx, whole[len(ctx):]

        def _score(self, sequences: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
            """(tokens, n) -> (sum of the logprobs of tokens[n:] given what precedes each, all of them greedy)."""
            for tokens, _ in sequences:
                if len(tokens) >= self.max_length:
                    raise InvalidConfigError(f"an lm-eval request of {len(tokens)} tokens does not fit max_model_len "
                                             f"{self.max_length}; raise max_model_len.")
            params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
            outs = self.llm.generate([{"prompt_token_ids": t} for t, _ in sequences], params, use_tqdm=False)
            results = []
            for (tokens, n), out in zip(sequences, outs):
                picked = [out.prompt_logprobs[i][tokens[i]] for i in range(max(n, 1), len(tokens))]
                results.append((sum(p.logprob for p in picked), all(p.rank == 1 for p in picked)))
            return results

        def loglikelihood(self, requests) -> list[tuple[float, bool]]:
            sequences = []
            for context, continuation in (r.args for r in requests):
                ctx, cont = self._encode_pair(context, continuation) if context else \
                    ([self.eot_token_id], self._encode(continuation))
                sequences.append((ctx + cont, len(ctx)))
            return self._score(sequences)

        def loglikelihood_rolling(self, requests) -> list[float]:
            results = []
            for (text,) in (r.args for r in requests):
                windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                    self._encode(text), self.eot_token_id, self.max_length - 1, 1)]
                scored = self._score([(ctx + cont, len(ctx)) for ctx, cont in windows])
                results.append(sum(lp for lp, _ in scored))
            return results

        def generate_until(self, requests) -> list[str]:
            prompts, params = [], []
            for context, kwargs in (r.args for r in requests):
                kwargs = dict(kwargs)
                stop = handle_stop_sequences(kwargs.pop("until", None), self.tokenizer.decode([self.eot_token_id]))
                greedy = not kwargs.pop("do_sample", False) or kwargs.get("temperature", 0) == 0
                prompts.append({"prompt_token_ids": self._encode(context)})
                params.append(SamplingParams(temperature=0 if greedy else kwargs.get("temperature", 1.0),
                                             max_tokens=int(kwargs.get("max_gen_toks", self.max_gen_toks)),
                                             stop=stop))
            return [o.outputs[0].text for o in self.llm.generate(prompts, params, use_tqdm=False)]

        @property
        def eot_token_id(self) -> int:
            return self.tokenizer.eos_token_id

    return GraphinferLM


class _Server:
    """`graphinfer serve` in a child process, ended with close()."""

    def __init__(self, model: str, args: list[str], port: int, log_path: str, timeout: float = 600.0):
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "graphinfer.cli", "serve", model, "--host", "127.0.0.1",
                                      "--port", str(port), *args], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"graphinfer serve exited with {self.proc.returncode}; see {log_path}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                    self.model_name = json.load(r)["data"][0]["id"]  # what requests must name
                    return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise TimeoutError(f"graphinfer serve was not healthy within {timeout:.0f} s; see {log_path}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tokenizer_dir(model: str, work: str) -> str:
    """A directory lm-eval's hf tokenizer backend can read: the model's own, or a GGUF's tokenizer converted."""
    if not model.endswith(".gguf"):
        return model
    from graphinfer.models.gguf_loader import load_gguf_tokenizer

    path = os.path.join(work, "tokenizer")
    load_gguf_tokenizer(model).save_pretrained(path)
    return path


def _hf_lm(model: str, dtype: str, batch_size: int):
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    if model.endswith(".gguf"):
        from graphinfer.models.gguf_loader import load_gguf_tokenizer

        folder, name = os.path.split(model)
        hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype).eval()
        tokenizer = load_gguf_tokenizer(model)
    else:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).eval()
        tokenizer = AutoTokenizer.from_pretrained(model)
    return HFLM(pretrained=hf, tokenizer=tokenizer, batch_size=batch_size)


def _per_item(samples: dict) -> dict:
    """task -> [the chosen answer per item]: argmax of the choices' loglikelihoods, or the filtered generation."""
    out = {}
    for task, rows in samples.items():
        items = []
        for row in sorted(rows, key=lambda r: r["doc_id"]):
            resps = row["filtered_resps"]
            if resps and isinstance(resps[0], (list, tuple)):  # multiple choice: [(loglikelihood, greedy)] per choice
                scores = [r[0] for r in resps]
                items.append(max(range(len(scores)), key=scores.__getitem__))
            else:
                items.append(resps[0] if isinstance(resps, list) else resps)
        out[task] = items
    return out


def _metrics(results: dict) -> dict:
    return {task: {k: v for k, v in r.items() if isinstance(v, (int, float)) and not k.endswith("stderr,none")
                   and "stderr" not in k} for task, r in results.items()}


def _flags(engine_kwargs: dict) -> list[str]:
    """LLM keyword arguments as `graphinfer serve` flags (the CLI's names are the keywords with dashes)."""
    return [x for k, v in engine_kwargs.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def evaluate(backend: str, model: str, tasks: list[str], limit: int | None = None, dtype: str = "float32",
             engine_kwargs: dict | None = None, batch_size: int = 16, work_dir: str | None = None,
             server: "_Server | None" = None) -> dict:
    """One backend's lm-eval run: {"metrics": {task: {metric: value}}, "answers": {task: [per item]}, "seconds"}.
    server / chat: against `server` (a _Server) if given, else a `graphinfer serve` started for the run."""
    lm_eval = _lm_eval()
    from lm_eval.tasks import TaskManager

    if backend not in BACKENDS:
        raise InvalidConfigError(f"unknown lm-eval backend {backend!r}; choose from {', '.join(BACKENDS)}")
    work = work_dir or tempfile.mkdtemp(prefix="graphinfer-lm-eval-")
    engine_kwargs = dict(engine_kwargs or {})
    task_manager = TaskManager(include_path=TASKS_DIR)
    kwargs = dict(tasks=list(tasks), task_manager=task_manager, limit=limit, log_samples=True)
    start = time.perf_counter()
    started = None
    try:
        if backend in ("server", "chat"):
            if server is None:
                server = started = _Server(model, ["--dtype", dtype, *_flags(engine_kwargs)], _free_port(),
                                           os.path.join(work, "serve.log"))
            endpoint = "/v1/completions" if backend == "server" else "/v1/chat/completions"
            model_args = dict(base_url=server.url + endpoint, model=server.model_name, num_concurrent=4, max_retries=1,
                              timeout=600)
            if backend == "chat":  # chat requests carry one conversation each, as text
                model_args.update(tokenizer_backend=None, tokenized_requests=False)
            else:  # token ids, batch_size prompts per completions request (the server batches them)
                model_args.update(tokenizer_backend="huggingface", tokenizer=_tokenizer_dir(model, work),
                                  batch_size=batch_size)
            res = lm_eval.simple_evaluate(model="local-completions" if backend == "server" else
                                          "local-chat-completions", model_args=model_args,
                                          apply_chat_template=backend == "chat", **kwargs)
        elif backend == "llm":
            from graphinfer import LLM

            llm = LLM(model, dtype=dtype, **engine_kwargs)
            try:
                res = lm_eval.simple_evaluate(model=graphinfer_lm_class()(llm=llm), **kwargs)
            finally:
                llm.shutdown()
        else:
            res = lm_eval.simple_evaluate(model=_hf_lm(model, dtype, batch_size), **kwargs)
    finally:
        if started is not None:
            started.close()
    return {"metrics": _metrics(res["results"]), "answers": _per_item(res["samples"]),
            "seconds": round(time.perf_counter() - start, 1)}


def disagreements(a: dict, b: dict) -> dict:
    """task -> number of items whose chosen answer differs between two evaluate() results."""
    return {task: sum(x != y for x, y in zip(a["answers"][task], b["answers"].get(task, [])))
            for task in a["answers"]}


def _commit() -> str | None:
    """The graphinfer checkout's commit (None outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=os.path.dirname(__file__),
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run(model: str | None, tasks: list[str] | None = None, backends: list[str] | None = None, limit: int | None = None,
        dtype: str = "float32", engine_kwargs: dict | None = None, schemes: list[str] = (),
        dtypes: list[str] = (), output_json: str | None = None) -> dict:
    """Every backend at `dtype`, then graphinfer's offline engine (llm) once per quantization scheme and once per
    other dtype, on the same tasks; answers compared with the hf backend's where it ran."""
    from graphinfer.bench import common

    if not model:  # the CLI's default: the bundled SmolLM2
        from graphinfer.config import bundled_model_path

        model = bundled_model_path()
    tasks = list(tasks or DEFAULT_TASKS)
    engine_kwargs = dict(engine_kwargs or {})
    runs = {b: evaluate(b, model, tasks, limit, dtype, engine_kwargs) for b in (backends or ("server", "llm", "hf"))}
    for scheme in schemes:
        runs[f"llm {dtype} {scheme}"] = evaluate("llm", model, tasks, limit, dtype,
                                                 engine_kwargs | {"quantization": scheme})
    for other in dtypes:
        runs[f"llm {other}"] = evaluate("llm", model, tasks, limit, other, engine_kwargs)
    result = {"bench": "lm_eval", "model": model, "dtype": dtype, "engine_kwargs": engine_kwargs, "tasks": tasks,
              "limit": limit, "commit": _commit(), "environment": common.environment("cpu"), "runs": runs}
    if "hf" in runs:
        result["disagreements_with_hf"] = {name: disagreements(r, runs["hf"]) for name, r in runs.items()
                                           if name != "hf"}
    first = runs[next(iter(runs))]["metrics"]
    metric = {t: next((k for k in first.get(t, {}) if k != "sample_len"), "-") for t in tasks}
    rows = [[name, *(r["metrics"].get(t, {}).get(metric[t]) for t in tasks), r["seconds"]] for name, r in runs.items()]
    print(common.markdown_table(["run", *(f"{t} {metric[t]}" for t in tasks), "seconds"], rows))
    if "disagreements_with_hf" in result:
        print("items answered differently from lm-eval's hf backend:", result["disagreements_with_hf"])
    common.write_json(output_json, result)
    return result
