"""The HTTP side of the OpenAI-compatible server adapter: bounded JSON requests and the parsing of `/v1/models` and
`/v1/completions` answers into token ids, top-k logprobs and the server's cache / speculation counts.

Standard library only (urllib). Every failure is a `ServerError` whose message names what went wrong: the server
not reachable, a timeout, an HTTP error status, an answer that is not JSON or lacks a field (with its JSON path),
a wrong model. Nothing here retries or waits without a bound.

Answer forms understood (the adapter depends on no single server's extension):
- token ids: `choices[0].token_ids` (vLLM `return_token_ids`), llama-server's `choices[0].logprobs.content[i].id`,
  or OpenAI-form `choices[0].logprobs.tokens` entries "token_id:N" (vLLM `--return-tokens-as-token-ids`);
- top-k logprobs: llama-server's `logprobs.content[i].top_logprobs` ([{"id", "logprob"}]) or OpenAI-form
  `logprobs.top_logprobs[i]` ({"token_id:N": logprob}); OpenAI-form entries keyed by text cannot be mapped to ids
  and give no logprobs (the logprobs line then SKIPs, naming that);
- cached prompt tokens: `usage.prompt_tokens_details.cached_tokens` (vLLM, SGLang, llama-server), else
  llama-server's `timings.cache_n`;
- speculation: llama-server's `timings.draft_n` / `timings.draft_n_accepted` (only present when it drafted).
"""
from __future__ import annotations

import json
import math
import os
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

UNDERFLOW_LOGPROB = -80.0     # below this a float32 softmax has lost its precision (llama-server writes p = 0 as
                              # -3.4e38): such entries are treated as "not returned" by the logprobs rule


class ServerError(RuntimeError):
    """A server problem, named: unreachable, timeout, HTTP status, malformed answer (with the field), wrong model."""


def request_json(url: str, body: dict | None = None, timeout: float = 60.0) -> Any:
    """GET (body None) or POST `body` as JSON to `url`; the decoded answer. Bounded by `timeout` per socket
    operation (connect, each read). $OPENAI_API_KEY, when set, is sent as a bearer token."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    key = os.environ.get("OPENAI_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        try:
            text = e.read().decode(errors="replace")[:400]
        except Exception:  # noqa: BLE001
            text = ""
        raise ServerError(f"{url}: HTTP {e.code} {e.reason}: {text.strip()}") from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, (socket.timeout, TimeoutError)):
            raise ServerError(f"{url}: timed out after {timeout:g} s (no answer)") from None
        raise ServerError(f"{url}: server not reachable ({e.reason})") from None
    except (socket.timeout, TimeoutError):
        raise ServerError(f"{url}: timed out after {timeout:g} s (no complete answer)") from None
    except (ConnectionError, OSError) as e:
        raise ServerError(f"{url}: connection failed ({type(e).__name__}: {e})") from None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ServerError(f"{url}: malformed answer, not JSON ({e}; starts {raw[:80]!r})") from None


def _get(obj: Any, path: str, kind: type | tuple, where: str) -> Any:
    """obj[path] (dotted, [i] for lists) of type `kind`, else a ServerError naming the JSON path."""
    cur = obj
    at = where
    for part in path.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
            at += f".{part}"
        else:
            raise ServerError(f"malformed answer: {at}.{part} missing")
    if not isinstance(cur, kind) or isinstance(cur, bool) and kind is not bool:
        raise ServerError(f"malformed answer: {at}: expected {getattr(kind, '__name__', kind)}, got "
                          f"{type(cur).__name__}")
    return cur


def _int(v: Any, at: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ServerError(f"malformed answer: {at}: expected an integer token id, got {v!r}")
    return v


def _num(v: Any, at: str) -> float:
    """A logprob: a finite number (NaN and ±inf are refused, naming the field)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ServerError(f"malformed answer: {at}: expected a number, got {v!r}")
    if not math.isfinite(v):
        raise ServerError(f"malformed answer: {at}: the logprob {v!r} is not finite")
    return float(v)


def _token_key(key: str) -> int | None:
    """'token_id:123' -> 123 (vLLM --return-tokens-as-token-ids); None for a text key."""
    if isinstance(key, str) and key.startswith("token_id:"):
        try:
            return int(key[len("token_id:"):])
        except ValueError:
            return None
    return None


@dataclass
class ModelInfo:
    """What /v1/models says: the served ids (with aliases) and, where the server reports them, the vocabulary size
    (llama-server meta.n_vocab), the weights it loaded (vLLM root) and its context bound (vLLM max_model_len)."""
    ids: list[str]                 # every name a request may use (ids and aliases)
    entries: list[str] = field(default_factory=list)      # one id per served model
    n_vocab: dict[str, int] = field(default_factory=dict)
    root: dict[str, str] = field(default_factory=dict)
    max_model_len: dict[str, int] = field(default_factory=dict)


def parse_models(obj: Any, where: str = "/v1/models") -> ModelInfo:
    data = _get(obj, "data", list, where) if isinstance(obj, dict) else None
    if data is None:
        raise ServerError(f"malformed answer: {where}: expected an object with 'data'")
    info = ModelInfo([])
    for i, m in enumerate(data):
        mid = _get(m, "id", str, f"{where}.data[{i}]")
        names = [mid] + [a for a in (m.get("aliases") or []) if isinstance(a, str)]
        info.ids += names
        info.entries.append(mid)
        nv = (m.get("meta") or {}).get("n_vocab") if isinstance(m.get("meta"), dict) else None
        root, mml = m.get("root"), m.get("max_model_len")
        for n in names:
            if isinstance(nv, int) and not isinstance(nv, bool):
                info.n_vocab[n] = nv
            if isinstance(root, str) and root:
                info.root[n] = root
            if isinstance(mml, int) and not isinstance(mml, bool):
                info.max_model_len[n] = mml
    return info


@dataclass
class Completion:
    """One /v1/completions answer, parsed."""
    tokens: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None      # per generated position: {token id: logprob} as returned
    sampled_logprob: list[float | None] | None   # the sampled token's logprob per position, where given
    logprobs_note: str = ""                      # why logprobs is None, when it is
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cached_source: str = ""
    draft_n: int | None = None
    draft_n_accepted: int | None = None
    token_field: str = "token ids[{i}]"          # the JSON path of token i (a format string, for error messages)
    logprobs_field: str = "logprobs[{i}]"        # the JSON path of position i's top-k row (a format string)


@dataclass
class _ParsedLogprobs:
    """A completion choice's tokens and logprobs as parsed from one answer form: token ids, top-k rows and sampled
    logprobs per position (None when not given), and why the rows are None."""
    tokens: list[int] | None
    rows: list[dict[int, float]] | None
    sampled: list[float | None] | None
    note: str = ""


def _the_choice(obj: Any, where: str) -> dict:
    """The answer's one choice; ServerError for an error answer or a malformed one."""
    if not isinstance(obj, dict):
        raise ServerError(f"malformed answer: {where}: expected a JSON object, got {type(obj).__name__}")
    if "error" in obj and "choices" not in obj:
        raise ServerError(f"{where}: the server answered an error: {json.dumps(obj['error'])[:300]}")
    choices = _get(obj, "choices", list, where)
    if len(choices) != 1:
        raise ServerError(f"malformed answer: {where}.choices: expected 1 choice, got {len(choices)}")
    ch = choices[0]
    if not isinstance(ch, dict):
        raise ServerError(f"malformed answer: {where}.choices[0]: expected an object")
    return ch


def _llama_logprobs(content: list, at: str, tokens: list[int] | None) -> _ParsedLogprobs:
    """llama-server's form (logprobs.content: id, logprob, top_logprobs per position); its ids must equal token_ids
    when both are given."""
    ids, rows, sampled = [], [], []
    for i, e in enumerate(content):
        ea = f"{at}.logprobs.content[{i}]"
        if not isinstance(e, dict):
            raise ServerError(f"malformed answer: {ea}: expected an object")
        ids.append(_int(e.get("id"), f"{ea}.id"))
        sampled.append(_num(e["logprob"], f"{ea}.logprob") if "logprob" in e else None)
        top = e.get("top_logprobs")
        if not isinstance(top, list):
            raise ServerError(f"malformed answer: {ea}.top_logprobs: expected a list")
        row = {}
        for j, t in enumerate(top):
            ta = f"{ea}.top_logprobs[{j}]"
            if not isinstance(t, dict):
                raise ServerError(f"malformed answer: {ta}: expected an object")
            row[_int(t.get("id"), f"{ta}.id")] = _num(t.get("logprob"), f"{ta}.logprob")
        rows.append(row)
    if tokens is None:
        tokens = ids
    elif tokens != ids:
        raise ServerError(f"malformed answer: {at}.token_ids {tokens} differ from the logprobs' ids {ids}")
    return _ParsedLogprobs(tokens, rows, sampled)


def _openai_row(d: Any, ta: str) -> dict[int, float] | None:
    """One top_logprobs entry of OpenAI's form keyed by token id ('token_id:N'), or None when keyed by text."""
    if not isinstance(d, dict):
        raise ServerError(f"malformed answer: {ta}: expected an object")
    row = {}
    for k, v in d.items():
        tid = _token_key(k)
        if tid is None:
            return None
        row[tid] = _num(v, f"{ta}[{k!r}]")
    return row


def _openai_logprobs(lp: dict, at: str, tokens: list[int] | None) -> _ParsedLogprobs:
    """OpenAI's completions form (logprobs.tokens, top_logprobs, token_logprobs); the tokens from token_ids or from
    'token_id:N' names; rows None (with the reason) when the top_logprobs name tokens by text."""
    keyed = [_token_key(s) for s in lp["tokens"]]
    if tokens is None:
        if any(k is None for k in keyed):
            raise ServerError(f"malformed answer: {at}: no token ids (no choices[0].token_ids, and "
                              "logprobs.tokens are text, not 'token_id:N'; vLLM: --return-tokens-as-token-ids "
                              "or return_token_ids)")
        tokens = keyed
    top = lp.get("top_logprobs")
    tlp = lp.get("token_logprobs")
    if not isinstance(top, list) or len(top) != len(tokens):
        raise ServerError(f"malformed answer: {at}.logprobs.top_logprobs: expected one entry per token "
                          f"({len(tokens)}), got {type(top).__name__}"
                          + (f" of {len(top)}" if isinstance(top, list) else ""))
    rows, sampled = [], []
    for i, d in enumerate(top):
        row = _openai_row(d, f"{at}.logprobs.top_logprobs[{i}]")
        if row is None:
            return _ParsedLogprobs(tokens, None, None, "the server's top_logprobs name tokens by text, not id "
                                                       "(vLLM: --return-tokens-as-token-ids)")
        rows.append(row)
        sampled.append(_num(tlp[i], f"{at}.logprobs.token_logprobs[{i}]")
                       if isinstance(tlp, list) and i < len(tlp) and tlp[i] is not None else None)
    return _ParsedLogprobs(tokens, rows, sampled)


def parse_completion(obj: Any, where: str = "/v1/completions") -> Completion:
    """Token ids, logprobs and counts of a non-streamed completion answer; ServerError naming the path if malformed."""
    ch = _the_choice(obj, where)
    at = f"{where}.choices[0]"
    lp = ch.get("logprobs")
    tokens: list[int] | None = None
    if ch.get("token_ids") is not None:
        ids = ch["token_ids"]
        if not isinstance(ids, list):
            raise ServerError(f"malformed answer: {at}.token_ids: expected a list")
        tokens = [_int(t, f"{at}.token_ids[{i}]") for i, t in enumerate(ids)]
    llama = isinstance(lp, dict) and isinstance(lp.get("content"), list)
    if llama:                                                                   # llama-server's form
        p = _llama_logprobs(lp["content"], at, tokens)
    elif isinstance(lp, dict) and isinstance(lp.get("tokens"), list):         # OpenAI's completions form
        p = _openai_logprobs(lp, at, tokens)
    else:
        if tokens is None:
            raise ServerError(f"malformed answer: {at}: no token ids (neither token_ids nor logprobs with ids)")
        p = _ParsedLogprobs(tokens, None, None, "the answer carries no logprobs")
    if p.rows is not None and len(p.rows) != len(p.tokens):
        raise ServerError(f"malformed answer: {at}: {len(p.rows)} logprobs entries for {len(p.tokens)} tokens")
    fr = ch.get("finish_reason")
    c = Completion(p.tokens, fr if isinstance(fr, str) else None, p.rows, p.sampled, p.note)
    c.token_field = (at + ".token_ids[{i}]" if ch.get("token_ids") is not None else
                     at + ".logprobs.content[{i}].id" if llama else at + ".logprobs.tokens[{i}]")
    c.logprobs_field = at + (".logprobs.content[{i}].top_logprobs" if llama else ".logprobs.top_logprobs[{i}]")
    _counts(obj, c, where)
    return c


def _count(d: Any, key: str, at: str) -> int | None:
    """d[key] as a count: None when absent or null, else an integer, or a ServerError naming the field."""
    if not isinstance(d, dict) or d.get(key) is None:
        return None
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ServerError(f"malformed answer: {at}.{key}: expected an integer count, got {v!r}")
    return v


def _counts(obj: dict, c: Completion, where: str) -> None:
    """The answer's usage / timings counts into `c` (prompt, completion, cached, draft), each an integer if given."""
    usage = obj.get("usage")
    if usage is not None and not isinstance(usage, dict):
        raise ServerError(f"malformed answer: {where}.usage: expected an object, got {type(usage).__name__}")
    timings = obj.get("timings") if isinstance(obj.get("timings"), dict) else {}
    c.prompt_tokens = _count(usage, "prompt_tokens", f"{where}.usage")
    c.completion_tokens = _count(usage, "completion_tokens", f"{where}.usage")
    details = (usage or {}).get("prompt_tokens_details")
    cached = _count(details, "cached_tokens", f"{where}.usage.prompt_tokens_details")
    if cached is not None:
        c.cached_tokens, c.cached_source = cached, "usage.prompt_tokens_details.cached_tokens"
    elif _count(timings, "cache_n", f"{where}.timings") is not None:
        c.cached_tokens, c.cached_source = timings["cache_n"], "timings.cache_n"
    c.draft_n = _count(timings, "draft_n", f"{where}.timings")
    if c.draft_n is not None:
        c.draft_n_accepted = _count(timings, "draft_n_accepted", f"{where}.timings")


def check_answer(c: Completion, prompt_len: int, max_tokens: int, vocab: int, where: str) -> None:
    """Every field of a parsed answer in range, as an in-process result's would be (whether or not logprobs came):
    token ids and logprob ids in the model's vocabulary, at most max_tokens tokens, the server's counts consistent
    with what was sent and returned (cached tokens within the prompt, accepted drafts within the drafted); a
    ServerError naming the field otherwise. (Logprobs are checked finite while parsing.)"""
    for i, t in enumerate(c.tokens):
        if not 0 <= t < vocab:
            raise ServerError(f"wrong model: {where}: {c.token_field.format(i=i)} = {t}, outside the model's "
                              f"vocabulary of {vocab}")
    if len(c.tokens) > max_tokens:
        raise ServerError(f"malformed answer: {where}: {len(c.tokens)} tokens for max_tokens {max_tokens}")
    for p, row in enumerate(c.logprobs or []):
        bad = [i for i in row if not 0 <= i < vocab]
        if bad:
            raise ServerError(f"wrong model: {where}: {c.logprobs_field.format(i=p)} has token id {bad[0]}, outside "
                              f"the model's vocabulary of {vocab}")
    if c.prompt_tokens is not None and c.prompt_tokens != prompt_len:
        raise ServerError(f"malformed answer: {where}: usage.prompt_tokens {c.prompt_tokens} for the {prompt_len} "
                          "prompt tokens sent (a token added, e.g. BOS, changes the model's input)")
    if c.completion_tokens is not None and c.completion_tokens != len(c.tokens):
        raise ServerError(f"malformed answer: {where}: usage.completion_tokens {c.completion_tokens} for the "
                          f"{len(c.tokens)} tokens returned")
    if c.cached_tokens is not None and not 0 <= c.cached_tokens <= prompt_len:
        raise ServerError(f"malformed answer: {where}: {c.cached_source} {c.cached_tokens} outside the prompt "
                          f"(0..{prompt_len})")
    if c.draft_n is not None and not (c.draft_n >= 0 and 0 <= (c.draft_n_accepted or 0) <= c.draft_n):
        raise ServerError(f"malformed answer: {where}: timings.draft_n_accepted {c.draft_n_accepted} outside "
                          f"0..timings.draft_n {c.draft_n}")
