"""vLLM behind hybridqual's adapter protocol. `adapter.py`: `--engine vllm`, vLLM's engine in-process,
stepped by the trace (engine.py builds it, schedule_facts.py records and checks its scheduler). `server.py`:
`--engine vllm-server`, a vLLM OpenAI server started by
qualify and judged through the `openai` adapter. Importing this package needs no vLLM (vLLM runs in .venv-vllm's
python)."""
