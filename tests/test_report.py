"""`python -m pretrain.report` on a real 3-point sweep: a table row per run, and a line per run in each plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain import rundir
from pretrain.tracking import report
from tests.helpers import REPO, launch, losses

SHORT = ("train.steps=6", "train.log_every=2", "train.eval_every=0", "train.seq_len=64", "train.global_batch=8",
         "train.micro_batch=4")
CHARTS = ("loss_vs_step", "loss_vs_tokens", "throughput")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    sweep_dir = tmp_path_factory.mktemp("report") / "sweep"
    result = launch("-m", "optim.lr=1e-3,2e-3,3e-3", *SHORT, f"hydra.sweep.dir={sweep_dir}")
    assert result.returncode == 0, result.stderr + result.stdout
    return sweep_dir


def report_cli(*args: str, code: str = "") -> subprocess.CompletedProcess:
    """pretrain.report's main in a fresh interpreter, after `code` (e.g. one that hides matplotlib)."""
    program = f"import sys\n{code}\nfrom pretrain import report\nsys.exit(report.main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", program, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def table_rows(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    rule = next(i for i, line in enumerate(lines) if line and set(line) == {"-"})
    return [line.split() for line in lines[rule + 1:] if line and not line.startswith(("wrote", "matplotlib"))]


def test_report_of_a_sweep_has_a_row_and_a_line_per_run(sweep):
    result = report_cli(str(sweep))
    assert result.returncode == 0, result.stderr
    rows = table_rows(result.stdout)
    names = ["0_optim.lr=0.001", "1_optim.lr=0.002", "2_optim.lr=0.003"]
    assert [row[0] for row in rows] == names
    for row, name in zip(rows, names):
        assert row[1] == "6"  # steps
        assert float(row[2]) == pytest.approx(losses(sweep / name)[6], abs=1e-4)  # final loss
        assert row[3] == "-" and row[5] == "-"  # no evaluation; no MFU on CPUs
        assert row[6] == "0"  # restarts
    for chart in CHARTS:
        png = sweep / "report" / f"{chart}.png"
        assert png.read_bytes().startswith(PNG_SIGNATURE) and png.stat().st_size > 10_000, chart
        data = json.loads((sweep / "report" / f"{chart}.json").read_text())
        assert [line["label"] for line in data["lines"]] == names, chart
        assert all(len(line["points"]) == 3 for line in data["lines"]), chart
    by_step = json.loads((sweep / "report" / "loss_vs_step.json").read_text())
    assert dict(map(tuple, by_step["lines"][0]["points"])) == losses(sweep / names[0])


def test_without_matplotlib_the_table_still_prints(sweep, tmp_path):
    result = report_cli(str(sweep), "--out", str(tmp_path), code="sys.modules['matplotlib'] = None")
    assert result.returncode == 0, result.stderr
    assert len(table_rows(result.stdout)) == 3
    notices = [line for line in result.stdout.splitlines() if line.startswith("matplotlib is not installed")]
    assert len(notices) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{chart}.json" for chart in CHARTS)


def test_plots_that_cannot_be_written_are_one_line(sweep):
    result = report_cli(str(sweep), "--out", "/proc/pretrain-report")
    assert result.returncode == 2
    assert result.stderr.startswith("error: cannot write the plots to /proc/pretrain-report: "), result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_summary_of_a_resumed_run():
    records = [
        {"step": 2, "loss": 4.0, "tokens_per_s": 100.0, "mfu": 0.30, "restarts": 0},
        {"step": 4, "loss": 3.5, "tokens_per_s": 900.0, "mfu": 0.40, "restarts": 1},
        {"step": 4, "eval_loss": 3.6},
        {"step": 6, "loss": 3.0, "tokens_per_s": 1000.0, "mfu": 0.42, "restarts": 1},
        {"step": 6, "eval_loss": 3.1},
    ]
    summary = report.summarize("run", records)
    assert (summary.steps, summary.final_loss, summary.best_eval_loss, summary.restarts) == (6, 3.0, 3.1, 1)
    assert (summary.tokens_per_s, summary.mfu) == (900.0, 0.40)  # medians: the slow first window does not count
    table = report.table([summary])
    assert table.splitlines()[2].split() == ["run", "6", "3.0000", "3.1000", "900", "40.0%", "1"]


def test_report_of_a_folder_without_runs_says_so(tmp_path):
    result = report_cli(str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {tmp_path} is neither a run directory nor a sweep directory " \
                                    "(none with a config.yaml)"


def test_status_lists_local_runs_and_reads_a_half_written_metrics_line(sweep, tmp_path, capsys):
    from pretrain.launcher import status

    assert status.main([str(sweep)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert len(rows) == 3
    for job, state, restarts, step, loss, run in rows:
        assert (job, state, restarts, step) == ("-", "FINISHED", "0", "6")
        assert float(loss) == pytest.approx(losses(Path(run))[6], abs=1e-4)
    # A run being written: its last line is cut short; status shows the last whole record.
    run_dir = tmp_path / "running"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text((next(sweep.iterdir()) / "config.yaml").read_text())
    rundir.mark(run_dir)
    (run_dir / "metrics.jsonl").write_text('{"step": 2, "loss": 5.5}\n{"step": 4, "lo')
    assert status.main([str(tmp_path)]) == 0
    assert ["-", "LOCAL", "0", "2", "5.5000", str(run_dir.resolve())] in [
        line.split() for line in capsys.readouterr().out.splitlines()]
    assert status.main([str(tmp_path / "nothing-here")]) == 1
    assert "no runs under" in capsys.readouterr().err
