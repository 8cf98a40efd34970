"""Tensor-parallel sharding defects of the public reports: each mutates fastpath/tp.py and is judged by qualify
run at `--tp 2` (blind stage `qualify-tp`, two gloo ranks on CPU) and by the TP=2 == TP=1 tests."""
from __future__ import annotations

from hybridqual.mutants.runner import Mutant

TP = "fastpath/tp.py"
T_TP = "tests/test_tp.py::test_tp2_equals_tp1_trained_and_moe_models_fast"

_SPAN_GUARD = ("        if self.span_group is None:\n"
               "            return super()._gated_norm(y, z, weight)\n")

TP_SHARDING: list[Mutant] = [
    Mutant("tp_mamba_out_proj_not_reduced", "tensor parallel",
           "SGLang PR #14811: the all-reduce after the Mamba mixer's row-parallel out-projection is missing, so each "
           "rank adds only its own heads' partial sum to the residual stream (GSM8K 0.000 at TP 8)",
           TP, '        self._reduce = {f"layers.{i}.mamba.out_proj" for i in config.mamba_layer_ids}\n',
           "        self._reduce = set()\n",
           (T_TP,)),
    Mutant("tp_gated_norm_group_size_unsharded", "tensor parallel",
           "state-spaces/mamba PR #908 / #916: the gated RMSNorm's group size is the sharded d_ssm over the UNSHARDED "
           "n_groups, W times too small under TP: each rank normalises over n_groups / W times more, smaller groups",
           TP, _SPAN_GUARD,
           "        if self.span_group is None:\n"
           "            from fastpath.engine import ops\n"
           "            return ops.rms_norm_gated(y, z, weight, self.full_config.mamba_n_groups, c.norm_eps,\n"
           "                                      backend=self.backend)\n",
           (T_TP,)),
    Mutant("tp_replicated_group_norm_not_reduced", "tensor parallel",
           "vLLM PR #55091 (TP a multiple of n_groups, each group replicated over adjacent ranks): a rank treats its "
           "share of a replicated group as the whole group, so the gated norm's sum of squares is not reduced over "
           "the ranks that hold it",
           TP, "        ss = self.all_reduce(ss)[:, self.span_group:self.span_group + 1]\n",
           "        ss = ss[:, self.span_group:self.span_group + 1] * self.tp\n",
           (T_TP,)),
]
