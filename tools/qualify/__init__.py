"""Qualification: run scenario instances through an engine and judge it against the truth, a line per check.

Owns the runner (`runner`: the run and the plan; `arguments`: the command line and its value checks), the checks of one instance (`checks`, with `prefix_checks` and
`spec_checks` for the cache and speculation facts), the comparison rules (`compare`: tie-aware tokens, logits
bounds), where the truth comes from (`truth`: goldens, the in-memory or streamed oracle), parallel workers (`jobs`)
and the report (`report`: console lines, report.json, junit.xml). May import oracle, fastpath (through adapters),
`hybridqual.adapters`, `hybridqual.scenarios`, `hybridqual.goldens` and `hybridqual.paths`; nothing imports it but
the CLI, the pytest plugin, replay, the benches and the mutant runner.
"""
