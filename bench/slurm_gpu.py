"""The product's own path on this machine's GPUs: `python -m pretrain.launch +cluster=...` -> submitit
-> sbatch -> srun one task per GPU -> NCCL -> FSDP2, through a real Slurm cluster started here.

    python bench/slurm_gpu.py --out DIR                       # the GPU machine (LOCALCLUSTER_GPUS=real)
    python bench/slurm_gpu.py --out DIR --cpu                 # a rehearsal on CPUs with stand-in GPUs

Starts tests/slurm/localcluster.sh with one node holding this machine's GPUs (and, with --two-nodes,
two nodes of half the GPUs each), writes a cluster file for it, and through the launcher:
  1. trains the model uninterrupted (job A): preflight figures, tokens/s per GPU, final loss;
  2. trains it again (job B), sends `scancel --signal=USR2` at --signal-at: a checkpoint, the batch
     script's requeue, the resume to the last step; `pretrain.status` during and after; its final
     loss is compared with A's;
  3. trains it through the local launcher (no Slurm) for the overhead of the Slurm path;
  4. submits a sweep of 2 points, one GPU each, as one job array;
  5. runs a short job with each GPU binding (Slurm's default, --gpu-bind=per_task:1, --gpu-bind=none)
     and records which GPU (UUID, PCI bus id) each rank drove.
Writes slurm-gpu.json and slurm-gpu.md (with every command, job id and scontrol's record) to --out.
Slurm's packages must be there: `bash tests/slurm/bundle.sh unpack FILE` on a machine without them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import throughput  # noqa: E402

REPO = common.REPO
sys.path.insert(0, str(REPO))

from pretrain.launcher.slurm import ACTIVE_STATES  # noqa: E402

CLUSTER_SCRIPT = REPO / "tests" / "slurm" / "localcluster.sh"
PORTS = {"LOCALCLUSTER_CTLD_PORT": "18817", "LOCALCLUSTER_DBD_PORT": "18819", "LOCALCLUSTER_SLURMD_PORT": "18901"}
# What the device tool's GPU machines need kept off (their KINDS.md): it reaches the jobs through cluster.env.
NCCL_SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def sh(*cmd: str, env: dict[str, str] | None = None, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout)
    if check and result.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


class Cluster:
    """The local Slurm cluster of localcluster.sh, with this machine's GPUs."""

    def __init__(self, folder: Path, nodes: int, gpus: str, gpu_count: int) -> None:
        cores = len(os.sched_getaffinity(0))
        mem_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        accounting = "slurmdbd" if shutil.which("mariadbd") and shutil.which("slurmdbd") else "none"
        self.folder, self.nodes, self.gpus_per_node = folder, nodes, gpu_count // nodes
        self.cpus_per_node = cores // nodes
        self.script_env = {**PORTS, "LOCALCLUSTER_NODES": str(nodes), "LOCALCLUSTER_CPUS": str(self.cpus_per_node),
                           "LOCALCLUSTER_MEM_MB": str(int(mem_mb * 0.8) // nodes), "LOCALCLUSTER_GPUS": gpus,
                           "LOCALCLUSTER_ACCOUNTING": accounting, "LOCALCLUSTER_TIMEOUT": "120"}
        self.env: dict[str, str] = {}
        self.accounting = accounting

    def start(self) -> str:
        result = sh("bash", str(CLUSTER_SCRIPT), "start", str(self.folder), env=self.script_env, timeout=300)
        match = re.search(r"^export SLURM_CONF=(.+)$", result.stdout, re.M)
        if result.returncode or not match:
            raise RuntimeError(f"localcluster.sh start failed ({result.returncode}):\n{result.stderr[-4000:]}")
        self.env = {"SLURM_CONF": match.group(1).strip()}
        return result.stderr

    def stop(self) -> None:
        sh("bash", str(CLUSTER_SCRIPT), "stop", str(self.folder), env=self.script_env, timeout=300)

    def run(self, *cmd: str) -> str:
        result = sh(*cmd, env=self.env, timeout=60)
        return (result.stdout + result.stderr).strip()

    def job(self, job_id: str) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", job_id).splitlines()
        line = out[0] if out else ""
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def wait(self, job_id: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job(job_id).get("JobState", "UNKNOWN")
            if state != "UNKNOWN" and state not in ACTIVE_STATES:  # an end state
                return state
            time.sleep(1)
        return f"still {state} after {timeout:.0f} s"


def cluster_file(folder: Path, cluster: Cluster, gpu_mem_gb: float | None, **changes: Any) -> Path:
    """conf/cluster/gpumachine.yaml for hydra.searchpath: the machine as a user's cluster file."""
    import yaml

    conf = {"name": "gpumachine", "partition": "debug", "nodes": cluster.nodes,
            "gpus_per_node": cluster.gpus_per_node, "cpus_per_task": max(1, cluster.cpus_per_node // cluster.gpus_per_node),
            "mem_gb": None, "time_min": 60, "signal_delay_s": 60, "gpu_mem_gb": gpu_mem_gb, "gpu_fp8": None,
            "env": dict(NCCL_SAFE), "container": None, **changes}
    (folder / "cluster").mkdir(parents=True, exist_ok=True)
    (folder / "cluster" / "gpumachine.yaml").write_text(yaml.safe_dump(conf))
    return folder


def launch(overrides: list[str], env: dict[str, str], log: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pretrain.launch", *overrides]
    started = time.monotonic()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **NCCL_SAFE, **env})
    log.write_text(f"$ {' '.join(command)}\n# exit {result.returncode} after {time.monotonic() - started:.1f} s\n"
                   + result.stdout + result.stderr)
    return result


def job_id_of(run_dir: Path) -> str:
    return json.loads((run_dir / "jobs.json").read_text())[-1]["job_id"]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in common.metrics(run_dir) if "loss" in r}


def wait_for_step(run_dir: Path, step: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(s >= step for s in losses(run_dir)):
            return True
        time.sleep(0.5)
    return False


def steady(run_dir: Path, measure_from: int) -> float | None:
    """Tokens/s per GPU over the logged windows after step measure_from, as bench/throughput.py weighs them."""
    return throughput.steady_state(common.metrics(run_dir), measure_from).get("tokens_per_s_per_gpu")


def preflight(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in common.metrics(run_dir) if "preflight" in r]


def status(env: dict[str, str], run_dir: Path) -> str:
    return sh(sys.executable, "-m", "pretrain.status", str(run_dir), env=env, timeout=60).stdout.strip()


def training_overrides(args: argparse.Namespace) -> list[str]:
    model = ["model=tiny", "precision=fp32", "train.seq_len=64", "train.micro_batch=4", "local.nproc=2"] if args.cpu \
        else [f"model={args.model}", "precision=bf16", "fsdp.compile=true", f"train.seq_len={args.seq_len}",
              f"train.micro_batch={args.micro_batch}"]
    # The built-in corpus (prepared by the job): a loss that falls, so that the resumed run's can be compared.
    return [*model, f"train.steps={args.steps}", "train.log_every=5", "train.eval_every=0",
            "train.ckpt_every=0", "optim.warmup_steps=10"]


def run_scenario(args: argparse.Namespace, cluster: Cluster, gpu_mem_gb: float | None, out: Path) -> dict[str, Any]:
    runs, logs = args.runs, out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    conf = cluster_file(runs / "conf", cluster, gpu_mem_gb)
    slurm = ["+cluster=gpumachine", f"hydra.searchpath=[file://{conf}]"]
    train = training_overrides(args)
    result: dict[str, Any] = {"cluster": {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
                                          "cpus_per_node": cluster.cpus_per_node, "accounting": cluster.accounting,
                                          "sinfo": cluster.run("sinfo", "-N", "-o", "%N %T %c %m %G")},
                              "overrides": train}

    # 1 and 2: the uninterrupted job and the one signalled, requeued and resumed, side by side in the queue.
    a, b = runs / "uninterrupted", runs / "requeued"
    for name, run_dir in (("uninterrupted", a), ("requeued", b)):
        submitted = launch([*slurm, *train, f"hydra.run.dir={run_dir}"], cluster.env, logs / f"launch-{name}.log")
        result[f"launch_{name}"] = {"exit": submitted.returncode, "stdout": submitted.stdout[-1500:],
                                    "command": "python -m pretrain.launch " + " ".join([*slurm, *train])}
        if submitted.returncode:
            raise RuntimeError(f"launch {name} failed:\n{submitted.stderr[-3000:]}")
    job_a, job_b = job_id_of(a), job_id_of(b)
    result["status_while_pending_or_running"] = status(cluster.env, runs)
    # One GPU machine runs one job at a time: B starts when A ends.
    state_a = cluster.wait(job_a, args.timeout)
    result["uninterrupted"] = {"job": job_a, "state": state_a, "scontrol": cluster.job(job_a),
                               "tokens_per_s_per_gpu": steady(a, args.measure_from), "final_loss": losses(a).get(args.steps),
                               "preflight": preflight(a)}
    reached = wait_for_step(b, args.signal_at, args.timeout)
    cluster.run("scancel", "--signal=USR2", job_b)
    signalled_at = max(losses(b), default=None)
    result["status_during"] = status(cluster.env, b)
    state_b = cluster.wait(job_b, args.timeout)
    lb = losses(b)
    result["losses"] = {"uninterrupted": losses(a), "requeued": lb}
    result["requeued"] = {"job": job_b, "state": state_b, "reached_signal_step": reached, "signalled_after_step": signalled_at,
                          "scontrol": cluster.job(job_b), "final_loss": lb.get(args.steps),
                          "resumed": "resumed from" in (b / "train.log").read_text() if (b / "train.log").is_file() else False,
                          "restarts_logged": max((r.get("restarts", 0) for r in common.metrics(b)), default=0),
                          "preflight": preflight(b)}
    result["status_after"] = status(cluster.env, b)
    for log in [b / "train.log", *sorted((b / "slurm").glob("*_log.out"))]:  # the requeue, as the job told it
        if log.is_file():
            shutil.copy(log, logs / f"requeued-{log.name}")
    if result["uninterrupted"]["final_loss"] is not None and lb.get(args.steps) is not None:
        result["loss_difference"] = abs(lb[args.steps] - result["uninterrupted"]["final_loss"])

    # 3: the same training through the local launcher, for the overhead of the Slurm path.
    local_dir = runs / "local"
    ran = launch([*train, f"hydra.run.dir={local_dir}"], {}, logs / "launch-local.log", timeout=args.timeout)
    result["local"] = {"exit": ran.returncode, "tokens_per_s_per_gpu": steady(local_dir, args.measure_from),
                       "final_loss": losses(local_dir).get(args.steps)}
    slurm_rate, local_rate = result["uninterrupted"]["tokens_per_s_per_gpu"], result["local"]["tokens_per_s_per_gpu"]
    if slurm_rate and local_rate:
        result["slurm_overhead"] = 1 - slurm_rate / local_rate

    # 4: a sweep of 2 points, one GPU each: one job array.
    sweep = runs / "sweep"
    small = ["model=tiny", "data=synthetic", "train.steps=6", "train.log_every=2", "train.eval_every=0",
             "train.ckpt_every=0", "train.seq_len=128", "train.micro_batch=4"]
    ran = launch(["-m", *slurm, "cluster.gpus_per_node=1", *small, "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}"],
                 cluster.env, logs / "launch-sweep.log")
    points = sorted(p.parent for p in sweep.glob("*/jobs.json"))
    jobs = [job_id_of(p) for p in points]
    result["sweep"] = {"exit": ran.returncode, "jobs": jobs, "states": [cluster.wait(j, args.timeout) for j in jobs],
                       "array": sorted({j.split("_")[0] for j in jobs}),
                       "final_losses": [losses(p).get(6) for p in points]}
    result["status_sweep"] = status(cluster.env, sweep)

    # 5: the GPU bindings.
    result["binding"] = {}
    for bind in (None, "per_task:1", "none"):
        label = bind or "default"
        bconf = cluster_file(runs / f"conf-{label.replace(':', '')}", cluster, gpu_mem_gb, gpu_bind=bind)
        run_dir = runs / f"bind-{label.replace(':', '')}"
        ran = launch(["+cluster=gpumachine", f"hydra.searchpath=[file://{bconf}]", *small, f"hydra.run.dir={run_dir}"],
                     cluster.env, logs / f"launch-bind-{label.replace(':', '')}.log")
        job = job_id_of(run_dir) if ran.returncode == 0 else None
        state = cluster.wait(job, args.timeout) if job else f"launch exit {ran.returncode}"
        ranks = [{k: r[k] for k in ("rank", "node", "device", "visible", "cpus")} for p in preflight(run_dir)
                 for r in p.get("ranks", [])]
        devices = [r["device"] for r in ranks]
        result["binding"][label] = {"job": job, "state": state, "ranks": ranks,
                                    "distinct_gpus": len(set(devices)) == len(devices) and bool(devices)}
    return result


def table(result: dict[str, Any]) -> str:
    u, r, loc = result.get("uninterrupted", {}), result.get("requeued", {}), result.get("local", {})
    pf = next(iter(u.get("preflight") or []), {})
    rate = lambda v: f"{v:,.0f}" if v else "-"  # noqa: E731
    rows = [
        ("cluster", f"{result['cluster']['nodes']} node(s) x {result['cluster']['gpus_per_node']} GPU(s), "
                    f"accounting {result['cluster']['accounting']}"),
        ("job A (uninterrupted)", f"{u.get('job')} {u.get('state')}, final loss {u.get('final_loss')}"),
        ("preflight", f"{pf.get('preflight')}: " + ", ".join(
            f"rank {x['rank']} {x.get('tflops', 0):.0f} TFLOP/s on {x.get('device')}" for x in pf.get("ranks", []))
            + (f"; all-reduce bus bandwidth {pf.get('busbw_gbps', 0):.1f} GB/s" if "busbw_gbps" in pf else "")),
        ("job B (USR2, requeued)", f"{r.get('job')} {r.get('state')}, restarts "
                                   f"{r.get('scontrol', {}).get('Restarts')}, signalled after step "
                                   f"{r.get('signalled_after_step')}, resumed: {r.get('resumed')}, final loss {r.get('final_loss')}"),
        ("final loss difference A vs B", f"{result.get('loss_difference')}"),
        ("tokens/s per GPU: Slurm / local launcher", f"{rate(u.get('tokens_per_s_per_gpu'))} / "
                                                      f"{rate(loc.get('tokens_per_s_per_gpu'))}"),
        ("Slurm path overhead", f"{result['slurm_overhead']:.2%}" if "slurm_overhead" in result else "-"),
        ("sweep (job array)", f"{result.get('sweep', {}).get('jobs')} {result.get('sweep', {}).get('states')}"),
    ]
    for label, b in result.get("binding", {}).items():
        rows.append((f"binding {label}", f"{b['state']}; " + "; ".join(
            f"rank {x['rank']} sees {x['visible']}, drives {x['device']}" for x in b["ranks"])
            + f"; distinct GPUs: {b['distinct_gpus']}"))
    text = "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)
    for key in ("status_during", "status_after", "status_sweep"):
        if key in result:
            text += f"\n\n`python -m pretrain.status` ({key.removeprefix('status_')}):\n\n```\n{result[key]}\n```"
    if "command" in result.get("launch_uninterrupted", {}):
        text += f"\n\ncommand: `{result['launch_uninterrupted']['command']}`"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", default="slurm-gpu")
    parser.add_argument("--runs", type=Path, default=Path("/tmp/slurm-gpu-runs"))
    parser.add_argument("--cluster-dir", type=Path, default=Path("/tmp/slurm-gpu"))
    parser.add_argument("--cpu", action="store_true", help="rehearse on CPUs: stand-in GPUs, the tiny model")
    parser.add_argument("--two-nodes", action="store_true", help="two slurmd nodes, half the GPUs each")
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--signal-at", type=int, default=20)
    parser.add_argument("--measure-from", type=int, default=15)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args(argv)

    shutil.rmtree(args.runs, ignore_errors=True)
    args.runs.mkdir(parents=True)
    gpu_count, gpu_mem_gb = 2, None
    if not args.cpu:
        import torch

        gpu_count = torch.cuda.device_count()
        gpu_mem_gb = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    cluster = Cluster(args.cluster_dir, 2 if args.two_nodes else 1, "fake" if args.cpu else "real", gpu_count)
    result: dict[str, Any] = {"name": args.name, **common.stamp(), "args": {k: str(v) for k, v in vars(args).items()}}
    try:
        result["cluster_start"] = cluster.start()[-2000:]
        result.update(run_scenario(args, cluster, gpu_mem_gb, args.out))
    except Exception as error:  # the record says what failed; the files written so far still come back
        result["error"] = f"{type(error).__name__}: {error}"
        result.setdefault("cluster", {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
                                      "cpus_per_node": cluster.cpus_per_node, "accounting": cluster.accounting})
    finally:
        for log in sorted((args.cluster_dir / "log").glob("*.log")):
            (args.out / "logs").mkdir(parents=True, exist_ok=True)
            shutil.copy(log, args.out / "logs" / f"cluster-{log.name}")
        cluster.stop()
    common.write_result(args.out, args.name, result, table(result))
    print(table(result))
    if "error" in result:
        print("error:", result["error"])
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
