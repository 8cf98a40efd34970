"""bs1 speculative decoding benchmark (DESIGN §8, §13), called by `tools/bench/engine.py --spec`, or on its own:

    python -m hybridqual.bench.spec --smoke          # CPU, tiny zoo model, torch stand-ins, seconds: every row's code path
    TRITON_INTERPRET=1 python -m hybridqual.bench.spec --smoke --triton     # the same through the Triton kernels (minutes)

In one run, same model and mode: bs1 effective tok/s without speculation, then for each k
  - ngram on a code-like repetitive prompt (the real proposer; random weights do not continue the prompt's n-grams,
    so its acceptance is whatever the model does: measured, not assumed);
  - upper bound: a scripted proposer fed the run's own greedy continuation (the non-speculative run's tokens, refined
    by up to 4 untimed runs where verify arithmetic flipped a near tie), so every draft is right by construction:
    what the mechanism gives when drafts are right — NOT a proposer anyone can run;
  - draft: the target's first `draft_layers` layers (same vocab, embeddings and head) as a draft model, on a fixed
    `draft_osl` tokens, skipped once `draft_budget_s` of draft runs is spent (it cannot eat the call); three rows:
    the engine's default (short catch-ups through the draft's decode graphs), every catch-up as a packed prefill
    (the reference), and drafts kept on the device (FastOptions.spec_device_drafts);
  - last draft wrong, under each rollback (per-position snapshots; replay, FastOptions.spec_replay): the upper
    bound's drafts with the last one wrong, so every step accepts m-1 drafts and rolls back.
Rows after `budget_s` are skipped (printed as such), so the whole bench stays inside one GPU call.
Per row: acceptance (accepted / proposed drafts, from the schedule log), tok/s and its ratio to the
non-speculative figure of the same run, the mean verify-step time (one synchronised launch: forward + sampling +
host acceptance) plus the rollback (snapshot copies) against k+1 one-token decode steps of the baseline (CUDA-graph
replays when graphs are on); draft rows also: where the draft proposer's time goes (its pass per step, synchronised
before and after, by phase: catch-up by graphs or prefill, drafting steps, snapshot restore; its share of the step).
`--spec-rows` (tools/bench/engine.py) picks the row groups: ngram, upper_bound, draft, last_wrong.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time

import torch

from fastpath.engine.engine import Engine
from oracle.speculative import ProposerConfig, SpecConfig
from oracle.trace import EngineConfig, Request
from hybridqual.bench import arguments
from hybridqual.qualify.spec_checks import acceptance_rate


def code_like_prompt(n: int, vocab: int) -> tuple[int, ...]:
    """A repetitive 'code' stream: a 24-token line repeated with one changing token (an indentation/ident id)."""
    line = [(97 * j + 13) % vocab for j in range(24)]
    out: list[int] = []
    i = 0
    while len(out) < n:
        out += line[:5] + [(1000 + i) % vocab] + line[6:]
        i += 1
    return tuple(out[:n])


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, dev, into: dict, key, fence: bool = False):
    """Wrap fn: the wall time of each call (device synchronised after it; fence: before it too) goes to
    into[key(args)]."""
    def run(*args, **kw):
        if fence:
            _sync(dev)
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        _sync(dev)
        into.setdefault(key(*args), []).append(time.perf_counter() - t0)
        return out
    return run


def _step_kind(batch, *_) -> str:
    if any(b.kind == "verify" for b in batch):
        return "verify"
    return "decode" if all(b.kind == "decode" for b in batch) else "prefill"


@dataclasses.dataclass
class _TimedRequests:
    """spec_run's timed requests: tok/s of each (the warm-up one left out), drafts accepted and proposed, and the
    last request's tokens."""
    rates: list[float]
    accepted: int
    proposed: int
    tokens: list[int]


@dataclasses.dataclass
class _SynchronisedPass:
    """spec_run's pass with a sync after every launch: wall times by step kind ('verify', 'decode', 'prefill',
    'rollback', 'draft') and, for a draft proposer, its profile (draft_profile)."""
    times: dict
    draft_profile: dict | None


def _spec_engine(model, spec: SpecConfig | None, mode: str, graphs: bool, osl: int, prompt: tuple[int, ...],
                 eager_catch_up: bool) -> Engine:
    """A bs1 engine for spec_run with its verify graphs (and a draft's graphs) captured before any timed request."""
    C, k = model.config.chunk_size, spec.k if spec else 0
    B = max(C, len(prompt), k + 1)
    eng = Engine(model, EngineConfig(1, B, B, mode, spec), max_len=len(prompt) + osl + 8, graphs=graphs)
    draft = eng.spec.draft if eng.spec is not None else None
    if draft is not None:
        draft.short_catch_up = not eager_catch_up
    if eng.spec is not None:
        eng.spec.runner.capture_all()
    if draft is not None:
        draft.capture_all()
    return eng


def _refine_own(eng: Engine, mode: str, prompt: tuple[int, ...], osl: int, own: list[int] | None, script,
                passes: int, force: bool, table: dict) -> int:
    """Untimed runs until the scripted drafts are the speculative run's own greedy tokens (at most `passes`); the
    number of refinements."""
    refined = 0
    while own is not None and refined < passes:
        eng.reset(mode)
        eng.add_request(Request("q0", 0, prompt, osl))
        out = eng.run().tokens["q0"]
        if out == own:
            break
        own, refined = out, refined + 1
        if force:
            table.clear()
            table.update(script(own).proposer.table())
        else:
            eng.spec.use_trace(script(own))
    return refined


def _timed_requests(eng: Engine, mode: str, prompt: tuple[int, ...], osl: int, n_req: int) -> _TimedRequests:
    """n_req requests one at a time, no per-step syncs; the first is warm-up unless it is the only one."""
    rates, acc, prop, tokens = [], 0, 0, []
    dev = eng.model.device
    for i in range(n_req):
        eng.reset(mode)
        eng.add_request(Request(f"q{i}", 0, prompt, osl))
        eng.step()
        _sync(dev)
        t0 = time.perf_counter()
        while eng.step():
            pass
        _sync(dev)
        dt = time.perf_counter() - t0
        tokens = list(eng.requests[f"q{i}"].output)
        if i > 0 or n_req == 1:
            rates.append((len(tokens) - 1) / dt)
            a, p = acceptance_rate(eng.log)
            acc, prop = acc + a, prop + p
    return _TimedRequests(rates, acc, prop, tokens)


def _synchronised_pass(eng: Engine, mode: str, prompt: tuple[int, ...], osl: int) -> _SynchronisedPass:
    """One more request with a sync after every launch (and around a draft proposer's pass): step times by kind."""
    dev = eng.model.device
    draft = eng.spec.draft if eng.spec is not None else None
    times: dict = {}
    eng.launch = _timed(eng.launch, dev, times, _step_kind)
    if eng.spec is not None:
        eng.spec.rollback = _timed(eng.spec.rollback, dev, times, lambda *_: "rollback")
    if draft is not None:
        draft.timing, before = {}, dict(draft.catch_ups)
        eng.spec.prepare = _timed(eng.spec.prepare, dev, times, lambda *_: "draft", fence=True)
    eng.reset(mode)
    eng.add_request(Request("timed", 0, prompt, osl))
    n_steps, t0 = 0, time.perf_counter()
    while eng.step():
        n_steps += 1
    _sync(dev)
    loop_s = time.perf_counter() - t0
    prof = None
    if draft is not None:
        prof = draft_profile(times.get("draft", []), draft.timing, loop_s, n_steps,
                             {w: draft.catch_ups[w] - before[w] for w in before})
        draft.timing = None
    return _SynchronisedPass(times, prof)


def spec_run(model, spec: SpecConfig | None, mode: str, graphs: bool, osl: int, prompt: tuple[int, ...],
             n_req: int = 3, own: list[int] | None = None, script=None, passes: int = 4, eager_catch_up: bool = False,
             force: bool = False) -> dict:
    """n_req requests one at a time (the first is warm-up): tok/s (no per-step syncs), acceptance, and in one more
    pass with a sync after every launch: verify-step and decode-step times and the rollback time, and for a draft
    proposer its time per step (synchronised before and after) by phase (draft_profile). Verify graphs are
    captured before any timed request. own (the upper bound): scripted drafts `script(tokens)` start from these
    tokens and are refined (up to `passes` untimed runs) to the speculative run's own greedy tokens, since a verify
    batch's arithmetic may flip a near tie of the non-speculative run. eager_catch_up: the draft's every catch-up is
    its packed prefill (the reference for the catch-up through its decode graphs). force (a draft proposer with own
    and script): the draft model runs every pass as usual, then its drafts are overwritten by the script's (the
    draft path's whole cost with drafts that are right)."""
    k = spec.k if spec else 0
    eng = _spec_engine(model, spec, mode, graphs, osl, prompt, eager_catch_up)
    table = {}
    if force:
        table.update(script(own).proposer.table())
        _force_drafts(eng.spec.draft if eng.spec is not None else None, table)
    refined = _refine_own(eng, mode, prompt, osl, own, script, passes, force, table)
    req = _timed_requests(eng, mode, prompt, osl, n_req)
    sp = _synchronised_pass(eng, mode, prompt, osl)
    times = sp.times
    mean = lambda xs: 1e3 * sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    n_ver = len(times.get("verify", []))
    acc, prop = req.accepted, req.proposed
    return {"spec": spec.to_json() if spec and spec.proposer.kind != "scripted" else None, "k": k, "mode": mode,
            "graphs": graphs, "osl": osl, "tok_s": sum(req.rates) / len(req.rates), "accepted": acc, "proposed": prop,
            "acceptance": acc / prop if prop else 0.0, "verify_ms": mean(times.get("verify", [])),
            "rollback_ms_per_verify": 1e3 * sum(times.get("rollback", [])) / n_ver if n_ver else float("nan"),
            "decode_ms": mean(times.get("decode", [])), "verify_steps": n_ver,
            "decode_steps": len(times.get("decode", [])), "tokens": req.tokens,
            "verify_graph_replays": eng.spec.runner.replays if eng.spec is not None else 0,
            "script_refinements": refined, "draft_profile": sp.draft_profile}


def _force_drafts(draft, table: dict) -> None:
    """The draft's passes run as usual; then each row's drafts are replaced by table[request][n generated] (one small
    upload per row and pass, as a right proposer's drafts would cost nothing more to read)."""
    orig = draft.propose_device

    def forced(rows):
        out = orig(rows)
        for j, r in enumerate(rows):
            d = table.get(r.rid, {}).get(len(r.output), ())[:out.shape[1]]
            if d:
                out[j, :len(d)].copy_(torch.tensor(d, dtype=out.dtype), non_blocking=True)
        return out
    draft.propose_device = forced


def draft_profile(calls: list[float], phases: dict[str, float], loop_s: float, n_steps: int,
                  catch_ups: dict[str, int]) -> dict:
    """Where a draft proposer's time goes in the synchronised pass: per step (ms) its whole pass (Speculator.prepare)
    and each phase of DraftModel.propose_device (catch-up through the decode graphs or the packed prefill, drafting
    steps with the snapshot save, snapshot restore), its share of the pass's wall time, and the rows caught up each
    way."""
    per = lambda x: 1e3 * x / n_steps if n_steps else float("nan")  # noqa: E731
    return {"step_ms": per(loop_s), "draft_ms": per(sum(calls)), "share": sum(calls) / loop_s if loop_s else 0.0,
            "phases_ms": {name: per(v) for name, v in sorted(phases.items())}, "catch_ups": catch_ups,
            "steps": n_steps}


def _draft_text(p: dict) -> str:
    """The draft-proposer profile of a row, one clause."""
    phases = ", ".join(f"{name} {ms:.3f}" for name, ms in p["phases_ms"].items())
    c = p["catch_ups"]
    return (f"; draft proposer {p['draft_ms']:.3f} ms/step = {100 * p['share']:.0f}% of a {p['step_ms']:.3f} ms "
            f"synchronised step ({phases} ms; rows caught up: {c['graph']} graph, {c['prefill']} prefill)")


def upper_bound_spec(k: int, continuation: list[int], n_req: int, wrong_last: int = 0) -> SpecConfig:
    """Scripted proposals = the run's own greedy continuation, for every request id spec_run uses; wrong_last = V:
    the last draft of every step is made wrong ((t + 1) mod V), so every step accepts m-1 and rolls back."""
    def drafts(n: int) -> tuple[int, ...]:
        d = list(continuation[n:n + k])
        if wrong_last and d:
            d[-1] = (d[-1] + 1) % wrong_last
        return tuple(d)
    per = tuple((n, drafts(n)) for n in range(1, len(continuation)) if continuation[n:n + k])
    ids = [f"q{i}" for i in range(n_req)] + ["timed"]
    return SpecConfig(k, ProposerConfig("scripted", proposals=tuple((rid, per) for rid in ids)))


def write_draft(model, layers: int, folder: str) -> str:
    """The target's first `layers` layers (plus embeddings, final norm, head) as an HF folder: same vocab."""
    from oracle.checkpoint import check_tensors, save_checkpoint
    cfg = dataclasses.replace(model.config, layers=model.config.layers[:layers])
    keep = {n: t for n, t in model.w.items() if _in_draft(n, layers)}
    canon = _canonical(cfg, keep)          # fused names (qkv, gate_up) back to the canonical ones
    check_tensors(cfg, canon)
    save_checkpoint(folder, cfg, canon)
    return folder


def _in_draft(name: str, layers: int) -> bool:
    """Whether the target's tensor `name` is one of the draft's: not a layer's, or one of the first `layers`."""
    return not name.startswith("layers.") or int(name.split(".")[1]) < layers


def draft_pass_bytes(model, layers: int) -> int:
    """Weight bytes one forward of the draft (`write_draft(model, layers)`) must read: its layers, final norm and
    head; the embedding table is read a row a token, so it counts only when it is the head (tied)."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    return sum(t.numel() * t.element_size() for n, t in model.w.items()
               if _in_draft(n, layers) and (n != "embed.weight" or tied))


def bytes_ceiling(k: int, ub_tok_s: float, pass_bytes: int, copy_bps: float) -> float:
    """The most a draft proposer can reach, as a fraction of the upper bound at the same k, when every draft is
    right: each step's k + 1 tokens take the upper bound's step time plus k draft forwards (a catch-up that yields
    the first draft, then k - 1 one-token steps), each reading `pass_bytes` at `copy_bps`."""
    step = (k + 1) / ub_tok_s
    return step / (step + k * pass_bytes / copy_bps)


def _canonical(cfg, w: dict) -> dict:
    """Undo FastModel's load-time fusions (gate_up, qkv) so the tensors are the canonical checkpoint names. The
    folded norm gains stay folded (norm gains 1, projections scaled): the same function."""
    out = {}
    for name, t in w.items():
        if name.endswith("gate_up.weight"):
            g, u = t.chunk(2)
            out[name.replace("gate_up", "gate_proj")], out[name.replace("gate_up", "up_proj")] = g, u
        elif name.endswith("attn.qkv.weight"):
            c = cfg
            q, k, v = t.split([c.n_attn_heads * c.attn_head_dim, c.n_kv_heads * c.attn_head_dim,
                               c.n_kv_heads * c.attn_head_dim])
            for n_, x in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[name.replace("qkv", n_)] = x
        else:
            out[name] = t
    if getattr(cfg, "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    return out


def _line(r: dict, base: dict) -> str:
    k = r["k"]
    same = r["tokens"] == base["tokens"][:len(r["tokens"])]
    steps = (k + 1) * base["decode_ms"]
    ver = (f"verify step {r['verify_ms']:.3f} ms + rollback {r['rollback_ms_per_verify']:.3f} ms (x{r['verify_steps']}, "
           f"{r['verify_graph_replays']} graph replays) vs k+1 = {k + 1} one-token decode steps {steps:.3f} ms "
           f"({(r['verify_ms'] + r['rollback_ms_per_verify']) / steps:.2f}x)" if k else
           f"decode step {r['decode_ms']:.3f} ms (x{r['decode_steps']})")
    return (f"spec {r['label']:28s} {r['mode']} graphs={'on' if r['graphs'] else 'off'}: {r['tok_s']:8.1f} tok/s "
            f"({r['tok_s'] / base['tok_s']:4.2f}x of {base['tok_s']:.1f}), acceptance {r['accepted']}/{r['proposed']}"
            f" = {100 * r['acceptance']:5.1f}%, {ver}"
            + (f"; drafts refined by {r['script_refinements']} untimed runs" if r.get("script_refinements") else "")
            + (_draft_text(r["draft_profile"]) if r.get("draft_profile") else "")
            + ("" if r is base else f"; tokens == no-spec: {'yes' if same else 'NO (near tie?)'}"))


@dataclasses.dataclass
class _SpecRows:
    """spec_bench's rows and printed lines so far, and how each row is run: the target, mode, graphs, prompt, the
    default length and request count, and the time cap from t_start."""
    model: object
    mode: str
    graphs: bool
    prompt: tuple[int, ...]
    osl: int
    n_req: int
    budget_s: float
    t_start: float
    rows: list[dict] = dataclasses.field(default_factory=list)
    lines: list[str] = dataclasses.field(default_factory=list)

    def emit(self, text: str) -> None:
        """Keep a line and print it."""
        self.lines.append(text)
        print(text, flush=True)

    def one(self, label: str, kind: str, spec, osl_: int | None = None, n: int | None = None, own=None, script=None,
            m=None, eager: bool = False, force: bool = False) -> dict | None:
        """One row through spec_run (osl_, n, m default to the bench's length, request count and model), or None
        when the time cap is spent or it failed (a line says which)."""
        osl_ = self.osl if osl_ is None else osl_
        n = self.n_req if n is None else n
        m = self.model if m is None else m
        if self.rows and time.perf_counter() - self.t_start > self.budget_s:
            self.emit(f"spec {label}: skipped (bench time cap {self.budget_s:.0f} s spent)")
            return None
        try:
            r = spec_run(m, spec, self.mode, self.graphs, osl_, self.prompt, n, own=own, script=script,
                         eager_catch_up=eager, force=force)
        except Exception as e:                        # one GPU run reports every case it can
            self.emit(f"spec {label}: FAILED {type(e).__name__}: {e}"[:300])
            return None
        r.update(label=label, kind=kind)
        self.rows.append(r)
        self.emit(_line(r, self.rows[0]))
        return r


def _draft_rows(b: _SpecRows, ks, d: str, draft_layers: int, draft_osl: int, draft_budget_s: float) -> None:
    """Per k: the draft proposer's default, eager catch-up and device-drafts rows, until draft_budget_s is spent."""
    model = b.model
    t0 = time.perf_counter()
    variants = (("", "draft", model, False), (" eager catch-up", "draft_eager_catch_up", model, True),
                (" device drafts", "draft_device", model.with_options(spec_device_drafts=True), False))
    for k in ks:
        for name, kind, m, eager in variants:
            label = f"draft{draft_layers} k={k}{name} ({draft_osl} tok)"
            if time.perf_counter() - t0 > draft_budget_s:
                b.emit(f"spec {label}: skipped (draft time cap {draft_budget_s:.0f} s spent)")
                continue
            b.one(label, kind, SpecConfig(k, ProposerConfig("draft", model=d)), osl_=draft_osl, m=m, eager=eager)


def _draft_right_rows(b: _SpecRows, ks, d: str, draft_layers: int, base: dict, copy_bps: float | None) -> None:
    """Per k: the draft's passes with the upper bound's drafts forced in, beside the upper bound (and the bytes
    ceiling when copy_bps is known)."""
    osl, n_req = b.osl, b.n_req
    for k in ks:
        ub = next((r for r in b.rows if r["kind"] == "upper_bound" and r["k"] == k), None)
        dr = b.one(f"draft{draft_layers} k={k} drafts forced right ({osl} tok)", "draft_right",
                   SpecConfig(k, ProposerConfig("draft", model=d)), own=base["tokens"],
                   script=lambda t, k=k: upper_bound_spec(k, t, n_req), force=True)
        note = "; goal >= 0.90x"
        if dr is not None and ub is not None and copy_bps:
            nb = draft_pass_bytes(b.model, draft_layers)
            dr["bytes_ceiling"] = bytes_ceiling(k, ub["tok_s"], nb, copy_bps)
            note += (f"; bytes ceiling {dr['bytes_ceiling']:.2f}x: {k} draft forwards of {nb / 1e9:.3f} GB at "
                     f"{copy_bps / 1e12:.2f} TB/s a step")
        beside_upper_bound(dr, ub, f"draft{draft_layers} k={k} forced right", b.emit, note)


def _draft_sections(b: _SpecRows, ks, groups, base: dict, draft_layers: int, draft_osl: int,
                    draft_budget_s: float, backoff: int, copy_bps: float | None) -> None:
    """The draft-model row groups (draft, draft_right, draft_backoff) over one draft folder written for them."""
    with tempfile.TemporaryDirectory() as d:
        if {"draft", "draft_right", "draft_backoff"} & set(groups):
            try:
                write_draft(b.model, draft_layers, d)
            except Exception as e:
                b.emit(f"spec draft folder FAILED {type(e).__name__}: {e}"[:300])
                d = None
        if d and "draft" in groups:
            _draft_rows(b, ks, d, draft_layers, draft_osl, draft_budget_s)
        if d and "draft_right" in groups:
            _draft_right_rows(b, ks, d, draft_layers, base, copy_bps)
        for k in ks if d and "draft_backoff" in groups else ():
            for bo in (0, backoff):
                b.one(f"draft{draft_layers} k={k}{f' backoff {bo}' if bo else ''} ({b.osl} tok)",
                      "draft_backoff" if bo else "draft_full_length",
                      SpecConfig(k, ProposerConfig("draft", model=d), backoff=bo))


def _close_rows(b: _SpecRows, base: dict) -> None:
    """The upper bound's caveat line; each row's tokens replaced by whether they equal the baseline's."""
    b.emit("spec upper bound = scripted drafts copied from the run's own greedy tokens (the non-speculative run's, "
           "refined by untimed runs where a near tie flipped under verify arithmetic): acceptance ~100% by "
           "construction; it measures the mechanism, not a proposer. 'last draft wrong': the same drafts with the "
           "last one wrong, so every step accepts m-1 and rolls back (snapshots: a copy; replay: the accepted "
           "positions' conv/SSM steps re-run)")
    want = list(base["tokens"])
    for r in b.rows:                # the token lists stay out of the report; whether they matched the baseline's in
        toks = r.pop("tokens", None)  # it (bf16: a near tie may flip under verify arithmetic)
        r["tokens_equal_baseline"] = toks == want if r["osl"] == b.osl else toks == want[:len(toks)]


ROW_GROUPS = ("ngram", "upper_bound", "draft", "draft_right", "draft_backoff", "self_draft", "last_wrong")


def spec_bench(model, ks=(1, 2, 4, 8), osl: int = 256, mode: str = "async", graphs: bool = True,
               draft_layers: int = 4, prompt_len: int = 256, draft_osl: int = 32,
               draft_budget_s: float = 90.0, n_req: int = 2, budget_s: float = 150.0,
               rollbacks: tuple[str, ...] = ("snapshots", "replay"),
               groups: tuple[str, ...] = ROW_GROUPS, backoff: int = 16,
               copy_bps: float | None = None) -> tuple[list[dict], list[str]]:
    """Baseline, then at each k: ngram, upper bound, draft, self-draft (the target as its own draft, beside the upper
    bound at the same length: self_draft_rows), the upper bound with its last draft wrong under each
    rollback (per-position snapshots, replay: FastOptions.spec_replay) — only the `groups` named. Draft rows, per k:
    the engine's default (short catch-ups through the draft's decode graphs, drafts read on the host), every catch-up
    as the packed prefill (the reference), and drafts kept on the device (FastOptions.spec_device_drafts); each with
    the draft proposer's time per step by phase. draft_right: the draft's passes with their drafts replaced by the
    upper bound's (the draft path's cost when drafts are right), beside the upper bound row. draft_backoff: the draft at the full length without and with
    `engine.speculative.backoff` = `backoff` (what wrong drafts cost once the request drafts less while they miss).
    copy_bps (the run's copy bandwidth, bytes/s): draft_right also prints the bytes ceiling (bytes_ceiling).
    Rows after `budget_s` (draft rows: after `draft_budget_s` of them) are skipped; returns (rows, printable lines)."""
    unknown = sorted(set(groups) - set(ROW_GROUPS))
    if unknown:
        raise ValueError(f"spec rows: unknown groups {unknown}; expected some of {ROW_GROUPS}")
    prompt = code_like_prompt(prompt_len, model.config.vocab_size)
    b = _SpecRows(model, mode, graphs, prompt, osl, n_req, budget_s, time.perf_counter())
    one = b.one
    base = one("none (bs1, no speculation)", "baseline", None)
    if base is None:
        return b.rows, b.lines
    for k in ks if "ngram" in groups else ():
        one(f"ngram k={k}", "ngram", SpecConfig(k, ProposerConfig("ngram", min_n=1, max_n=4)))
    V = model.config.vocab_size
    for k in ks if "upper_bound" in groups else ():
        one(f"upper bound k={k} (drafts=own)", "upper_bound", upper_bound_spec(k, base["tokens"], n_req),
            own=base["tokens"], script=lambda t, k=k: upper_bound_spec(k, t, n_req))
    _draft_sections(b, ks, groups, base, draft_layers, draft_osl, draft_budget_s, backoff, copy_bps)
    if "self_draft" in groups:
        self_draft_rows(model, ks, base, n_req, draft_osl, one, b.emit)
    for name in rollbacks if "last_wrong" in groups else ():
        m = model.with_options(spec_replay=name == "replay")
        for k in ks:
            one(f"last draft wrong k={k} {name}", f"last_wrong_{name}", upper_bound_spec(k, base["tokens"], n_req, V),
                own=base["tokens"], script=lambda t, k=k: upper_bound_spec(k, t, n_req, V), m=m)
    _close_rows(b, base)
    return b.rows, b.lines


def self_draft_rows(model, ks, base: dict, n_req: int, osl: int, one, emit) -> None:
    """The draft path when its drafts are right: the draft model is the target itself (every layer), so it proposes
    the target's greedy continuation (a bf16 near tie aside), beside the scripted upper bound at the same k and
    length; the ratio is the draft path's whole cost at full acceptance (goal: within 10% of the upper bound)."""
    with tempfile.TemporaryDirectory() as d:
        try:
            write_draft(model, len(model.config.layers), d)
        except Exception as e:
            emit(f"spec self-draft folder FAILED {type(e).__name__}: {e}"[:300])
            return
        for k in ks:
            ub = one(f"upper bound k={k} ({osl} tok)", "upper_bound_short", upper_bound_spec(k, base["tokens"], n_req),
                     osl_=osl, own=base["tokens"], script=lambda t, k=k: upper_bound_spec(k, t, n_req))
            sd = one(f"self-draft k={k} ({osl} tok)", "self_draft", SpecConfig(k, ProposerConfig("draft", model=d)),
                     osl_=osl)
            beside_upper_bound(sd, ub, f"self-draft k={k}", emit)


def beside_upper_bound(r: dict | None, ub: dict | None, label: str, emit, note: str = "") -> None:
    """Row r's tok/s as a ratio to the upper bound's at the same k and length (r["vs_upper_bound"]), printed."""
    if r is None or ub is None:
        return
    r["vs_upper_bound"] = r["tok_s"] / ub["tok_s"]
    emit(f"spec {label}: {r['vs_upper_bound']:.2f}x of the upper bound at the same k and length (acceptance "
         f"{r['accepted']}/{r['proposed']} vs {ub['accepted']}/{ub['proposed']}{note})")


def smoke_model(triton: bool = False):
    """A tiny zoo Bamba on the CPU (fp32): the torch kernel stand-ins, or the Triton kernels (TRITON_INTERPRET=1)."""
    from fastpath.model import FastModel
    from oracle import zoo
    if triton and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--triton on the CPU needs TRITON_INTERPRET=1 set before Python starts")
    cfg = zoo.tiny_config("bamba")
    return FastModel(cfg, zoo.random_weights(cfg, seed=0), "cpu", torch.float32).with_options(
        backend="triton" if triton else "torch")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny zoo model, k 1,2, a few tokens (no figures)")
    ap.add_argument("--triton", action="store_true", help="smoke through the Triton kernels (interpreter: minutes)")
    ap.add_argument("--spec-k", default="1,2")
    ap.add_argument("--spec-rows", default=",".join(ROW_GROUPS), help=f"row groups: some of {ROW_GROUPS}")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not args.smoke:
        ap.error("on a GPU run `python -m hybridqual.bench.engine --spec`; here only --smoke")
    problem = arguments.first(arguments.int_list("--spec-k", args.spec_k, 1, 64),
                              arguments.comma_names("--spec-rows", args.spec_rows, ROW_GROUPS),
                              arguments.writable_file("--out", args.out))
    if problem:
        return arguments.refuse(problem)
    model = smoke_model(args.triton)
    rows, lines = spec_bench(model, tuple(int(x) for x in args.spec_k.split(",")), osl=8, prompt_len=40,
                             draft_layers=1, draft_osl=6, n_req=2, groups=tuple(args.spec_rows.split(",")),
                             copy_bps=1e10)      # a nominal 10 GB/s: the smoke prints the ceiling line, no figure
    print(f"smoke: {len(rows)} rows, backend {model.backend} (CPU: not a speed figure)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all("FAILED" not in x for x in lines) else 1


if __name__ == "__main__":
    raise SystemExit(main())
