"""vLLM behind hybridqual's adapter protocol. `adapter.py`: `--engine vllm`, vLLM's engine in-process,
stepped by the trace (engine.py builds it, schedule_facts.py records and checks its scheduler). `server.py`:
`--engine vllm-server`, a vLLM OpenAI server started by
qualify and judged through the `openai` adapter. Importing this package needs no vLLM (vLLM runs in .venv-vllm's
python)."""

# The shipped zoo models vLLM's CPU backend runs (attention head_dim >= 32, Nemotron-H's dense relu2 MLP): the default
# plan of the vllm engines (TraceAdapter.plan_models; docs/findings.md V2, V3 say why not the others).
VLLM_MODELS = ("zoo-granite_hd32", "zoo-nemotron_h_hd32", "zoo-mamba2")
