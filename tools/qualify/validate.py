"""The adapter boundary: every RunResult is checked here before any check reads it (docs/api.md, "What qualify
checks of an adapter's result").

    run, problems = validate_result(trace, result, vocab_size)     # problems: [] or "request 'r1' tokens[3]: ..."

What is checked, per request of the trace (and nothing else is accepted):
- `tokens`: a dict with exactly the trace's request ids (an extra or a missing id is named); each value a list (or
  tuple, or a 1-D integer tensor / array) of token ids, each a Python / NumPy int or a 0-d integer tensor (a bool
  or a float is refused, never truncated), in [0, vocab);
- the finish rule (docs/api.md, "Result"): at least one token, at most max_new_tokens, no stop token before the last
  position, and shorter than max_new_tokens only when the last token is a stop token;
- `finish_reasons` (optional; when given, for exactly the trace's ids): "stop" iff the last token is a stop token,
  else "length" (then the output has exactly max_new_tokens tokens);
- `logits` (optional): a dict over the trace's ids of finite float tensors of shape [len(tokens), vocab];
- `streamed` (optional; when given, for exactly the trace's ids): what a streaming client received, equal to
  `tokens` (a token appended to the output but not delivered, or delivered twice, is named);
- `digest` None or a string, `schedule_facts` None or a list.
The result handed on is normalised (plain Python int lists); the problems name the request and the field, with
adapter-supplied names printed by ascii() so a hostile id cannot write control characters to a console.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import torch

MAX_PROBLEMS = 12          # named in a FAIL line; the rest counted


def _show(x, width: int = 60) -> str:
    s = ascii(x)
    return s if len(s) <= width else s[:width] + "..."


def _int_token(t) -> int | None:
    """t as a token id, or None when it is not an integer (bool and float are not)."""
    if isinstance(t, torch.Tensor):
        if t.dim() == 0 and not (t.dtype == torch.bool or t.is_floating_point() or t.is_complex()):
            return int(t)
        return None
    if isinstance(t, bool) or type(t).__name__ == "bool_" or not isinstance(t, numbers.Integral):
        return None
    return int(t)


def _token_list(v, where: str, vocab: int, bad: list[str]) -> list[int] | None:
    if isinstance(v, torch.Tensor) or type(v).__name__ == "ndarray":
        if getattr(v, "ndim", None) != 1:
            bad.append(f"{where}: must be a flat list of token ids, got an array of shape {tuple(v.shape)}")
            return None
        v = list(v)
    if not isinstance(v, (list, tuple)):
        bad.append(f"{where}: must be a list of token ids, got {type(v).__name__}")
        return None
    out = []
    for j, t in enumerate(v):
        i = _int_token(t)
        if i is None:
            bad.append(f"{where}[{j}]: token ids must be ints, got {type(t).__name__} {_show(t, 30)}")
            return None
        if not 0 <= i < vocab:
            bad.append(f"{where}[{j}]: token id {i} outside [0, vocab {vocab})")
            return None
        out.append(i)
    return out


def _ids(d, name: str, want: list[str], bad: list[str], required: bool) -> bool:
    """d is a dict keyed by exactly the trace's request ids (missing ids allowed when not `required`)."""
    if not isinstance(d, dict):
        bad.append(f"RunResult.{name}: must be a dict of request id -> ..., got {type(d).__name__}")
        return False
    wanted = set(want)
    extra = [k for k in d if k not in wanted]
    for k in extra[:MAX_PROBLEMS]:
        bad.append(f"RunResult.{name}: request id {_show(k)} is not in the trace")
    missing = [r for r in want if r not in d] if required else []
    for r in missing[:MAX_PROBLEMS]:
        bad.append(f"RunResult.{name}: request {r!r} of the trace is missing")
    return not extra and not missing


def finish_problem(toks: list[int], req, reason=None) -> str | None:
    """Why `toks` (and the adapter's finish reason, if given) break the finish rule, or None."""
    stops = set(req.stop_token_ids)
    if not toks:
        return "tokens: empty (every request generates at least one token before it stops)"
    early = next((j for j, t in enumerate(toks[:-1]) if t in stops), None)
    if early is not None:
        return f"tokens[{early + 1}]: a token after the stop token {toks[early]} at position {early}"
    if len(toks) > req.max_new_tokens:
        return f"tokens: {len(toks)} tokens, more than max_new_tokens {req.max_new_tokens}"
    stopped = toks[-1] in stops
    if not stopped and len(toks) < req.max_new_tokens:
        return (f"tokens: ends after {len(toks)} of max_new_tokens {req.max_new_tokens} tokens without a stop token "
                f"(last token {toks[-1]}; stop ids {sorted(stops)})")
    if reason is not None:
        want = "stop" if stopped else "length"
        if reason not in ("stop", "length"):
            return f"finish_reasons: {_show(reason)} is neither 'stop' nor 'length'"
        if reason != want:
            why = (f"ends on the stop token {toks[-1]}" if stopped else
                   f"has max_new_tokens = {len(toks)} tokens and no stop token")
            return f"finish_reasons: {reason!r}, but the output {why} (so {want!r})"
    return None


def validate_result(trace, result, vocab_size: int) -> tuple[object, list[str]]:
    """(the result normalised, [problems]); when there are problems the result must not be judged further."""
    from hybridqual.adapters.base import RunResult
    if not isinstance(result, RunResult):
        return result, [f"run_trace returned {type(result).__name__} {_show(result, 40)}, not a "
                        "hybridqual.adapters.RunResult"]
    bad: list[str] = []
    want = [r.id for r in trace.requests]
    tokens: dict[str, list[int]] = {}
    _ids(result.tokens, "tokens", want, bad, required=True)
    if isinstance(result.tokens, dict):
        for req in trace.requests:
            if req.id in result.tokens:
                got = _token_list(result.tokens[req.id], f"request {req.id!r} tokens", vocab_size, bad)
                if got is not None:
                    tokens[req.id] = got
    reasons = result.finish_reasons if result.finish_reasons is not None else {}
    if reasons != {} and not _ids(reasons, "finish_reasons", want, bad, required=True):
        reasons = {}
    for req in trace.requests:
        if req.id in tokens:
            why = finish_problem(tokens[req.id], req, reasons.get(req.id))
            if why:
                bad.append(f"request {req.id!r} {why}")
    logits = result.logits
    if logits is not None and _ids(logits, "logits", want, bad, required=False):
        for req in trace.requests:
            t = logits.get(req.id)
            if t is None or req.id not in tokens:
                continue
            where = f"request {req.id!r} logits"
            shape = (len(tokens[req.id]), vocab_size)
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                bad.append(f"{where}: must be a float tensor, got {type(t).__name__} {getattr(t, 'dtype', '')}")
            elif tuple(t.shape) != shape:
                bad.append(f"{where}: shape {tuple(t.shape)}, expected [len(tokens), vocab] = {list(shape)}")
            elif not bool(torch.isfinite(t).all()):
                row = int((~torch.isfinite(t)).any(dim=-1).nonzero()[0])
                bad.append(f"{where}[{row}]: not finite (NaN or inf)")
    if result.streamed is not None:
        _streamed_problems(result.streamed, tokens, trace, want, vocab_size, bad)
    if result.digest is not None and not isinstance(result.digest, str):
        bad.append(f"RunResult.digest: must be a string or None, got {type(result.digest).__name__}")
    if result.schedule_facts is not None and not isinstance(result.schedule_facts, list):
        bad.append(f"RunResult.schedule_facts: must be a list or None, got {type(result.schedule_facts).__name__}")
    if bad:
        return result, bad
    clean = dataclasses.replace(result, tokens={r: tokens[r] for r in want},
                                finish_reasons=dict(reasons) if reasons else {})
    return clean, []


def _streamed_problems(streamed, tokens: dict[str, list[int]], trace, want: list[str], vocab_size: int,
                       bad: list[str]) -> None:
    """The streamed tokens must be the output, request by request (the first difference named)."""
    if not _ids(streamed, "streamed", want, bad, required=True):
        return
    for req in trace.requests:
        got = _token_list(streamed[req.id], f"request {req.id!r} streamed", vocab_size, bad)
        out = tokens.get(req.id)
        if got is None or out is None or got == out:
            continue
        i = next((j for j, (a, b) in enumerate(zip(got, out)) if a != b), min(len(got), len(out)))
        bad.append(f"request {req.id!r} streamed: {len(got)} tokens delivered, the output has {len(out)}; first "
                   f"difference at [{i}]: streamed {got[i] if i < len(got) else 'nothing'}, output "
                   f"{out[i] if i < len(out) else 'nothing'}")


def describe(problems: list[str]) -> str:
    """The problems as one FAIL detail: the first MAX_PROBLEMS named, the rest counted."""
    shown = problems[:MAX_PROBLEMS]
    more = len(problems) - len(shown)
    return "; ".join(shown) + (f"; and {more} more" if more else "")


def finite_nonneg(x) -> bool:
    """A finite number >= 0 (for --tau and friends)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
