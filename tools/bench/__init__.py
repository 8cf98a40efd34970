"""Benchmarks on a GPU (`hybridqual bench NAME`): kernels, the engine, GEMMs, the dependent chain, ablations, TP,
prefix-cache TTFT and speculation, each printing its figures beside a roofline or a peer measured in the same run;
and `sass`, which needs no GPU: each kernel compiled for sm_90, its registers, spills and loop contents.

Owns every benchmark, `peak` (wall time and peak memory of a command), `timeline` (where a qualify run's time
goes, phase by phase: `bench qualify`), `arguments` (the value rules every bench checks before any work: a bad one is
exit 2 naming the flag) and `gpu_run.sh` (one command on a GPU machine: build, check, bench). A bench is a module
here with a top-level `main(argv: list[str] | None = None) -> int`: `hybridqual bench NAME` finds it with no list
to edit (tools/cli.py). May import oracle, fastpath, `hybridqual.qualify` / `hybridqual.paths` (for smoke runs) and
`hybridqual.adapters` (`bench qualify` times an engine's runs); nothing else imports it. Figures go to
docs/performance.md, never into tests.
"""
