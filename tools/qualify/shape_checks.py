"""Did the instance reach its shape on the engine? A scenario instantiated under an engine's step rule promises
prompts that end with last pieces of given lengths (tools/scenarios/tails.py, Instance.shape); the engine's own
schedule log or schedule facts show whether they did. Reached: a PASS line naming the pieces. Not reached, or not
visible (the engine reports no pieces): a SKIP saying why, so a short-piece scenario that never made its short
pieces is never a silent PASS of the checks that rely on them.
"""
from __future__ import annotations

from hybridqual.qualify.context import CheckContext
from hybridqual.qualify.report import Check
from hybridqual.scenarios.step_rule import observed_pieces


def check_shape(ctx: CheckContext) -> Check | None:
    """The shape line of one mode; None for instances that promise no shape."""
    shape = getattr(ctx, "shape", None)
    if not shape or not shape.get("last_pieces"):
        return None
    promised: dict[str, int] = dict(shape["last_pieces"])
    wanted = sorted(set(promised.values()))
    unreachable = list(shape.get("unreachable", []))
    rule = shape.get("rule", "?")
    note = (f"; lengths {unreachable} are unreachable under the rule (no group of prompts within the trace's slots "
            "ends with one)" if unreachable else "")
    seen = observed_pieces(ctx.trace, ctx.run)
    if seen is None:
        return ctx.skip(f"the engine reports neither a schedule log nor schedule facts, so whether its prompts ended "
                        f"with last pieces of {wanted} tokens (promised under the step rule {rule}) cannot be "
                        f"seen{note}")
    prompts = {r.id: len(r.prompt) for r in ctx.trace.requests}
    got: dict[str, list[int]] = {}
    for rid in promised:
        got[rid] = [p.count for p in seen.get(rid, [])]
    reached = {n for rid, n in promised.items()
               if len(got[rid]) >= 2 and got[rid][-1] == n and sum(got[rid]) == prompts[rid]}
    missing = [n for n in wanted if n not in reached]
    pieces = ", ".join(f"{rid} {'+'.join(map(str, got[rid])) or 'no piece'}" for rid in promised)
    if missing:
        return ctx.skip(f"the engine's pieces did not end prompts with {missing}-token pieces ({pieces}; promised "
                        f"under the step rule {rule}): the checks of this instance did not see those short pieces"
                        f"{note}; declare the engine's rule (Capabilities.step_rule) or pass --engine-budget")
    return ctx.line(True, f"last pieces of {wanted} tokens happened: {pieces} (step rule {rule}){note}")
