"""Batch-invariant mode at size: speculation and the prefix cache leave tokens and logits bitwise unchanged, and
what the mode costs (anchor-3b, random bf16 weights, CUDA graphs, one GPU).

    python -m hybridqual.bench.invariant [--out F.json] [--summary F]          # anchor-3b, bf16, CUDA graphs
    TRITON_INTERPRET=1 python -m hybridqual.bench.invariant --tiny            # the same code path: tiny zoo model, CPU

Workload: several requests sharing a long code-like prefix, each with its own suffix and a few dozen output
tokens, arriving a few steps apart into fewer rows than requests, so batches change composition as requests
arrive, prefill, decode and finish. Each run records every sampled logits row per (request, position) through
`Engine.on_logits` (CUDA-graph replays and verify steps included) in the model's dtype. Comparisons, bitwise
(tokens; logits rows byte for byte, `invariance_checks.row_difference`, so -0.0 is not 0.0):
  batch-invariant mode: speculative (scripted drafts = the non-speculative run's tokens; ngram) == non-speculative,
  prefix cache on == off, the last request alone == in the batch;
  default mode (control: nothing promised there): scripted speculative == non-speculative, cache on == off.
Rows after the first token that differs are not compared (their inputs differ). Cost: the non-speculative,
cache-off workload timed in both modes on the same engines, interleaved, medians and their ratio.
A mismatch is reported as such (MISMATCH in the table); the exit code is 1 only when a run raised.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch
from torch import Tensor

from fastpath.engine.engine import engine_class
from fastpath.model import FastModel
from oracle.speculative import ProposerConfig, SpecConfig
from oracle.trace import EngineConfig, PrefixCacheConfig, Request, Trace
from hybridqual.bench import arguments
from hybridqual.bench.prefix import free_cache, sync
from hybridqual.bench.spec import code_like_prompt
from hybridqual.qualify.invariance_checks import row_difference
from hybridqual.qualify.spec_checks import acceptance_rate


@dataclasses.dataclass(frozen=True)
class Workload:
    """Shape of the shared-prefix workload and of the engine that runs it."""

    requests: int = 6
    prefix: int = 1024
    suffix_max: int = 64      # per-request suffixes of 8..suffix_max tokens
    osl: int = 32
    stagger: int = 2          # steps between arrivals
    rows: int = 4             # max_requests (fewer than requests: later ones queue)
    prefill_chunk: int = 512
    block: int = 256          # prefix-cache block (a multiple of the model's chunk size)
    capacity: int = 8
    k: int = 4                # speculative drafts per row and step

    def budget(self) -> int:
        """Token budget: a whole prefill piece fits beside every other row's verify tokens (batch-invariant pieces
        wait when they do not fit, so a tighter budget would only starve prefill)."""
        return self.prefill_chunk + self.rows * (self.k + 1)


def requests_of(w: Workload, vocab: int) -> tuple[Request, ...]:
    """Shared code-like prefix + a per-request suffix (8..suffix_max tokens), staggered arrivals, osl varying by
    about an eighth either way (requests finish at different steps)."""
    prefix = code_like_prompt(w.prefix, vocab)
    out = []
    for i in range(w.requests):
        suffix = tuple((31 * j + 577 * i + 5) % vocab for j in range(8 + (23 * i) % (w.suffix_max - 7)))
        osl = max(2, w.osl + (i % 3 - 1) * max(1, w.osl // 8))
        out.append(Request(f"r{i}", w.stagger * i, prefix + suffix, osl))
    return tuple(out)


def max_len_of(w: Workload, reqs: tuple[Request, ...]) -> int:
    return max(len(r.prompt) + r.max_new_tokens for r in reqs) + w.k + 8


def engine_config(w: Workload, mode: str, spec: SpecConfig | None = None, cache: bool = False) -> EngineConfig:
    return EngineConfig(w.rows, w.budget(), w.prefill_chunk, mode, spec,
                        prefix_cache=PrefixCacheConfig(w.block, w.capacity) if cache else None)


def scripted_spec(k: int, tokens: dict[str, list[int]]) -> SpecConfig:
    """Drafts = each request's own tokens from a run without speculation (all right if the arithmetic is the same)."""
    per = {rid: tuple((n, tuple(t[n:n + k])) for n in range(1, len(t)) if t[n:n + k]) for rid, t in tokens.items()}
    return SpecConfig(k, ProposerConfig("scripted", proposals=tuple(per.items())))


def record_run(eng, trace: Trace) -> dict:
    """Run `trace` on `eng` recording every sampled logits row (model dtype, to the host after the run); returns
    tokens, rows {(request, position): row}, and what shaped the batches (hits, drafts, rows per step)."""
    rows: dict[tuple[str, int], Tensor] = {}

    def hook(batch, logits) -> None:              # the last row seen for a position wins (a rejected draft's is
        for j, b in enumerate(batch):             # replaced by the row that produced the kept token)
            plen = len(eng.requests[b.request].req.prompt)
            if b.kind == "decode" or (b.kind == "prefill" and b.pos + b.count == plen):
                rows[(b.request, b.pos + b.count)] = logits[j].detach().clone()
    eng.on_logits = hook
    sync(eng.device)
    t0 = time.perf_counter()
    try:
        res = eng.run_trace(trace)
    finally:
        eng.on_logits = None
    sync(eng.device)
    wall = time.perf_counter() - t0
    log = res.schedule_log.to_json()["steps"]
    acc, prop = acceptance_rate(res.schedule_log)
    comps = {tuple(sorted({b["request"] for b in s["batch"]})) for s in log if s["batch"]}
    return {"tokens": res.tokens, "rows": {key: r.cpu() for key, r in rows.items()}, "wall_s": wall,
            "steps": len(log), "max_rows": max((len(s["batch"]) for s in log), default=0),
            "compositions": len(comps), "accepted": acc, "proposed": prop,
            "cached_tokens": [a.get("cached_tokens", 0) for s in log for a in s["admit"]]}


def compare(a: dict, b: dict, reqs: tuple[Request, ...]) -> dict:
    """Tokens per request, then each logits row whose history is the same in both runs (positions up to the first
    differing token), byte for byte; the differing rows' max |delta| and the first few positions."""
    out = {"tokens_equal": True, "compared": 0, "differing": 0, "missing": 0, "max_abs_delta": 0.0,
           "token_divergence": {}, "first_differences": []}
    for r in reqs:
        ta, tb = a["tokens"].get(r.id, []), b["tokens"].get(r.id, [])
        same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        if ta != tb:
            out["tokens_equal"] = False
            out["token_divergence"][r.id] = same
        for i in range(min(same + 1, len(ta), len(tb))):
            key = (r.id, len(r.prompt) + i)
            ra, rb = a["rows"].get(key), b["rows"].get(key)
            if ra is None or rb is None:
                out["missing"] += 1
                continue
            out["compared"] += 1
            diff = row_difference(ra[None], rb[None])
            if diff is not None:
                out["differing"] += 1
                d = float((ra.float() - rb.float()).abs().max())
                out["max_abs_delta"] = max(out["max_abs_delta"], d)
                if len(out["first_differences"]) < 5:
                    out["first_differences"].append({"request": r.id, "output_index": i, "max_abs_delta": d})
    out["bitwise"] = out["tokens_equal"] and out["differing"] == 0 and out["missing"] == 0 and out["compared"] > 0
    return out


def _facts(run: dict) -> dict:
    """A run's report entry (without tokens and rows)."""
    return {k: v for k, v in run.items() if k not in ("tokens", "rows")}


def invariant_bench(model: FastModel, w: Workload, mode: str = "async", graphs: bool = True, reps: int = 3,
                    budget_s: float = 200.0) -> dict:
    """Every comparison and the cost on `model` (its options other than batch_invariant as given); comparisons
    after `budget_s` are skipped and reported as such."""
    dev, vocab = model.device, model.config.vocab_size
    reqs = requests_of(w, vocab)
    max_len = max_len_of(w, reqs)
    models = {"batch_invariant": model.with_options(batch_invariant=True),
              "default": model.with_options(batch_invariant=False)}
    t_start = time.perf_counter()
    rep: dict = {"workload": dataclasses.asdict(w), "budget_tokens": w.budget(), "mode": mode, "graphs": graphs,
                 "prompt_lens": [len(r.prompt) for r in reqs], "osl": [r.max_new_tokens for r in reqs],
                 "arrivals": [r.arrival_step for r in reqs], "runs": {}, "comparisons": [], "errors": []}

    def make(which: str, spec: SpecConfig | None = None, cache: bool = False):
        m = models[which]
        return engine_class(m.options)(m, engine_config(w, mode, spec, cache), max_len=max_len, graphs=graphs)

    def run(name: str, which: str, spec=None, cache: bool = False, only: tuple[Request, ...] | None = None,
            eng=None) -> dict | None:
        """One recorded run; None (reported) if it raised or the time cap is spent."""
        if time.perf_counter() - t_start > budget_s:
            rep["errors"].append(f"{name}: skipped (bench time cap {budget_s:.0f} s spent)")
            return None
        try:
            e = eng or make(which, spec, cache)
            r = record_run(e, Trace(e.ec, only or reqs))
        except Exception as ex:  # noqa: BLE001 - one GPU run reports every comparison it can
            rep["errors"].append(f"{name}: FAILED {type(ex).__name__}: {ex}"[:400])
            return None
        finally:
            if eng is None:
                e = None
                free_cache(dev)
        rep["runs"][name] = _facts(r)
        print(f"run {name}: {r['steps']} steps, {r['wall_s']:.2f} s, rows/step <= {r['max_rows']}, "
              f"{r['compositions']} batch compositions, cached {r['cached_tokens']}, drafts "
              f"{r['accepted']}/{r['proposed']}", flush=True)
        return r

    def cmp(what: str, which: str, a: dict | None, b: dict | None, subset=None, note: str = "") -> None:
        if a is None or b is None:
            rep["comparisons"].append({"what": what, "mode": which, "skipped": True})
            return
        c = compare(a, b, subset or reqs)
        c.update(what=what, mode=which, note=note, promised=which == "batch_invariant")
        rep["comparisons"].append(c)

    base_eng, base = {}, {}
    for which in models:                        # kept for the alone run and the cost (warm: graphs captured)
        try:
            base_eng[which] = make(which)
        except Exception as ex:  # noqa: BLE001
            rep["errors"].append(f"{which} base engine: FAILED {type(ex).__name__}: {ex}"[:400])
        base[which] = run(f"{which} base", which, eng=base_eng[which]) if which in base_eng else None
    for which in models:
        b = base[which]
        if b is None:
            continue
        for label, spec in ((f"scripted k={w.k}", scripted_spec(w.k, b["tokens"])),
                            (f"ngram k={w.k}", SpecConfig(w.k, ProposerConfig("ngram", min_n=1, max_n=4)))):
            if which == "default" and label.startswith("ngram"):
                continue
            s = run(f"{which} spec {label}", which, spec=spec)
            note = f"drafts accepted {s['accepted']}/{s['proposed']}" if s else ""
            cmp(f"speculative ({label}) == non-speculative", which, s, b, note=note)
        c = run(f"{which} prefix cache", which, cache=True)
        hits = sum(1 for n in (c or {}).get("cached_tokens", []) if n)
        cmp(f"prefix cache on (block {w.block}) == off", which, c, b,
            note=f"{hits}/{len(reqs)} requests hit, cached {c['cached_tokens']}" if c else "")
        if which == "batch_invariant":
            last = dataclasses.replace(reqs[-1], arrival_step=0)
            alone = run(f"{which} {last.id} alone", which, only=(last,), eng=base_eng[which])
            cmp(f"{last.id} alone == in the batch", which, alone, b, subset=(last,),
                note="alone: arrival 0, no other request")
    rep["cost"] = cost(base_eng, reqs, reps, dev) if all(base.values()) else {"skipped": True}
    del base_eng
    free_cache(dev)
    return rep


def cost(engines: dict, reqs: tuple[Request, ...], reps: int, dev: torch.device) -> dict:
    """Wall time of the whole workload per mode (warm engines, no hook), interleaved reps; medians and ratio."""
    times: dict[str, list[float]] = {k: [] for k in engines}
    out_tokens = sum(r.max_new_tokens for r in reqs)
    try:
        for _ in range(reps):
            for which, eng in engines.items():
                sync(dev)
                t0 = time.perf_counter()
                res = eng.run_trace(Trace(eng.ec, reqs))
                sync(dev)
                times[which].append(time.perf_counter() - t0)
                out_tokens = sum(len(t) for t in res.tokens.values())
    except Exception as ex:  # noqa: BLE001
        return {"error": f"{type(ex).__name__}: {ex}"[:400], "times_s": times}
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return {"times_s": times, "median_s": med, "ratio": med["batch_invariant"] / med["default"],
            "output_tokens": out_tokens, "tok_s": {k: out_tokens / v for k, v in med.items()}, "reps": reps}


def table(rep: dict) -> list[str]:
    """One row per comparison (tokens equal; logits rows compared / differing, max |delta|), then the cost row."""
    lines = [f"{'comparison':58s} {'tokens':8s} logits bitwise (compared/differing, max|d|)  notes"]
    for c in rep["comparisons"]:
        what = f"[{'BI' if c['mode'] == 'batch_invariant' else 'default'}] {c['what']}"
        if c.get("skipped"):
            lines.append(f"{what:58s} skipped (see errors)")
            continue
        tok = "equal" if c["tokens_equal"] else "DIFFER"
        lg = f"{c['compared']}/{c['differing']}" + (f", max|d| {c['max_abs_delta']:.3g}" if c["differing"] else "")
        if c["missing"]:
            lg += f", {c['missing']} missing"
        verdict = ("bitwise" if c["bitwise"] else "MISMATCH") if c["promised"] else \
            ("bitwise" if c["bitwise"] else "differs (not promised)")
        extra = f"; tokens diverge at {c['token_divergence']}" if c["token_divergence"] else ""
        lines.append(f"{what:58s} {tok:8s} {lg:24s} {verdict:22s} {c['note']}{extra}")
    k = rep.get("cost", {})
    if "ratio" in k:
        m = k["median_s"]
        lines.append(f"{'cost: batch-invariant / default, whole workload':58s} {k['ratio']:.3f}x  (median of "
                     f"{k['reps']}: BI {m['batch_invariant']:.3f} s, default {m['default']:.3f} s; "
                     f"{k['tok_s']['batch_invariant']:.1f} vs {k['tok_s']['default']:.1f} output tok/s)")
    else:
        lines.append(f"{'cost: batch-invariant / default':58s} not measured {k.get('error', '(a base run failed)')}")
    lines += [f"error: {e}" for e in rep.get("errors", [])]
    return lines


def tiny_model() -> FastModel:
    """The --tiny model: a seeded tiny zoo Bamba (attention at layer 1, chunk 8) on the CPU in fp32."""
    from oracle import zoo
    cfg = zoo.tiny_config("bamba", pattern="M*", hidden_size=16, mamba_n_heads=2, mamba_n_groups=1, n_attn_heads=2,
                          n_kv_heads=1)
    return FastModel(cfg, zoo.random_weights(cfg, seed=3), "cpu", torch.float32)


TINY = Workload(requests=4, prefix=24, suffix_max=12, osl=3, stagger=2, rows=2, prefill_chunk=16, block=8, capacity=8,
                k=2)


def argument_problem(args: argparse.Namespace) -> str | None:
    """The first bad value among the bench's arguments (one line naming the flag), or None; no work done."""
    counts = [("--requests", args.requests, 1), ("--prefix", args.prefix, 1), ("--osl", args.osl, 1),
              ("--rows", args.rows, 1), ("--k", args.k, 1), ("--reps", args.reps, 1)]
    return arguments.first(*(arguments.at_least(flag, v, low) for flag, v, low in counts),
                           arguments.positive_seconds("--budget-s", args.budget_s),
                           "--tiny: run with TRITON_INTERPRET=1 (the Triton kernels in the interpreter on the CPU)"
                           if args.tiny and os.environ.get("TRITON_INTERPRET") != "1" else None,
                           arguments.writable_file("--out", args.out),
                           arguments.writable_file("--summary", args.summary))


def main(argv: list[str] | None = None) -> int:
    """Run the bench (anchor-3b on CUDA, or --tiny on the CPU), print the table last, write --out / --summary."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="JSON report")
    ap.add_argument("--summary", help="the table as text")
    ap.add_argument("--tiny", action="store_true", help="smoke run: tiny zoo model, CPU, fp32, graphs off "
                    "(TRITON_INTERPRET=1), seconds; not a measurement")
    ap.add_argument("--mode", default="async", choices=("async", "legacy"))
    ap.add_argument("--requests", type=int, default=Workload.requests)
    ap.add_argument("--prefix", type=int, default=Workload.prefix, help="shared prefix tokens")
    ap.add_argument("--osl", type=int, default=Workload.osl)
    ap.add_argument("--rows", type=int, default=Workload.rows, help="max_requests")
    ap.add_argument("--k", type=int, default=Workload.k)
    ap.add_argument("--reps", type=int, default=3, help="timed runs per mode for the cost")
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip comparisons started after this")
    args = ap.parse_args(argv)
    problem = argument_problem(args)
    if problem:
        return arguments.refuse(problem)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
                    "tiny": args.tiny}
    t0 = time.perf_counter()
    if args.tiny:
        model, w, graphs, reps = tiny_model(), TINY, False, 1
        report.update(model="zoo bamba M* (tiny)", device="cpu", dtype="float32")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs CUDA (anchor-3b, bf16); on the CPU use --tiny with TRITON_INTERPRET=1")
        from fastpath.engine.configs import named_config, random_device_weights
        cfg, dev = named_config("anchor-3b"), torch.device("cuda")
        tensors = random_device_weights(cfg, dev, torch.bfloat16)
        model = FastModel(cfg, tensors, dev, torch.bfloat16)
        del tensors                               # the model holds what it needs (fused q/k/v, gate/up)
        free_cache(dev)
        w = dataclasses.replace(Workload(), requests=args.requests, prefix=args.prefix, osl=args.osl,
                                rows=args.rows, k=args.k)
        graphs, reps = True, args.reps
        report.update(model="anchor-3b (random weights)", device=torch.cuda.get_device_name(), dtype="bfloat16")
    rep = invariant_bench(model, w, args.mode, graphs, reps, args.budget_s)
    report.update(rep, wall_s=time.perf_counter() - t0)
    head = (f"{report['model']} {report['dtype']} on {report['device']}, {args.mode}, graphs "
            f"{'on' if graphs else 'off'}: {w.requests} requests, {w.prefix}-token shared prefix, prompts "
            f"{min(rep['prompt_lens'])}-{max(rep['prompt_lens'])}, osl {min(rep['osl'])}-{max(rep['osl'])}, arrivals "
            f"every {w.stagger} steps, {w.rows} rows, budget {w.budget()}, prefill_chunk {w.prefill_chunk}; "
            f"{report['wall_s']:.0f} s" + (" (tiny smoke run: not a measurement)" if args.tiny else ""))
    lines = [head] + table(rep)
    print("\n".join(lines), flush=True)
    for path, text in ((args.out, json.dumps(report, indent=1, default=str)), (args.summary, "\n".join(lines) + "\n")):
        if path:
            with open(path, "w") as f:
                f.write(text)
    return 1 if any("FAILED" in e for e in rep["errors"]) or "error" in rep.get("cost", {}) else 0


if __name__ == "__main__":
    raise SystemExit(main())
