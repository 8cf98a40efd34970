"""Where an instance's truth comes from (DESIGN §15): the shipped golden for (model sha256, trace sha256) when it
passes its checks, else the oracle's record computed now, else (streamed oracle) the engine's own tokens scored.

    truth = truth_for(model_dir, instance, oracle_model)     # a hybridqual.qualify.truth.Truth; .source says which
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from hybridqual.goldens import regen as goldens
from hybridqual.qualify.truth import Truth, is_streamed


@lru_cache(maxsize=None)
def _model_sha(model_dir: str) -> str:
    return goldens.model_sha256(Path(model_dir))


def _shipped_golden(model_dir: Path, inst, oracle_model) -> tuple[dict | None, str, str | None]:
    """(the shipped golden when its model and trace sha256 match and it passes its checks, else None; why not;
    why it was rejected, when it failed its schema or content hash)."""
    path = goldens.OUTPUTS / model_dir.name / f"{inst.scenario}.json"
    why, rejected = "no shipped golden for this model and scenario", None
    if not (path.exists() and getattr(oracle_model, "use_goldens", True)):
        return None, why, None
    try:
        g = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        g, why = None, f"shipped golden {path.name} unreadable ({e})"
    problems = goldens.check_golden(g) if g is not None else []
    if not problems and g is not None and g["model_sha256"] == _model_sha(str(model_dir)) and \
            g["trace_sha256"] == goldens.trace_sha256(inst.trace):     # its requests, against this very trace
        problems = goldens.check_golden(g, inst.trace, oracle_model.config.vocab_size)
    if problems:        # a golden that breaks its schema or its own hash is never the truth: said, recomputed
        g, why = None, (f"shipped golden {path.name} rejected ({'; '.join(problems[:3])}"
                        f"{'; ...' if len(problems) > 3 else ''})")
        rejected = why
    if g is not None:
        if g.get("model_sha256") != _model_sha(str(model_dir)):
            return None, f"shipped golden {path.name} is for other model weights (model sha256 differs)", rejected
        if g.get("trace_sha256") != goldens.trace_sha256(inst.trace):
            return None, f"shipped golden {path.name} is for another trace (trace sha256 differs)", rejected
        g["source"] = f"golden {path.name} (model and trace sha256 match)"
    return g, why, rejected


def truth_for(model_dir: Path, inst, oracle_model) -> Truth:
    """The shipped golden for (model sha256, trace sha256) when both match and it passes its schema and content
    hash (hybridqual.goldens.record.check_golden), else the oracle's record computed now; `source` says which, and
    why a shipped golden was not used (`golden_rejected`: a golden that failed its checks, shown on the console)."""
    g, why, rejected = _shipped_golden(model_dir, inst, oracle_model)
    if g is not None:
        return Truth.from_golden(g, g["source"])
    if is_streamed(oracle_model):       # no generation: the engine's own tokens are scored (qualify_truth)
        return Truth(f"streamed fp64 oracle ({oracle_model.why}): the engine's tokens scored teacher-forced, the "
                     "schedule replayed with them" + (f" ({rejected})" if rejected else ""), streamed=True,
                     golden_rejected=rejected)
    g = goldens.golden_for_trace(oracle_model, model_dir, inst.trace, inst.scenario)
    return Truth.from_golden(g, f"oracle fp64, computed now: {why}", rejected)
