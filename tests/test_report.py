"""The results report (``foresight report``, foresight/report.py) from a synthetic metrics folder: the headline rows
judged on the metrics, the stages' plots embedded in one self-contained page, its markdown twin, and the README's
headline block regenerated from the same metrics."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import yaml

from flows.cli import main
from foresight.claims import CLAIMS
from foresight.report import HEADLINE_BEGIN, HEADLINE_END, MAX_README_ROWS

REPO = Path(__file__).resolve().parent.parent

METRICS = {
    "benchmark_medusa": {"held_out.medusa_supervised.speedup_vs_reference": 2.2,
                         "held_out.medusa_supervised.speedup_vs_reference_low": 1.9,
                         "held_out.medusa_supervised.speedup_vs_reference_high": 2.5,
                         "held_out.medusa_supervised.tau": 2.8, "held_out.medusa_supervised.tau_low": 2.5,
                         "held_out.medusa_supervised.tau_high": 3.1,
                         "general.medusa_supervised.speedup_vs_reference": 0.95, "stage_seconds": 123.4,
                         "load_average_1min": 3.5, "load_average_5min": 2.25, "load_average_15min": 1.0},
    "train_mtp": {"held_out_task_expected_tau": 2.0, "held_out_task_expected_tau_low": 1.8,
                  "held_out_task_expected_tau_high": 2.2, "held_out_task_top1_depth_1": 0.6,
                  "optimizer_steps": 32, "stage_seconds": 56.0},
    "train_medusa": {"task_top1_head1": 0.7, "stage_seconds": 40.0},
}


def _project(root: Path) -> Path:
    """A params file whose metrics folder holds :data:`METRICS` and whose Medusa benchmark wrote one plot; no MLflow
    store yet."""
    from foresight.plots import line_plot

    (root / "params.yaml").write_text(yaml.safe_dump({"tracking": {"mlflow_uri": f"sqlite:///{root / 'mlflow.db'}"}}))
    for stage, metrics in METRICS.items():
        path = root / "data/metrics" / f"{stage}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(metrics))
    line_plot({"speedup": ([1, 2], [1.0, 2.2])}, "speedup", "x", "y", root / "data/benchmarks/medusa/speedup.png")
    return root / "params.yaml"


def _rows(markdown: str) -> list[list[str]]:
    """The body rows of the first markdown table in ``markdown``, as cells."""
    lines = markdown[markdown.index("\n|") + 1:].split("\n\n")[0].splitlines()
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines[2:]]


def test_report_is_one_self_contained_page_with_a_markdown_twin(tmp_path, capsys):
    params = _project(tmp_path)
    assert main(["report", "--params", str(params)]) == 0
    assert str(tmp_path / "data/reports/report.html") in capsys.readouterr().out
    page = (tmp_path / "data/reports/report.html").read_text()
    twin = (tmp_path / "data/reports/report.md").read_text()
    # nothing fetched from elsewhere: no script at all, no external stylesheet, every image a data: URI
    assert "<script" not in page and "<link" not in page and "@import" not in page
    sources = re.findall(r"""src=['"]?([^'" >]+)""", page)
    assert sources and all(source.startswith("data:image/png;base64,") for source in sources)
    # the plot, embedded byte for byte; the twin links the file itself
    png = (tmp_path / "data/benchmarks/medusa/speedup.png").read_bytes()
    assert f"data:image/png;base64,{base64.b64encode(png).decode()}" in page
    (link,) = re.findall(r"!\[speedup.png\]\(([^)]+)\)", twin)
    assert (tmp_path / "data/reports" / link).resolve().read_bytes() == png
    # the headline rows, judged on these metrics: Medusa's interval lies above 1 (holds), MTP's τ interval below
    # the paper's 2.46 (does not hold, with the measured reason); a stage that did not run is "not measured"
    rows = {(row[0], row[2]): row for row in _rows(twin.split("## Claims")[1])}
    medusa = rows["Medusa", "paper: Medusa-1, greedy acceptance"]
    assert medusa[4].startswith("task prompts 2.2 [1.9, 2.5]×") and medusa[5] == "holds"
    mtp = next(row for (paper, _), row in rows.items() if paper == "MTP")
    assert mtp[5] == "does not hold" and "32 optimizer steps" in mtp[6]
    assert rows["COrAL", "paper: verified"][5] == "not measured"
    # the same rows in the page's table
    assert "task prompts 2.2 [1.9, 2.5]×" in page and page.count("<tr>") >= len(rows) + 1
    # the environment and each stage's wall time; no MLflow store: said, not created
    assert "| torch threads |" in twin and "| benchmark_medusa | 123.4 | 3.50 / 2.25 / 1.00 | not recorded |" in twin
    assert "no MLflow store" in twin and not (tmp_path / "mlflow.db").exists()


def _block(text: str) -> str:
    return text[text.index(HEADLINE_BEGIN) + len(HEADLINE_BEGIN):text.index(HEADLINE_END)]


def _check_headline_block(block: str) -> list[list[str]]:
    """Well-formed: a header of five columns, at most 12 rows of five cells, each "ours" cell one figure (with
    its interval where the run measured one) or "–"."""
    header = block.strip().splitlines()[0]
    assert header == "| method | claim | paper's figure | ours (95 % interval) | verdict |"
    rows = _rows(block)
    assert 1 <= len(rows) <= MAX_README_ROWS and all(len(row) == 5 for row in rows)
    for row in rows:
        assert row[4].split(" · ")[0] in {"holds", "does not hold", "undecided", "not measured"}, row
        assert row[3] == "–" or len(re.findall(r"\[", row[3])) <= 1, row
    return rows


def test_readme_headline_block_regenerates_from_the_metrics(tmp_path, capsys):
    params = _project(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\n{HEADLINE_BEGIN}\nstale\n{HEADLINE_END}\n\nafter\n")
    assert main(["report", "--readme", "--params", str(params)]) == 0
    first = readme.read_text()
    assert first.startswith("# Title\n\n") and first.endswith("\n\nafter\n")
    rows = _check_headline_block(_block(first))
    assert ["Medusa", "Greedy-verified Medusa heads decode faster than greedy, output unchanged",
            "Medusa-1 ≈ 2.2× (Vicuna-7B, A100)", "task prompts 2.2 [1.9, 2.5]×", "holds"] in rows
    # the claims off the headline (Claim.headline false) stay out of the README (the report shows every claim)
    details = [c.claim for c in CLAIMS if not c.headline]
    assert details and not [row for row in rows if row[1] in details]
    capsys.readouterr()
    assert main(["report", "--readme", "--params", str(params)]) == 0  # the same metrics: byte-identical
    assert "up to date" in capsys.readouterr().out and readme.read_text() == first


def test_committed_readme_headline_block_is_well_formed():
    """The README's table reflects a measured run, so it is checked for form, not against the metrics on disk."""
    _check_headline_block(_block((REPO / "README.md").read_text()))
