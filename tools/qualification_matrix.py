"""The qualification matrix as pytest items: one item per (model, instance, engine, configuration).

    pytest --pyargs hybridqual.qualification_matrix --hq-model PATH [--hq-scenario NAME ...] \
        --hq-engine fastpath --hq-engine llamacpp@all [-n 16]

The models and instances are the plugin's `hq_case` (hybridqual.pytest_hq: --hq-model / --hq-scenario / --hq-trace),
the engines its `hq_engine` (--hq-engine NAME[@CONFIGURATION|@all]); an item passes when none of qualify's checks
FAILs (a case whose every check is a SKIP is a skipped item). Under pytest-xdist each worker keeps the truths it
loaded and runs its engines on cores // workers threads.
"""
from __future__ import annotations


def test_instance_qualifies(hq_verdict) -> None:
    """Every qualify check of this model, instance and engine passes or skips with its reason."""
    checks = hq_verdict()
    failed = [f"{c.name}: {c.detail}" for c in checks if c.status == "FAIL"]
    assert not failed, "\n".join(failed)
