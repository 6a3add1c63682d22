"""`graphinfer serve ART_OR_MODEL`: start the engine (from an artifact, or compiling the model in memory)
and serve the OpenAI-compatible API with uvicorn. SIGTERM / Ctrl-C shut down cleanly."""
import os

import uvicorn

from graphinfer.server.api_server import build_app
from graphinfer.server.async_engine import AsyncLLMEngine


def is_artifact(path: str) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, "manifest.json"))


def serve(target: str, host: str, port: int, api_key: str | None, served_model_name: str | None,
          max_waiting_requests: int, **engine_args) -> None:
    from graphinfer import LLM

    llm = LLM(artifact=target, **engine_args) if is_artifact(target) else LLM(target, **engine_args)
    engine = llm.llm_engine
    name = served_model_name or os.path.splitext(os.path.basename(engine.config.model_config.model.rstrip("/")))[0]
    app = build_app(AsyncLLMEngine(engine, max_waiting_requests), name, api_key)
    base = f"http://{host}:{port}/v1"
    auth = f' -H "Authorization: Bearer {api_key}"' if api_key else ""
    print(f"""
graphinfer is serving {name!r} at {base}
  curl {base}/chat/completions{auth} -H "Content-Type: application/json" \\
    -d '{{"model": "{name}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'
  python -c "from openai import OpenAI; c = OpenAI(base_url='{base}', api_key='{api_key or 'EMPTY'}'); \\
print(c.completions.create(model='{name}', prompt='The capital of France is', max_tokens=16).choices[0].text)"
""", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
