"""bs1 speculative decoding benchmark (issue 18 item 5), called by `tools/bench_engine.py --spec`.

In one run, same model and mode: bs1 effective tok/s without speculation, then with ngram (a code-like repetitive
prompt) and with a draft model (the target's first `draft_layers` layers: same vocab, embeddings and head), for
each k; acceptance rate (accepted / proposed drafts, from the schedule log), and the mean verify-step time against
k+1 one-token decode steps. Random weights: acceptance is whatever the random model does on the workload — it is
reported, not assumed.
"""
from __future__ import annotations

import dataclasses
import tempfile
import time

import torch

from fastpath.engine.engine import Engine
from oracle.speculative import ProposerConfig, SpecConfig
from oracle.trace import EngineConfig, Request
from .spec_checks import acceptance_rate


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


def _timed(fn, dev, into: dict, key):
    """Wrap fn: the wall time of each call (device synchronised after it) goes to into[key(args)]."""
    def run(*args, **kw):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        _sync(dev)
        into.setdefault(key(*args), []).append(time.perf_counter() - t0)
        return out
    return run


def spec_run(model, spec: SpecConfig | None, mode: str, graphs: bool, osl: int, prompt: tuple[int, ...],
             n_req: int = 3) -> dict:
    """n_req requests one at a time (the first is warm-up): tok/s (no per-step syncs), acceptance, and in a second
    pass with a sync after every launch: verify-step and decode-step launch times and the replay time."""
    C, k = model.config.chunk_size, spec.k if spec else 0
    B = max(C, len(prompt), k + 1)
    eng = Engine(model, EngineConfig(1, B, B, mode, spec), max_len=len(prompt) + osl + 8, graphs=graphs)
    rates, acc, prop = [], 0, 0
    for i in range(n_req):
        eng.reset(mode)
        eng.add_request(Request(f"q{i}", 0, prompt, osl))
        eng.step()
        _sync(model.device)
        t0 = time.perf_counter()
        while eng.step():
            pass
        _sync(model.device)
        dt = time.perf_counter() - t0
        if i > 0:
            rates.append((len(eng.requests[f"q{i}"].output) - 1) / dt)
            a, p = acceptance_rate(eng.log)
            acc, prop = acc + a, prop + p
    times: dict = {}
    kind = lambda batch, *_: "verify" if any(b.kind == "verify" for b in batch) else "decode" if all(  # noqa: E731
        b.kind == "decode" for b in batch) else "prefill"
    eng.launch = _timed(eng.launch, model.device, times, kind)
    if eng.spec is not None:
        eng.spec.rollback = _timed(eng.spec.rollback, model.device, times, lambda *_: "replay")
    eng.reset(mode)
    eng.add_request(Request("timed", 0, prompt, osl))
    while eng.step():
        pass
    mean = lambda xs: 1e3 * sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    n_ver = len(times.get("verify", []))
    return {"spec": spec.to_json() if spec else None, "mode": mode, "graphs": graphs, "osl": osl,
            "tok_s": sum(rates) / len(rates), "accepted": acc, "proposed": prop,
            "acceptance": acc / prop if prop else 0.0, "verify_ms": mean(times.get("verify", [])),
            "replay_ms_per_verify": 1e3 * sum(times.get("replay", [])) / n_ver if n_ver else float("nan"),
            "decode_ms": mean(times.get("decode", [])), "verify_steps": n_ver,
            "decode_steps": len(times.get("decode", []))}


def write_draft(model, layers: int, folder: str) -> str:
    """The target's first `layers` layers (plus embeddings, final norm, head) as an HF folder: same vocab."""
    from oracle.checkpoint import save_checkpoint
    cfg = dataclasses.replace(model.config, layers=model.config.layers[:layers])
    keep = {}
    for name, t in model.w.items():
        if name.startswith("layers."):
            if int(name.split(".")[1]) >= layers:
                continue
        keep[name] = t
    from oracle.checkpoint import check_tensors    # fused names (qkv, gate_up) back to the canonical ones
    canon = _canonical(cfg, keep)
    check_tensors(cfg, canon)
    save_checkpoint(folder, cfg, canon)
    return folder


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
    if cfg.tie_word_embeddings if hasattr(cfg, "tie_word_embeddings") else False:
        out.pop("lm_head.weight", None)
    return out


def spec_bench(model, ks=(1, 2, 4, 8), osl: int = 256, mode: str = "async", graphs: bool = True,
               draft_layers: int = 4, prompt_len: int = 256) -> tuple[list[dict], list[str]]:
    """Baseline, ngram and draft at each k; returns (rows, printable lines)."""
    prompt = code_like_prompt(prompt_len, model.config.vocab_size)
    rows, lines = [], []

    def one(label: str, spec) -> None:
        try:
            r = spec_run(model, spec, mode, graphs, osl, prompt)
        except Exception as e:                        # one GPU visit reports every case it can
            lines.append(f"spec {label}: FAILED {type(e).__name__}: {e}"[:300])
            print(lines[-1], flush=True)
            return
        r["label"] = label
        rows.append(r)
        base = rows[0]["tok_s"] if rows and rows[0]["spec"] is None else float("nan")
        lines.append(f"spec {label:14s} {mode} graphs={'on' if graphs else 'off'}: {r['tok_s']:7.1f} tok/s "
                     f"({r['tok_s'] / base:4.2f}x), acceptance {r['accepted']}/{r['proposed']} = "
                     f"{100 * r['acceptance']:.1f}%, verify step {r['verify_ms']:.3f} ms (+ replay "
                     f"{r['replay_ms_per_verify']:.3f}) x{r['verify_steps']} vs decode step {r['decode_ms']:.3f} ms "
                     f"x{r['decode_steps']} (k+1 = {(r['spec'] or {}).get('k', 0) + 1} of them: "
                     f"{((r['spec'] or {}).get('k', 0) + 1) * r['decode_ms']:.3f} ms)")
        print(lines[-1], flush=True)

    one("none", None)
    for k in ks:
        one(f"ngram k={k}", SpecConfig(k, ProposerConfig("ngram", min_n=1, max_n=4)))
    with tempfile.TemporaryDirectory() as d:
        try:
            write_draft(model, draft_layers, d)
        except Exception as e:
            lines.append(f"spec draft folder FAILED {type(e).__name__}: {e}"[:300])
            return rows, lines
        for k in ks:
            one(f"draft{draft_layers} k={k}", SpecConfig(k, ProposerConfig("draft", model=d)))
    return rows, lines
