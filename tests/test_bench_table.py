"""tools/bench/table.py turns a `bench kernels` JSON file into the docs' markdown rows, and refuses a malformed one."""
from __future__ import annotations

import json

from hybridqual.bench import table


def _write(tmp_path, data) -> str:
    path = tmp_path / "bench_kernels.json"
    path.write_text(json.dumps(data))
    return str(path)


def _kernels_file(tmp_path) -> str:
    rows = [dict(name="ssd_prefill L65536 [rule]", ms=3.731, TBps=0.6, TFLOPs=150.0, floor_ms=0.730, peer_ms=5.534,
                 note=""),
            dict(name="greedy_sample R256 V32000 bf16", ms=0.019, TBps=1.0, TFLOPs=0.0, floor_ms=0.004, peer_ms=None,
                 note="")]
    return _write(tmp_path, dict(ceilings=dict(copy_TBps=3.04, bf16_gemm_TFLOPs=723.0), rows=rows,
                                 device="GPU-X", torch="2.11", date="2026-12-06 21:58 UTC"))


def test_every_row_becomes_one_markdown_line_with_its_peer_ratio(tmp_path, capsys):
    assert table.main([_kernels_file(tmp_path), "--command", "STEPS=speed bash tools/bench/gpu_run.sh"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| kernel | card |") and len(out) == 4
    assert out[2] == ("| ssd_prefill L65536 [rule] | GPU-X | 3.731 ms | 0.730 ms (copy 3.04 TB/s) | 5.534 ms (1.48×) "
                      "| 2026-12-06 21:58 UTC, `STEPS=speed bash tools/bench/gpu_run.sh` |")
    assert "| — |" in out[3]


def test_a_file_without_a_required_field_exits_2_naming_it(tmp_path, capsys):
    path = _write(tmp_path, dict(ceilings=dict(copy_TBps=3.0), device="GPU-X", date="d",
                                 rows=[dict(name="k", floor_ms=1.0)]))
    assert table.main([path]) == 2
    err = capsys.readouterr().err
    assert "rows[0]" in err and "'ms'" in err


def test_a_mistyped_field_exits_2_naming_it(tmp_path, capsys):
    path = _write(tmp_path, dict(ceilings=dict(copy_TBps="fast"), device="GPU-X", date="d", rows=[]))
    assert table.main([path]) == 2
    assert "'copy_TBps'" in capsys.readouterr().err
