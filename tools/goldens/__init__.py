"""Golden outputs: regenerate them from the oracle (fp64) or check that the shipped ones still hold.

Owns `regen` (the goldens' records, their all-or-nothing writes, the random zoo models) and `streamed` (goldens of a
model too big for fp64 in memory, by streamed oracle passes). May import oracle, `hybridqual.paths`,
`hybridqual.scenarios` and `hybridqual.qualify.compare` / `hybridqual.qualify.truth` (the truth's loaders); never
the fast path: goldens come only from the oracle.
"""
