"""Model corners the other shipped models never set (goldens/models/zoo-corners: one SSM group, d_conv 3, dt below
time_step_min on half the heads; zoo-nemotron_h_hd32: attention head dim 32): engines that get one wrong. Each is
killed by qualify's main job alone, on the default plan's zoo-corners or zoo-nemotron_h_hd32 instance
(tools/scenarios/plan.py DEFAULT_PLAN)."""
from __future__ import annotations

from hybridqual.mutants.runner import Mutant
from hybridqual.mutants.zoo_paths import K, MODEL

T_CORNERS = "tests/test_zoo_corners.py::test_the_corner_model_through_the_engine_equals_the_oracle"
_FLOOR = "(max(c.dt_limit[0], 1e-3), c.dt_limit[1])"

CORNERS: list[Mutant] = [
    Mutant("dt_floored_at_time_step_min", "model corners",
           "HF PR #48989 (Nemotron-H): dt clamped to (time_step_min, inf) = (0.001, inf) instead of the config's "
           "time_step_limit (0, inf), in the prefill scan and the decode step; no other shipped model has a dt "
           "below 0.001, so only zoo-corners sees it",
           MODEL, "dt_limit=c.dt_limit, out=y[:n],", f"dt_limit={_FLOOR}, out=y[:n],",
           (T_CORNERS,), more=((MODEL, "c.chunk_size, dt_limit=c.dt_limit, out=y[n:],",
                                f"c.chunk_size, dt_limit={_FLOOR}, out=y[n:],"),)),
    Mutant("gated_norm_assumes_two_groups", "model corners",
           "the gated RMSNorm's group count fixed at 2 (every other shipped model's n_groups): a one-group model "
           "is normalised in two halves of d_inner where its config asks for one (where the norm is not folded "
           "into the decode step)",
           MODEL, "ops.rms_norm_gated(y, z, weight, c.mamba_n_groups, c.norm_eps, backend=self.backend)",
           "ops.rms_norm_gated(y, z, weight, 2, c.norm_eps, backend=self.backend)",
           (T_CORNERS,)),
    Mutant("conv_step_assumes_width_four", "model corners",
           "a decode conv kernel built for d_conv 4 only (the width every other shipped model has, and the one "
           "width some engines' decode conv kernels are specialised for): run on a d_conv 3 model it reads a fourth "
           "tap and a third window entry from the next channel's weights and window",
           K + "conv1d.py", "K=K, KW=next_pow2(K - 1), HAS_BIAS=bias is not None, SILU=silu, BLOCK_D=rule",
           "K=4, KW=next_pow2(3), HAS_BIAS=bias is not None, SILU=silu, BLOCK_D=rule",
           ("tests/test_kernel_conv1d.py::test_conv1d_step_rows_match_oracle_and_pad_rows_touch_nothing",)),
    Mutant("kv_write_tile_assumes_head_dim_16", "model corners",
           "the K/V cache write's tile fixed at 16 values a head (the width every other shipped model's head dim, 8 "
           "or 16, rounds to; real engines' attention kernels are specialised per head dim and some refuse below "
           "32: docs/findings.md V2): with head dim 32 only the first 16 values of each head's K and V reach the "
           "cache, the rest stay zero",
           K + "attention.py", "BLOCK_D=next_pow2(head_dim, 16), BLOCK_DQ=dq",
           "BLOCK_D=16, BLOCK_DQ=dq",
           ("tests/test_kernel_attention.py::test_attention_prefill_pieces_then_decode_match_oracle",)),
]
