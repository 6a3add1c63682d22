"""lm-eval (EleutherAI's harness, pinned in the Makefile) as a client of graphinfer: `local-completions` against
`graphinfer serve` and lm-eval's Python API over graphinfer.LLM (graphinfer/bench/lm_eval_harness.py) choose the same
answer as lm-eval's own hf backend on every item of a shipped multiple-choice task (SmolLM2, fp32), and
`local-chat-completions` runs a shipped generation task to the end."""
import pytest

pytest.importorskip("lm_eval")
import lm_eval.tasks  # noqa: E402

from graphinfer.bench.lm_eval_harness import _free_port, _Server, disagreements, evaluate  # noqa: E402

TASK, LIMIT = "graphinfer_capitals", 16  # 16 questions x 4 choices: 64 loglikelihood requests per backend


class _GraphinferTasksOnly(lm_eval.tasks.TaskManager):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "include_defaults": False})


@pytest.fixture(scope="module", autouse=True)
def graphinfer_tasks_only():
    """evaluate()'s TaskManager indexes graphinfer's tasks and every task lm-eval ships (a walk over thousands of
    YAML files, seconds each of the three runs here); these tests run graphinfer's own tasks only, so lm-eval's are
    left out of the index."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lm_eval.tasks, "TaskManager", _GraphinferTasksOnly)
        yield


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    """One `graphinfer serve` (fp32) for the completions and the chat runs."""
    log = tmp_path_factory.mktemp("lm_eval") / "serve.log"
    s = _Server(smollm2_path, ["--dtype", "float32"], _free_port(), str(log))
    yield s
    s.close()


@pytest.fixture(scope="module")
def hf_run(smollm2_path):
    return evaluate("hf", smollm2_path, [TASK], limit=LIMIT)


@pytest.mark.parametrize("backend", ["server", pytest.param("llm", marks=pytest.mark.slow)])  # llm: ~18 s, same answers path
def test_multiple_choice_answers_equal_the_hf_backend(smollm2_path, hf_run, backend, request, tmp_path):
    served = request.getfixturevalue("server") if backend == "server" else None
    run = evaluate(backend, smollm2_path, [TASK], limit=LIMIT, work_dir=str(tmp_path), server=served)
    assert len(run["answers"][TASK]) == LIMIT
    assert disagreements(run, hf_run) == {TASK: 0}, (run["answers"], hf_run["answers"])
    assert run["metrics"][TASK]["acc,none"] == hf_run["metrics"][TASK]["acc,none"] > 0.5  # SmolLM2 knows capitals


def test_chat_completions_run_a_generation_task(smollm2_path, server, tmp_path):
    run = evaluate("chat", smollm2_path, ["graphinfer_arith_gen"], limit=4, work_dir=str(tmp_path), server=server)
    assert len(run["answers"]["graphinfer_arith_gen"]) == 4
    assert "exact_match,first_number" in run["metrics"]["graphinfer_arith_gen"]
