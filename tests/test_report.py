"""``mesh report`` (mesh.lab.report): small JSON results of every kind in, one markdown page each out,
replaced on every run; the kind is recognised from the keys; a file it cannot read fails the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mesh.lab.report import detect_kind, main

BROKER = {"rps": 8800.0, "baseline_rps": 14350.0, "ratio": 0.606, "p50_ms": 0.7, "p99_ms": 6.29, "workers": 64,
          "concurrency": 256, "seconds": 4.0, "errors": 0, "cpus": 2, "pinning": {"process_under_test": [0], "harness": [1]},
          "rounds": [{"rps": 8800.0, "baseline_rps": 14350.0, "p50_ms": 0.7, "p99_ms": 6.29}]}
ROUTING = {"decision": {"8": {"p50_us": 78.0, "p99_us": 150.0, "index_entries": 23936},
                        "64": {"p50_us": 106.0, "p99_us": 190.0, "index_entries": 193408}},
           "prompt_tokens": 8192, "block_size": 16, "apply_blocks_per_s": 587846, "bytes_per_block": 182.0,
           "p99_ratio_4096_vs_64": None}
_BACKEND = {"ingest_blocks_per_s": 233768, "apply_p50_ms": 0.8, "apply_p99_ms": 1.65, "match_p50_ms_client": 1.32,
            "match_p99_ms_client": 3.2, "match_p50_ms_server": 0.22, "match_p99_ms_server": 1.0, "bytes_per_block": 200}
INDEXER = {"workers": 1000, "indexed_blocks": 1050000, "ingest_blocks": 1050000, "prompt_blocks": 512,
           **_BACKEND, "backend": "memory",
           "backends": {"memory": _BACKEND, "valkey": {**_BACKEND, "ingest_blocks_per_s": 218145, "restart_seconds": 5.5,
                                                      "restart_entries": 1050000}}}
_SUM = {"n": 200, "p50": 2.18, "p90": 4.59, "p99": 7.09}
EXCHANGE = {"intervals_ms": [0, 5], "rounds": 2, "workers": 4, "probes_per_arm": 200, "background_rate_rps": 100.0,
            "by_interval": {"0": {"delay_ms": _SUM, "accept_ms": {"p50": 1.98}, "b_messages_per_s": [154.0, 157.0]},
                            "5": {"delay_ms": {**_SUM, "p50": 2.73}, "accept_ms": {"p50": 2.17}, "b_messages_per_s": [122.0]}},
            "ratios": {"5/0": {"p50": 1.25, "p99": 1.12}}}
HTTP = {"bench": "http",
        "config": {"arms": ["direct", "broker_adapters"], "concurrency": [1, 64], "seconds": 8.0, "path": "/generate",
                   "stream": False, "max_new_tokens": 8, "loadgen": "wrk"},
        "machine": {"cpus": 2, "loadavg_at_start": [0.6]},
        "arms": {"direct": {"status": "ok"}, "broker_adapters": {"status": "ok"}},
        "cells": [{"arm": "direct", "c": 1, "rps": 10148.0, "p50_ms": 0.09, "p99_ms": 0.36, "max_ms": 5.3,
                   "cpu_us_per_req": {"router": None, "adapters": None}},
                  {"arm": "broker_adapters", "c": 1, "rps": 976.0, "p50_ms": 0.98, "p99_ms": 2.0, "max_ms": 7.8,
                   "cpu_us_per_req": {"router": 518.0, "adapters": 191.0}}],
        "targets": [{"name": "full path p50", "c": 1, "op": "<=", "target": 1.0, "value": 0.98, "sglang_router": None,
                     "unit": "ms", "result": "PASS"}]}


def _arm(p95: float) -> dict:
    return {"ttft_p50_ms": p95 / 2, "ttft_p95_ms": p95, "goodput": 1.0, "hit_rate": 0.5, "worker_cv": 0.1}


_SUMMARY = {"cells": 1, "cells_all_targets": 1, "losing_cells": [], "targets_passed": {"ttft_p95": 1, "goodput": 1, "hit_rate": 1},
            "policies": {"power_of_two": {"win": 0, "within": 0, "lose": 1}, "cache_aware": {"win": 1, "within": 0, "lose": 0}},
            "routers": []}
MATRIX_COMPACT = {"summary": _SUMMARY, "cells": [{
    "label": "zipf L1 W16 R4",
    "seeds": {"1": {"power_of_two": _arm(601.0), "cache_aware": _arm(94.0), "cache_aware@b": _arm(93.0)}},
    "cache_aware": {"1": {"best_other": "power_of_two", "goodput_diff": 0.0, "p95_ratio": 0.16, "status": "win"}},
    "noise": {"1": {"arm": "cache_aware@b", "p95_ratio": 0.99}}}]}
MATRIX_FULL = {"matrix": {"path": "configs/quality-matrix-70b.toml", "subject": "cache_aware",
                          "policies": ["power_of_two", "cache_aware"], "seeds": [2]},
               "summary": _SUMMARY, "cells": [{
                   "label": "zipf L1 W16 R4",
                   "seeds": {"2": {"arms": [{"policy": "power_of_two", **_arm(971.0)}, {"policy": "cache_aware", **_arm(372.0)}],
                                   "analysis": {"policies": {"cache_aware": {"best_other": "power_of_two", "goodput_diff": 0.0,
                                                                             "p95_ratio": 0.38, "status": "win"}}}}}}]}

CASES = [("broker", BROKER, "broker.md", "8,800"), ("routing", ROUTING, "routing.md", "106 µs"),
         ("indexer", INDEXER, "indexer.md", "218,145 blocks/s"), ("exchange", EXCHANGE, "exchange.md", "2.73 ms"),
         ("http", HTTP, "http.md", "976"), ("matrix", MATRIX_COMPACT, "quality-matrix.md", "601 | 94"),
         ("matrix", MATRIX_FULL, "quality-matrix-70b.md", "971 | 372")]


@pytest.mark.parametrize(("kind", "data", "page", "figure"), CASES, ids=[c[2] for c in CASES])
def test_every_kind_becomes_a_page_with_its_table_command_and_date(tmp_path: Path, kind, data, page, figure):
    src = tmp_path / f"{kind}.json"
    src.write_text(json.dumps(data))
    assert detect_kind(data) == kind
    assert main([str(src), "--out", str(tmp_path / "results"), "--date", "2026-12-04"]) == 0
    text = (tmp_path / "results" / page).read_text()
    assert text.startswith("# ")
    assert "- Date: 2026-12-04" in text
    assert "- Command: `mesh " in text and f"--json " in text
    assert "\n|---|" in text  # a markdown table
    assert figure in text


def test_a_new_run_replaces_the_page(tmp_path: Path):
    src = tmp_path / "broker.json"
    out = tmp_path / "results"
    src.write_text(json.dumps(BROKER))
    assert main([str(src), "--out", str(out)]) == 0
    src.write_text(json.dumps({**BROKER, "rps": 9999.0}))
    assert main([str(src), "--out", str(out)]) == 0
    text = (out / "broker.md").read_text()
    assert "9,999" in text and "8,800 | 14,350 | 0.606" not in text.split("**median**")[1]
    assert text.count("# Broker") == 1
    assert [p.name for p in out.iterdir()] == ["broker.md"]


def test_the_date_defaults_to_the_files_modification_time(tmp_path: Path):
    src = tmp_path / "routing.json"
    src.write_text(json.dumps(ROUTING))
    import os

    os.utime(src, (1_700_000_000, 1_700_000_000))
    assert main([str(src), "--out", str(tmp_path)]) == 0
    assert "- Date: 2023-11-14 22:13 UTC" in (tmp_path / "routing.md").read_text()


def test_an_unknown_or_broken_file_fails_the_run_and_names_it(tmp_path: Path, capsys):
    good, odd, bad = tmp_path / "routing.json", tmp_path / "odd.json", tmp_path / "bad.json"
    good.write_text(json.dumps(ROUTING))
    odd.write_text(json.dumps({"hello": 1}))
    bad.write_text("{not json")
    assert main([str(odd), str(bad), str(good), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "odd.json" in err and "bad.json" in err
    assert (tmp_path / "r" / "routing.md").exists()  # the good one is still written
    assert main([str(good), "--kind", "broker", "--out", str(tmp_path / "r")]) == 2  # forced to the wrong kind


def test_the_checked_in_quality_matrix_page_is_generated_from_the_checked_in_summary(tmp_path: Path):
    root = Path(__file__).resolve().parents[1]
    page = (root / "docs/results/quality-matrix.md").read_text()
    date = next(line for line in page.splitlines() if line.startswith("- Date: "))[len("- Date: "):]
    assert main([str(root / "docs/quality-matrix-summary.json"), "--out", str(tmp_path), "--date", date]) == 0
    fresh = (tmp_path / "quality-matrix.md").read_text().replace(str(root) + "/", "")
    assert fresh == page


def test_a_matrix_without_the_noise_arm_has_no_noise_column(tmp_path: Path):
    for data, page in ((MATRIX_FULL, "quality-matrix-70b.md"), (MATRIX_COMPACT, "quality-matrix.md")):
        src = tmp_path / "m.json"
        src.write_text(json.dumps(data))
        assert main([str(src), "--out", str(tmp_path), "--date", "d"]) == 0
        head = next(line for line in (tmp_path / page).read_text().splitlines() if line.startswith("| cell |"))
        assert ("| noise |" in head) == (data is MATRIX_COMPACT), head


def test_the_compact_matrix_renders_the_same_tables_and_is_what_the_page_names(tmp_path: Path):
    from mesh.lab.report import compact_matrix, render

    full = json.loads(json.dumps(MATRIX_FULL))
    full["cells"][0]["seeds"]["2"]["analysis"]["regret"] = {"predicted_ms": 10.0, "measured_ms": 12.0, "within": True}
    full["summary"] = {**_SUMMARY, "regret": {"runs": 1, "within_25pct": 1, "sign_right": 1, "target_share": 0.8,
                                              "observed": {"runs": 1, "within_25pct": 0, "sign_right": 1}}}
    small = compact_matrix(full)
    assert small["matrix_path"] == "configs/quality-matrix-70b.toml" and "calibrations" not in small
    assert small["cells"][0]["seeds"]["2"]["cache_aware"] == _arm(372.0)
    assert small["cells"][0]["regret"]["2"]["within"] is True
    a, b = render("matrix", full, "m.json"), render("matrix", small, "s.json")
    assert a.tables == b.tables
    assert any("within 25 % of the measured" in n and "observed: 0 within 25 %" in n for n in b.notes)
    src = tmp_path / "full.json"
    src.write_text(json.dumps(full))
    out = tmp_path / "summary.json"
    assert main([str(src), "--out", str(tmp_path), "--date", "2026-12-05", "--compact", str(out)]) == 0
    page = (tmp_path / "quality-matrix-70b.md").read_text()
    assert f"Source: `{out}`" in page and json.loads(out.read_text()) == small


def test_http_pages_are_one_per_endpoint():
    from mesh.lab.report import page_name

    assert page_name("http", HTTP) == "http"
    chat = {**HTTP, "config": {**HTTP["config"], "path": "/v1/chat/completions"}}
    assert page_name("http", chat) == "http-v1-chat-completions"
    single = {**HTTP, "config": {**chat["config"], "workload": "single"}}
    assert page_name("http", single) == "http-v1-chat-completions-single"


def test_http_chat_page_names_the_workload_it_ran():
    from mesh.lab.report import render

    chat = {**HTTP, "cells": [], "arms": {}}
    single = {**chat, "config": {**HTTP["config"], "path": "/v1/chat/completions", "workload": "single", "prompt_tokens": 1000}}
    convo = {**chat, "config": {**HTTP["config"], "path": "/v1/chat/completions", "workload": "conversations",
                                "conversations": 256, "turns": 4}}
    assert "--chat-workload single" in render("http", single, "x.json").command
    assert "--conversations 256 --turns 4" in render("http", convo, "x.json").command
    assert "--chat-workload" not in render("http", {**chat, "config": HTTP["config"]}, "x.json").command
