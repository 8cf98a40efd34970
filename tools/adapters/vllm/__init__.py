"""vLLM behind hybridqual's adapter protocol. `server.py`: `--engine vllm-server`, a vLLM OpenAI server started by
qualify and judged through the `openai` adapter. Importing this package needs no vLLM (vLLM runs in .venv-vllm's
python)."""
