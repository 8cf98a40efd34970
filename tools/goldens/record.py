"""A golden's identity: its schema name and the hashes that tie it to one model folder and one trace."""
from __future__ import annotations

import hashlib
from pathlib import Path

SCHEMA = "hybridqual.golden/1"
MARGIN_DECIMALS = 4


def sha256_file(path: Path) -> str:
    """sha256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def model_sha256(folder: Path) -> str:
    """sha256 over config.json and every *.safetensors file of a model folder, in name order."""
    h = hashlib.sha256()
    for p in sorted([folder / "config.json", *folder.glob("*.safetensors")]):
        h.update(p.name.encode()); h.update(sha256_file(p).encode())
    return h.hexdigest()


def trace_sha256(trace) -> str:
    """sha256 of the canonical dump of a Trace: what a golden's "trace_sha256" is."""
    from oracle.trace import dump_trace
    return hashlib.sha256(dump_trace(trace).encode()).hexdigest()
