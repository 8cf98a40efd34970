"""Any OpenAI-compatible server (llama-server, vLLM, SGLang, TRT-LLM) behind hybridqual's adapter protocol:
`--engine openai --base-url URL [--served-model NAME]` (adapter.py: arrivals as wall-clock-scheduled concurrent
/v1/completions requests; client.py: bounded HTTP and answer parsing; logprobs.py: the logits check on top-k
logprobs; report.py: its qualify line). Standard library only; nothing here starts a server.
"""
from __future__ import annotations

from hybridqual.adapters.openai.adapter import OpenAIServerAdapter, ServerRunResult
from hybridqual.adapters.openai.client import ServerError

__all__ = ["OpenAIServerAdapter", "ServerRunResult", "ServerError"]
