"""The prefix-cache section of tools/bench/engine.py (DESIGN §8, §12): TTFT of a short suffix after a long
shared prefix, cold vs a prefix-cache hit, and where a hit's time goes (stages; torch.profiler's top kernels).

    python -m hybridqual.bench.engine --prefix-cache [--out F --summary F]       # anchor-3b, one GPU
    TRITON_INTERPRET=1 python -m hybridqual.bench.engine --prefix-cache --tiny    # smoke run of this code path, CPU
"""
from __future__ import annotations

import gc
import os
import time

from pathlib import Path

import torch

from fastpath.engine.configs import named_config
from fastpath.engine.engine import Engine
from fastpath.model import FastModel
from oracle.trace import EngineConfig, Request


def _ttft(eng: Engine, rid: str, prompt: tuple[int, ...]) -> float:
    """Seconds from submitting a one-token request to its token on the host (legacy steps until it is appended)."""
    sync(eng.device)
    t0 = time.perf_counter()
    eng.add_request(Request(rid, eng.k, prompt, 1))
    while not eng.requests[rid].output:
        eng.step()
    sync(eng.device)
    return time.perf_counter() - t0


def sync(dev: torch.device) -> None:
    """Wait for the device (no-op on CPU)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def free_cache(dev: torch.device) -> None:
    """Collect garbage and return the caching allocator's unused blocks (between benchmark cases)."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


class _Stages:
    """Host wall time and (on CUDA) device time between events of wrapped calls, per stage name, in call order."""

    def __init__(self, dev: torch.device):
        self.cuda = dev.type == "cuda"
        self.dev = dev
        self.rows: list[tuple[str, float, object, object]] = []
        self._undo: list = []

    def wrap(self, obj, attr: str, name: str) -> None:
        """obj.attr := a timed wrapper (restore() puts back what was there)."""
        real = getattr(obj, attr)

        def timed(*a, **k):
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.cuda else [None, None]
            i = len(self.rows)
            self.rows.append((name, 0.0, None, None))              # listed in start order
            if ev[0] is not None:
                ev[0].record()
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                if ev[1] is not None:
                    ev[1].record()
                self.rows[i] = (name, time.perf_counter() - t0, *ev)
        self._undo.append((obj, attr, real, attr in vars(obj)))
        setattr(obj, attr, timed)

    def restore(self) -> None:
        """Undo every wrap (an instance's bound method: drop the instance attribute again)."""
        for obj, attr, real, own in reversed(self._undo):
            if own:
                setattr(obj, attr, real)
            else:
                delattr(obj, attr)
        self._undo = []

    def table(self) -> list[dict]:
        sync(self.dev)
        return [{"stage": n, "host_ms": 1e3 * h, "device_ms": a.elapsed_time(b) if a is not None else None}
                for n, h, a, b in self.rows]


def hit_breakdown(eng: Engine, prompt: tuple[int, ...], rid: str, suffix: int) -> dict:
    """One more prefix-cache hit with its stages timed: validation (add_request), lookup + restore (the prefix
    cache's admit, its device copy inside), the forward, sampling, the token's wait on the host."""
    import fastpath.engine.engine as engine_mod
    st = _Stages(eng.device)
    st.wrap(eng, "add_request", "add_request (validate the prompt)")
    st.wrap(eng.prefix, "lookup", "prefix lookup (hash the prompt's blocks)")
    st.wrap(eng.bank, "copy_state", "restore (checkpoint -> slot: Mamba state + prefix KV)")
    st.wrap(eng.prefix, "admit", "admit total (lookup + restore)")
    st.wrap(eng.model, "forward", f"forward ({suffix}-token prefill over the restored context)")
    if eng.prefill_graphs is not None:
        st.wrap(eng.prefill_graphs, "forward", "prefill graph step (replay: ids copy + graph launch)")
    st.wrap(engine_mod, "sample_rows", "sample")
    st.wrap(eng, "resolve", "resolve (wait for the token, append)")
    try:
        wall = _ttft(eng, rid, prompt)
    finally:
        st.restore()
    return {"wall_ms": 1e3 * wall, "stages": st.table()}


def hit_profile(eng: Engine, prompt: tuple[int, ...], rid: str, top: int = 10) -> dict:
    """torch.profiler over one more hit: the top kernels by device time (CPU ops by self time on a CPU run),
    kernel launches, and the host syncs (cudaStreamSynchronize / cudaDeviceSynchronize / cudaMemcpy) of the TTFT."""
    from torch.profiler import ProfilerActivity, profile
    cuda = eng.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        _ttft(eng, rid, prompt)
    agg: dict[str, list[float]] = {}
    syncs: dict[str, int] = {}
    for e in prof.events():
        if "ynchronize" in e.name or e.name == "cudaMemcpy":
            syncs[e.name] = syncs.get(e.name, 0) + 1
        on_dev = e.device_type == torch.autograd.DeviceType.CUDA
        if on_dev == cuda and (not cuda or not e.name.startswith("Memset")):
            a = agg.setdefault(e.name, [0, 0.0])
            a[0] += 1
            a[1] += e.time_range.elapsed_us() if cuda else e.self_cpu_time_total
    rows = sorted(((n, c, us) for n, (c, us) in agg.items()), key=lambda r: -r[2])
    return {"by": "device" if cuda else "cpu self", "total_us": sum(r[2] for r in rows),
            "events": sum(r[1] for r in rows), "syncs": syncs, "top": [list(r) for r in rows[:top]]}


def hit_host_profile(eng: Engine, prompt: tuple[int, ...], rid: str, top: int = 12) -> dict:
    """cProfile over one more hit: where the host's time goes (the hit's eager forward is host-bound:
    docs/performance.md, "Choices the code makes") — the top functions by own time, as 'file:line(function)'."""
    import cProfile
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    try:
        _ttft(eng, rid, prompt)
    finally:
        pr.disable()
    st = pstats.Stats(pr)
    rows = sorted(((f"{Path(f).name}:{ln}({fn})", cc, tt) for (f, ln, fn), (cc, nc, tt, ct, _) in st.stats.items()),
                  key=lambda r: -r[2])
    return {"total_ms": 1e3 * sum(r[2] for r in rows), "top": [list(r) for r in rows[:top]]}


def prefix_ttft(model: FastModel, prefix_len: int = 32768, suffix: int = 100, block: int = 16384,
                chunk: int = 16384, hits: int = 3, detail: bool = True) -> dict:
    """Time to first token of a `suffix`-token suffix after a `prefix_len`-token shared prefix (DESIGN
    §8): cold (cache off; and cache on, which also stores the checkpoints) vs a prefix-cache hit, same run — the
    hit eager, and with prefill graphs (an engine with prefill_graphs=True: its cold run stores, one warm-up hit
    of the same shape captures the step, the timed hits replay it); plus the bytes of one checkpoint beside the
    KV bytes of the prefix it covers; detail: one more hit (graph) timed by stage, under torch.profiler and under
    cProfile, and one more eager hit by stage (hit_breakdown, hit_profile, hit_host_profile)."""
    from oracle.trace import PrefixCacheConfig
    c = model.config
    free_cache(model.device)
    prefix = tuple((13 * j + 7) % c.vocab_size for j in range(prefix_len))
    tail = lambda i: tuple((17 * j + 101 * i + 3) % c.vocab_size for j in range(suffix))   # noqa: E731
    max_len = prefix_len + suffix + 8
    on = Engine(model, EngineConfig(1, chunk, chunk, "legacy", prefix_cache=PrefixCacheConfig(block, 2)),
                max_len=max_len)
    off = Engine(model, EngineConfig(1, chunk, chunk, "legacy"), max_len=max_len)
    _ttft(off, "warm", tuple((5 * j + 1) % c.vocab_size for j in range(2 * chunk + suffix)))   # JIT + allocator
    cold_off = [_ttft(off, f"cold{i}", prefix + tail(i)) for i in range(2)]
    cold_on = _ttft(on, "cold", prefix + tail(0))                # stores the 16k and 32k checkpoints
    hit = [_ttft(on, f"hit{i}", prefix + tail(i + 1)) for i in range(hits)]
    on_g = Engine(model, EngineConfig(1, chunk, chunk, "legacy", prefix_cache=PrefixCacheConfig(block, 2)),
                  max_len=max_len, prefill_graphs=True)
    _ttft(on_g, "cold", prefix + tail(0))                      # stores; its last piece is the hit's shape (1st sight)
    warm = [_ttft(on_g, f"warm{i}", prefix + tail(i + 1)) for i in range(2)]   # eager + capture; a first replay
    ghit = [_ttft(on_g, f"hit{i}", prefix + tail(i + 3)) for i in range(hits)]
    b = on.bank
    state = (b.conv_state[:, 0].numel() * b.conv_state.element_size()
             + b.ssm_state[:, 0].numel() * b.ssm_state.element_size())
    kv_tok = 2 * len(c.attention_layer_ids) * c.n_kv_heads * c.attn_head_dim * b.k_cache.element_size()
    attn = named_config("anchor-3b-attn")
    kv_attn_tok = 2 * len(attn.attention_layer_ids) * attn.n_kv_heads * attn.attn_head_dim * b.k_cache.element_size()
    res = {"prefix": prefix_len, "suffix": suffix, "block": block, "chunk": chunk,
           "ttft_cold_off_s": min(cold_off), "ttft_cold_on_s": cold_on,
           "ttft_hit_eager_s": sorted(hit)[len(hit) // 2], "ttft_hits_eager_s": hit,
           "ttft_hit_s": sorted(ghit)[len(ghit) // 2], "ttft_hits_s": ghit, "ttft_graph_warmup_s": warm,
           "checkpoint_state_bytes": state, "checkpoint_kv_bytes": prefix_len * kv_tok,
           "pool_slot_bytes": state + max_len * kv_tok, "attn_only_prefix_kv_bytes": prefix_len * kv_attn_tok}
    res["speedup"] = res["ttft_cold_off_s"] / res["ttft_hit_s"]
    res["speedup_eager"] = res["ttft_cold_off_s"] / res["ttft_hit_eager_s"]
    pg = on_g.prefill_graphs
    res["prefill_graphs"] = {"captures": pg.captures, "replays": pg.replays, "reuses": pg.reuses}
    if detail:
        n = hits + 3
        for key, fn in (("hit_stages", lambda: hit_breakdown(on_g, prefix + tail(n + 1), "hit-stages", suffix)),
                        ("hit_profile", lambda: hit_profile(on_g, prefix + tail(n + 2), "hit-profile")),
                        ("hit_host", lambda: hit_host_profile(on_g, prefix + tail(n + 3), "hit-host")),
                        ("hit_stages_eager", lambda: hit_breakdown(on, prefix + tail(n + 4), "hit-stages", suffix))):
            try:
                res[key] = fn()
            except Exception as e:  # noqa: BLE001 - the headline figure above must still be reported
                res[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
    for key, bi in (("buckets", False), ("buckets_bi", True)):
        try:
            res[key] = bucket_hits(model, prefix, tail, suffix, block, chunk, max_len, hits, batch_invariant=bi)
        except Exception as e:  # noqa: BLE001 - reported as a failed section, the rows above stand
            res[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
    res["cached_tokens"] = [a["cached_tokens"] for s in on.log.to_json()["steps"] for a in s["admit"]]
    res["cached_tokens_graphs"] = [a["cached_tokens"] for s in on_g.log.to_json()["steps"] for a in s["admit"]]
    del on, off, on_g
    free_cache(model.device)
    return res


def bucket_hits(model: FastModel, prefix: tuple[int, ...], tail, suffix: int, block: int, chunk: int, max_len: int,
                hits: int = 3, batch_invariant: bool = True) -> dict:
    """The first hit of a never-seen suffix length vs a warm hit (the same length again), with bucketed prefill
    graphs (prefill_buckets, captured at engine start) on `model` in the default or the batch-invariant mode (same
    weights); beside them that model's eager hit (cache on, no prefill graphs). Goal: first / warm <= 2."""
    from fastpath.engine.engine import engine_class
    from fastpath.engine.prefill_buckets import default_buckets
    from oracle.trace import PrefixCacheConfig
    m = model.with_options(batch_invariant=batch_invariant)
    cls, cs = engine_class(m.options), model.config.chunk_size
    buckets = default_buckets(cs, min(512, chunk))
    top = buckets[-1] - 1                                    # longest suffix a bucket serves
    lengths = [n for n in dict.fromkeys((min(suffix + 7, top), max(1, suffix // 2 + 1), min(3 * suffix, top)))]
    max_len = max(max_len, len(prefix) + max(lengths) + 8, buckets[-1] + cs)
    ec = EngineConfig(1, chunk, chunk, "legacy", prefix_cache=PrefixCacheConfig(block, 2))
    t0 = time.perf_counter()
    eng = cls(m, ec, max_len=max_len, prefill_graphs=True, prefill_buckets=buckets)
    build_s = time.perf_counter() - t0
    eager = cls(m, ec, max_len=max_len)
    for e in (eng, eager):
        _ttft(e, "cold", prefix + tail(0))                   # stores the checkpoints; its last piece: `suffix`
    cold_eager = eng.prefill_graphs.eager                   # the cold request's long pieces (no bucket)
    cold_storing = eng.prefill_graphs.buckets.storing       # its bucket pieces storing a checkpoint inside (eager)
    pre = lambda i, n: prefix + (tail(i) * (n // len(tail(i)) + 1))[:n]   # noqa: E731
    first = [_ttft(eng, f"first{n}", pre(10 + k, n)) for k, n in enumerate(lengths)]
    warm = [_ttft(eng, f"warm{i}", pre(20 + i, lengths[0])) for i in range(hits)]
    ehit = [_ttft(eager, f"eager{i}", pre(30 + i, lengths[0])) for i in range(hits)]
    pg = eng.prefill_graphs
    b = pg.buckets
    med = lambda ts: sorted(ts)[len(ts) // 2]   # noqa: E731
    res = {"mode": "batch-invariant" if batch_invariant else "default", "buckets": list(buckets), "lengths": lengths,
           "build_s": build_s, "ttft_first_s": first, "ttft_warm_s": warm, "ttft_warm_med_s": med(warm),
           "ttft_eager_s": ehit, "ttft_eager_med_s": med(ehit),
           "counts": {"runs": b.runs, "replays": b.replays, "captures": b.captures, "fallbacks": b.fallbacks,
                      "storing": b.storing, "eager_hits": pg.eager - cold_eager + b.storing - cold_storing},
           "nbytes": b.nbytes()}
    res["ratio"] = max(first) / res["ttft_warm_med_s"]
    del eng, eager
    free_cache(model.device)
    return res


def prefix_lines(r: dict) -> list[str]:
    """The prefix-cache section's summary: headline, checkpoint size, the hit's stages, the profiler's top table."""
    mib = lambda n: f"{n / 2**20:.1f} MiB"   # noqa: E731
    ms = lambda ts: ", ".join(f"{1e3 * t:.2f}" for t in ts)   # noqa: E731
    out = [f"prefix cache: {r['suffix']}-token suffix after a {r['prefix']}-token prefix (block {r['block']}): "
           f"TTFT cold {1e3 * r['ttft_cold_off_s']:.1f} ms (cache off; {1e3 * r['ttft_cold_on_s']:.1f} ms cache on, "
           f"storing); hit with the prefill graph {1e3 * r['ttft_hit_s']:.2f} ms (hits {ms(r['ttft_hits_s'])}; "
           f"warm-up: capture {ms(r['ttft_graph_warmup_s'])}) -> {r['speedup']:.1f}x (goal >= 50x); "
           f"hit eager {1e3 * r['ttft_hit_eager_s']:.2f} ms (hits {ms(r['ttft_hits_eager_s'])}) -> "
           f"{r['speedup_eager']:.1f}x; graphs {r['prefill_graphs']}; cached_tokens {r['cached_tokens']} / "
           f"{r['cached_tokens_graphs']}",
           f"prefix cache: one checkpoint = Mamba state {mib(r['checkpoint_state_bytes'])} + prefix KV "
           f"{mib(r['checkpoint_kv_bytes'])} (pool slot {mib(r['pool_slot_bytes'])} at max_len); the same prefix's KV "
           f"in anchor-3b-attn: {mib(r['attn_only_prefix_kv_bytes'])}"]
    for key in ("buckets", "buckets_bi"):
        _bucket_section(out, r.get(key, {}), ms, mib)
    _section(out, r.get("hit_stages", {}), "hit stages",
             lambda d: f"hit stages (one more hit, wall {d['wall_ms']:.2f} ms; host = wall time inside the call, "
                       f"device = between CUDA events around it):",
             lambda d: [f"  host {row['host_ms']:9.3f} ms  device "
                        f"{'' if row['device_ms'] is None else format(row['device_ms'], '9.3f'):>9s} ms  {row['stage']}"
                        for row in d["stages"]])
    _section(out, r.get("hit_stages_eager", {}), "hit stages (eager)",
             lambda d: f"hit stages, eager (one more hit, wall {d['wall_ms']:.2f} ms):",
             lambda d: [f"  host {row['host_ms']:9.3f} ms  device "
                        f"{'' if row['device_ms'] is None else format(row['device_ms'], '9.3f'):>9s} ms  {row['stage']}"
                        for row in d["stages"]])
    _section(out, r.get("hit_profile", {}), "hit profile",
             lambda d: f"hit profile (one more hit, torch.profiler, by {d['by']} time): {d['events']} events, "
                       f"{d['total_us'] / 1e3:.3f} ms total; syncs {d['syncs']}; top {len(d['top'])}:",
             lambda d: [f"  {us / 1e3:9.3f} ms {cnt:5d}x  {name[:100]}" for name, cnt, us in d["top"]])
    _section(out, r.get("hit_host", {}), "hit host profile",
             lambda d: f"hit host profile (one more hit, cProfile, own time; {d['total_ms']:.1f} ms with the "
                       f"profiler's overhead): top {len(d['top'])}:",
             lambda d: [f"  {1e3 * tt:9.3f} ms {cc:6d}x  {name[:100]}" for name, cc, tt in d["top"]])
    return out


def _bucket_section(out: list[str], d: dict, ms, mib) -> None:
    """One bucket_hits result: the ratio against the goal, then each first hit, the warm and the eager hit."""
    _section(out, d, "bucketed prefill graphs",
             lambda d: f"bucketed prefill graphs ({d['mode']} model, buckets {d['buckets']}, "
                       f"built + captured in {d['build_s']:.2f} s, {mib(d['nbytes'])}): first hit of a never-seen "
                       f"suffix length vs a warm hit -> {d['ratio']:.2f}x (goal <= 2x); counts {d['counts']}",
             lambda d: [f"  first hit, suffix {n:5d} (never seen): {1e3 * t:9.2f} ms"
                        for n, t in zip(d["lengths"], d["ttft_first_s"])]
             + [f"  warm hit,  suffix {d['lengths'][0]:5d}: {1e3 * d['ttft_warm_med_s']:9.2f} ms (hits "
                f"{ms(d['ttft_warm_s'])})",
                f"  eager hit (no prefill graphs), suffix {d['lengths'][0]}: {1e3 * d['ttft_eager_med_s']:9.2f} ms "
                f"(hits {ms(d['ttft_eager_s'])})"])


def _section(out: list[str], d: dict, what: str, head, rows) -> None:
    """One optional part of the summary: 'WHAT FAILED error' if it raised, else its header line and rows."""
    if "error" in d:
        out.append(f"{what} FAILED {d['error']}")
    elif d:
        out.append(head(d))
        out += rows(d)


def tiny_prefix_model(dev: torch.device) -> FastModel:
    """A tiny seeded hybrid (oracle zoo bamba, attention at layer 1) for the --tiny smoke run of --prefix-cache."""
    from oracle import zoo
    cfg = zoo.tiny_config("bamba", pattern="M*", hidden_size=16, mamba_n_heads=2, mamba_n_groups=1, n_attn_heads=2,
                          n_kv_heads=1)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return FastModel(cfg, zoo.random_weights(cfg, seed=3), dev, dtype)


def tiny_prefix(args, write) -> None:
    """--prefix-cache --tiny: the prefix-cache section end to end on a tiny model (64-token prefix, block and
    chunk 32, 5-token suffix) — on CPU through the Triton interpreter — so a GPU run does not die on a typo."""
    if not args.prefix_cache:
        raise SystemExit("--tiny: only with --prefix-cache")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--tiny without CUDA: run with TRITON_INTERPRET=1 (the kernels run in the interpreter)")
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": str(dev), "tiny": True}
    r = prefix_ttft(tiny_prefix_model(dev), prefix_len=64, suffix=5, block=32, chunk=32, hits=2)
    report["prefix_cache"] = r
    write(args, report, ["tiny smoke run (not a measurement)"] + prefix_lines(r))


