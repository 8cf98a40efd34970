"""The bug zoo (DESIGN §9): each entry is one realistic engine/kernel defect and the fast tests expected to kill it.

Patches are anchored on stable lines and must match exactly once (tests/test_mutants.py checks that every
patch still applies, so a refactor that moves an anchor is caught at once). Tests are listed fastest first;
the runner stops at the first failure (-x).

The entries live in family modules (zoo_engine, zoo_kernels, zoo_model, zoo_prefix, zoo_spec, zoo_reports, zoo_2026;
the files and test ids they name in zoo_paths). This module fixes their order in MUTANTS, which the blind rotation's windows
follow, and the CI subset QUICK.
"""
from __future__ import annotations

from hybridqual.mutants import (zoo_2026, zoo_corners, zoo_engine, zoo_kernels, zoo_model, zoo_prefix, zoo_reports,
                                zoo_spec, zoo_tp, zoo_transfer)
from hybridqual.mutants.runner import Mutant

MUTANTS: list[Mutant] = [
    *zoo_engine.ROW_TABLE, *zoo_engine.ADMISSION, *zoo_engine.CHUNKED_PREFILL,
    *zoo_kernels.CONV_SSM, *zoo_kernels.PAD_ROWS, *zoo_kernels.ATTENTION_KV, *zoo_kernels.SAMPLING,
    *zoo_kernels.OFFSETS, *zoo_kernels.BATCH_INVARIANCE, *zoo_kernels.GEMV_FOLDS,
    *zoo_engine.ASYNC_FINISHING, *zoo_model.ARCHITECTURE, *zoo_engine.ORACLE_SCHEDULER,
    # classes the blind run found
    *zoo_engine.SCHEDULING_ORDER, *zoo_engine.BUDGET_EDGES, *zoo_model.LOGIT_TRANSFORMS, *zoo_engine.SAMPLER_KEYS,
    *zoo_model.MULTIPLIERS, *zoo_kernels.NORM_EPS, *zoo_kernels.HEAD_MAPPING,
    *zoo_prefix.PREFIX_CACHE,
    *zoo_spec.SPECULATIVE,
    *zoo_reports.PUBLIC_REPORTS,
    *zoo_tp.TP_SHARDING,
    *zoo_2026.PREFIX_SPEC, *zoo_2026.PREEMPTION, *zoo_2026.STATE_PRECISION, *zoo_2026.GEOMETRY,
    *zoo_transfer.TRANSFER,
    *zoo_corners.CORNERS,
]

# The CI subset (tests/test_mutants.py): fast kills covering compaction, pad rows, sampling, async and offsets.
QUICK = {
    "compact_slot_not_moved", "hole_fill_off_by_one", "pending_outputs_not_compacted", "async_extra_token_appended",
    "ties_highest_index", "argmax_after_bf16_cast", "chunk_offsets_int32", "chunk_table_restarts_at_piece",
    "graph_pad_rows_slot_zero", "ssm_step_pad_aliases_slot0", "chunked_drops_initial_state",
}
