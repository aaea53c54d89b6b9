"""``benchmarks/report.py``: the op tables of docs/BENCHMARKS.md and the README, from a benchmark JSON."""

from __future__ import annotations

import json

from report import README_COLUMNS, main

MEASURED = ["eager", "inductor", "inductor_epc", "hand_fused", "hand_fused_bf16", "h3_fused_fp32", "h3_fused_bf16"]


def _rows(hidden=(5376,), tokens=(3072, 15808)) -> list[dict]:
    rows = []
    for h in hidden:
        for t in tokens:
            for i, variant in enumerate(MEASURED):
                rows.append(dict(device="H200", torch="2.11", triton="3.6", site="A", H=h, T=t, variant=variant,
                                 us=30.0 + i, us_graph=20.0 + i + h / 1024, roof_gbs=4000.0,
                                 roof_share=0.5 + i / 100, mismatch=0.0 if variant == "eager" else 3.2e-6))
            rows.append(dict(device="H200", torch="2.11", triton="3.6", site="A", H=h, T=t, variant="copy_same_bytes",
                             us_graph=18.2, roof_gbs=4000.0, roof_share=0.857))
    return rows


def _report(tmp_path, capsys, readme: bool, rows=None) -> list[str]:
    src = tmp_path / "ops.json"
    src.write_text(json.dumps(rows or _rows(hidden=(1024,))))
    main(str(src), readme)
    return capsys.readouterr().out.strip().splitlines()


def test_readme_table_has_the_readme_columns_and_the_mismatch_in_each_sites_first_row(tmp_path, capsys):
    header, rule, first, second = _report(tmp_path, capsys, readme=True)
    assert header == "| site | T | " + " | ".join(README_COLUMNS.values()) + " |"
    assert rule.count("---") == len(README_COLUMNS) + 2
    cells = [c.strip() for c in first.strip("|").split("|")]
    assert cells[:3] == ["A", "3,072", "18.2 us, 85.7%"]
    assert cells[-1] == "27.0 us, 56.0%, mm 3.2e-6"  # h3_fused_bf16: 20 + 6 + 1 us
    assert cells[3] == "21.0 us, 50.0%"  # eager: bit-identical to itself, no mismatch shown
    assert "mm" not in second


def test_benchmarks_table_has_every_variant_with_its_call_time(tmp_path, capsys):
    lines = _report(tmp_path, capsys, readme=False)
    assert lines[0] == "H200, torch 2.11, triton 3.6, copy bandwidth 4000 GB/s"
    assert lines[2] == "| site | T | " + " | ".join(MEASURED + ["copy_same_bytes"]) + " |"
    assert "27.0 us (56%), call 36 us, mm 3.2e-06" in lines[4]
    assert lines[4].endswith("| 18.2 us (86%) |")


def test_rows_of_several_hidden_sizes_get_an_h_column_and_their_own_rows(tmp_path, capsys):
    for readme in (True, False):
        lines = _report(tmp_path, capsys, readme, rows=_rows(hidden=(2048, 4096), tokens=(15808,)))
        table = lines if readme else lines[2:]
        assert table[0].startswith("| site | H | T | ") and table[1].startswith("|---|---|---|")
        assert [row.split("|")[2:4] for row in table[2:]] == [[" 2,048 ", " 15,808 "], [" 4,096 ", " 15,808 "]]
        assert "22.0 us" in table[2] and "24.0 us" in table[3]  # eager: 20 + H / 1024 us


def test_over_copy_table_gives_the_difference_and_the_ratio_of_increases_per_site(tmp_path, capsys):
    rows = [dict(site=site, T=t, variant=variant, us_graph=us)
            for site, t, copy, ours in [("A", 3072, 18.0, 20.0), ("A", 15808, 80.0, 83.1), ("B", 3072, 33.0, 35.5)]
            for variant, us in [("copy_same_bytes", copy), ("h3_fused_bf16", ours), ("eager", 100.0)]]
    src = tmp_path / "ops.json"
    src.write_text(json.dumps(rows))
    main(str(src), False, "h3_fused_bf16")
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "| site | T | copy, same bytes | h3_fused_bf16 | over the copy | increase against the copy's |"
    assert lines[2] == "| A | 3,072 | 18.0 us | 20.0 us | +2.0 us |  |"
    assert lines[3] == "| A | 15,808 | 80.0 us | 83.1 us | +3.1 us | 1.018 |"  # (83.1 - 20) / (80 - 18)
    assert lines[4] == "| B | 3,072 | 33.0 us | 35.5 us | +2.5 us |  |"  # no ratio across sites
