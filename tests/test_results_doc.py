"""benchmarks/results_doc.py: docs/RESULTS.md is built from the result files, and the build
survives missing, broken and unfamiliar files."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import results_doc  # noqa: E402


def test_the_committed_results_document_is_up_to_date():
    committed = (ROOT / "docs" / "RESULTS.md").read_text(encoding="utf-8")
    assert committed == results_doc.build(results_doc.RESULTS), \
        "docs/RESULTS.md is stale: run python benchmarks/results_doc.py"


def test_no_results_folder_gives_a_short_document(tmp_path):
    doc = results_doc.build(tmp_path / "absent")
    assert doc.startswith("# Results") and "No result files" in doc


def test_rows_are_tabulated_and_odd_files_listed(tmp_path):
    (tmp_path / "gpu").mkdir()
    run = {"environment": {"command": "python -m specla bench --suite e2e", "git": {"commit": "abcdef123456"},
                           "date": "2026-01-02T03:04:05", "gpu": "Some GPU"},
           "pair": {"prompts": 2, "new_tokens": 16, "rows": [
               {"name": "block/chain", "tau": 2.5, "ms_per_token": {"median": 1.25}, "ar_ms_per_token": 2.5,
                "speedup": 2.0, "exact": {"prompts": 2, "mismatching_prompts": 0}},
               {"drafter": "eagle", "settings": "chain", "skipped": "deadline"}]}}
    (tmp_path / "gpu" / "e2e.json").write_text(json.dumps(run))
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"something": [1, 2, 3]}))
    (tmp_path / "list.json").write_text("[1, 2]")
    doc = results_doc.build(tmp_path)
    assert "`python -m specla bench --suite e2e` · commit abcdef1 · 2026-01-02 · Some GPU" in doc
    assert "| block/chain | 2.50 | 1.250 | 2.500 | 2.00x | yes |  |" in doc
    assert "| eagle / chain |  |  |  |  |  | skipped (deadline) |" in doc
    assert "broken.json" in doc and "Could not be read" in doc
    assert "`other.json`" in doc and "`list.json`" in doc


def test_the_script_writes_its_output(tmp_path):
    out = tmp_path / "docs" / "RESULTS.md"
    assert results_doc.main(["--results", str(tmp_path / "none"), "--out", str(out)]) == 0
    assert out.read_text().startswith("# Results")
