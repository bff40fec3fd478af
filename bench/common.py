"""Shared by the bench scripts: run the package's launcher, read its metrics, write results.

Every benchmark goes through `python -m pretrain.launch`, the command users run, and reads
the run's own metrics.jsonl: what users run is what is measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pretrain.config import ModelConfig

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def shape_1b() -> ModelConfig:
    """The 1B preset's ModelConfig (conf/model/llama-1b.yaml), for benchmarks of its parts outside a run.
    The package is imported here, not at the top: most benchmarks only drive its launcher, some a tree of
    another commit (--repo), and import none of it."""
    import yaml

    from pretrain.config import ModelConfig

    return ModelConfig(**yaml.safe_load((REPO / "conf" / "model" / "llama-1b.yaml").read_text()))


def kernel_benchmark_args(description: str, name: str) -> argparse.Namespace:
    """The command line of a benchmark of one of the package's Triton kernels: --out, --name, --repeats, and
    --sweep to time it at other (BLOCK, NUM_WARPS) besides the package's (see `kernel_configs`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default=name)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", action="store_true")
    return parser.parse_args()


def kernel_configs(chosen: tuple[int, int], sweep: bool, others: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The (BLOCK, NUM_WARPS) to time: the package's choice first, then with --sweep the others."""
    return [chosen] + ([c for c in others if c != chosen] if sweep else [])


def launch(overrides: list[str], run_dir: Path, timeout_s: float, log_path: Path, repo: Path = REPO,
           wrapper: tuple[str, ...] = (), env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `python -m pretrain.launch OVERRIDES hydra.run.dir=RUN_DIR` in the package tree REPO
    (this one unless comparing with another checkout), under WRAPPER (a profiler's command line) if
    given, with ENV added to this process's environment; returns exit code, time and command."""
    command = [*wrapper, sys.executable, "-m", "pretrain.launch", *overrides, f"hydra.run.dir={run_dir}"]
    started = time.time()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        try:
            code = subprocess.run(command, cwd=repo, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    return {"exit_code": code, "wall_s": round(time.time() - started, 1), "command": reproduce(overrides)}


def reproduce(overrides: list[str]) -> str:
    return "python -m pretrain.launch " + " ".join(overrides)


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def log_tail(log_path: Path, lines: int = 25) -> str:
    if not log_path.is_file():
        return ""
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])


def kernel_times(prof) -> dict[str, float]:
    """Self device time (ms) per kernel name in a torch.profiler profile (CUDA activity)."""
    times: dict[str, float] = {}
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0)
        if device_us:
            times[event.key] = times.get(event.key, 0.0) + device_us / 1000
    return times


def machine() -> dict[str, Any]:
    """The GPU(s), host and software the numbers were measured on."""
    import torch

    info: dict[str, Any] = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus_visible"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
        info["cudnn"] = torch.backends.cudnn.version()
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            pass
    return info


def commit() -> str:
    """The package commit: BENCH_COMMIT when the tree travelled without .git, else git's HEAD."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "pretrain"], cwd=REPO, capture_output=True, text=True)
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def stamp() -> dict[str, Any]:
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit(), "machine": machine()}


def write_result(out_dir: Path, name: str, result: dict[str, Any], table: str) -> Path:
    """RESULT as NAME.json and the markdown TABLE (with the stamp) as NAME.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    m = result["machine"]
    header = (f"# {name}\n\nmachine: {m.get('gpus_visible', 0)} x {m.get('gpu', 'CPU')}, torch {m['torch']}, "
              f"cuda {m.get('cuda')}, cudnn {m.get('cudnn')}  \ndate: {result['date']}  \ncommit: {result['commit']}\n\n")
    (out_dir / f"{name}.md").write_text(header + table + "\n")
    return out_dir / f"{name}.md"
