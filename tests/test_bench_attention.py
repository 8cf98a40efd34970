"""The attention bench's arguments and lines (tools/bench/attention.py); its timings run on a GPU only."""
from __future__ import annotations

from hybridqual.bench import attention


def test_bench_attention_refuses_an_unknown_variant_naming_it(capsys):
    assert attention.main(["--only", "rule,nosuch"]) == 2
    err = capsys.readouterr().err
    assert "--only nosuch: not one of " in err and "m128_w8" in err


def test_bench_attention_lines_say_bits_against_the_rule_and_failures():
    rows = [{"shape": "L8192", "variant": "rule", "ms": 2.0, "tflops": 100.0, "bitwise": True, "max_abs_diff": 0.0},
            {"shape": "L8192", "variant": "m128_w8", "ms": 1.0, "tflops": 200.0, "bitwise": False,
             "max_abs_diff": 3e-3},
            {"shape": "L8192", "variant": "torch SDPA (peer)", "ms": 0.5, "tflops": 400.0},
            {"shape": "L8192", "variant": "m128_n128_w8", "error": "OutOfResources: shared memory"}]
    got = attention.lines(rows)
    assert got[0].endswith("bitwise") and "max|Δ| 3.00e-03" in got[1] and "400.0 TFLOP/s" in got[2]
    assert "FAILED OutOfResources" in got[3]
    assert attention._flops(0, 2) == 4.0 * attention.HQ * attention.HD * 3
    assert attention._flops(0, 2, 128) == 4.0 * attention.HQ * 128 * 3


def test_bench_attention_refuses_a_head_dim_it_cannot_run_naming_it(capsys):
    assert attention.main(["--head-dim", "81"]) == 2
    assert "--head-dim 81" in capsys.readouterr().err
