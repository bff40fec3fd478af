"""The memory and speed estimate (pretrain.plan): against measured peaks on CPU, the launcher's refusal
and its suggestions, forcing, and `python -m pretrain.plan`."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from pretrain import flops
from pretrain.launcher import plan
from pretrain.config import ConfigError
from pretrain.compose import compose
from tests import memory_probe
from tests.helpers import REPO, launch, snapshot

# About 7M parameters; the logits of an 8k vocabulary and the activations weigh about as much as the weights,
# their gradients and the optimizer state (fp32: 94 against 110 MiB), and bf16 steps take seconds even where
# the CPU has no bf16 instructions (there bf16 matmuls run some 50x slower than fp32 ones).
PROBE_MODEL = ("data=synthetic", "model.name=probe", "model.dim=256", "model.n_layers=4", "model.n_heads=4",
               "model.n_kv_heads=2", "model.ffn_hidden=768", "model.vocab_size=8000", "train.seq_len=256",
               "train.steps=2", "train.log_every=1")
TOO_BIG = ("+cluster=a100x8", "model=llama-8b", "train=pretrain", "fsdp.activation_checkpointing=none")


@pytest.mark.parametrize("world,settings", [
    (1, ["precision=fp32", "train.micro_batch=2", "train.global_batch=4"]),  # eager, gradient accumulation
    (1, ["precision=bf16", "train.micro_batch=2", "train.global_batch=4"]),  # no FSDP: a bf16 compute copy
    (2, ["precision=bf16", "fsdp.activation_checkpointing=selective", "train.micro_batch=4", "train.global_batch=8"]),
    (2, ["precision=fp32", "train.micro_batch=2", "train.global_batch=8"]),  # accumulated gradients stay sharded
], ids=["1proc-fp32-accumulation", "1proc-bf16-unwrapped", "2proc-bf16-selective-sharded", "2proc-fp32-accumulation"])
def test_estimate_is_within_10_percent_of_the_measured_peak(tmp_path, world, settings):
    overrides = [*PROBE_MODEL, *settings, f"local.nproc={world}"]
    cfg = compose(overrides)
    estimate = plan.estimate(cfg, plan.target_of(cfg))
    peaks = memory_probe.measure(world, overrides, tmp_path, timeout=600)
    for peak in peaks:
        assert estimate.allocated == pytest.approx(peak, rel=0.10), (estimate.allocated / 2**20, peak / 2**20)


def test_one_process_holds_a_compute_copy_instead_of_fsdp_gathered_parameters():
    """Without FSDP (one process) the compute copy is held through the optimizer step, and in fp32 there is
    none; wrapped anyway, FSDP's gathered copies are counted as before."""
    def parts(*overrides: str) -> dict[str, float]:
        cfg = compose([*PROBE_MODEL, *overrides])
        estimate = plan.estimate(cfg, plan.target_of(cfg))
        return {part.name: part.bytes for part in estimate.held + estimate.forward_backward}

    copy_bytes = 2 * flops.parameter_count(compose(list(PROBE_MODEL)).model)
    assert parts("precision=bf16")["compute copy"] == copy_bytes
    assert "gathered parameters" not in parts("precision=bf16")
    assert not {"compute copy", "gathered parameters"} & parts("precision=fp32").keys()
    wrapped = parts("precision=bf16", "fsdp.wrap_single_rank=true")
    assert wrapped["gathered parameters"] == copy_bytes and "compute copy" not in wrapped
    assert parts("precision=bf16", "local.nproc=2")["gathered parameters"] > 0


def test_memory_falls_with_each_remedy():
    cfg = compose([*TOO_BIG])
    target = plan.target_of(cfg)
    base = plan.estimate(cfg, target).allocated
    for overrides in (["fsdp.activation_checkpointing=selective"], ["fsdp.activation_checkpointing=full"],
                      ["train.micro_batch=1"], ["cluster.nodes=2"]):
        changed = compose([*TOO_BIG, *overrides])
        assert plan.estimate(changed, plan.target_of(changed)).allocated < base, overrides
    no_shard = compose([*TOO_BIG, "fsdp=no_shard"])
    assert plan.estimate(no_shard, plan.target_of(no_shard)).allocated > base


def test_speed_is_mfu_times_peak_over_flops_per_token():
    cfg = compose(["+cluster=h100x8", "cluster.nodes=2", "model=llama-1b", "train=pretrain", "plan.mfu=0.5"])
    target = plan.target_of(cfg)
    assert target.world == 16 and target.peak_flops == 989e12 and target.memory_gib == 79.6
    expected = 16 * 0.5 * 989e12 / flops.flops_per_token(cfg.model, 4096, "causal")
    assert plan.estimate(cfg, target).tokens_per_s == pytest.approx(expected)
    full = compose(["+cluster=h100x8", "cluster.nodes=2", "model=llama-1b", "train=pretrain", "plan.mfu=0.5",
                    "fsdp.activation_checkpointing=full"])
    assert plan.estimate(full, plan.target_of(full)).tokens_per_s == pytest.approx(expected * 6 / 8)


def test_suggestions_fit_when_estimated_again():
    cfg = compose([*TOO_BIG])
    target = plan.target_of(cfg)
    assert not plan.estimate(cfg, target).fits
    suggestions = plan.suggestions(cfg, target)
    assert suggestions
    for suggestion in suggestions:
        changed = compose([*TOO_BIG, *suggestion.overrides])
        again = plan.estimate(changed, plan.target_of(changed))
        assert again.fits and again.total == pytest.approx(suggestion.estimate.total), suggestion.overrides


def check(overrides: list[str]) -> plan.Estimate | None:
    cfg = compose(overrides)
    return plan.check(cfg, plan.target_of(cfg))


def test_check_is_skipped_where_the_gpu_memory_is_unknown():
    assert check([*TOO_BIG, "cluster.gpu_mem_gb=null"]) is None
    with pytest.raises(ConfigError, match="will not fit"):
        check([*TOO_BIG])


def test_local_cpu_runs_are_planned_within_the_memory_cgroups_limit(tmp_path):
    """A local run inside an allocation (salloc --mem) or a container with a memory limit is killed when it
    goes over: the memory it is planned against is what the tightest cgroup limit above it leaves, where
    that is less than the node's available memory."""
    gib = 1 << 30
    proc, v2 = tmp_path / "proc", tmp_path / "cgroup2"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: {64 * gib // 1024} kB\nMemAvailable: {40 * gib // 1024} kB\n")
    job = v2 / "system.slice" / "slurmstepd.scope" / "job_3"
    (job / "step_interactive").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/system.slice/slurmstepd.scope/job_3/step_interactive\n")
    (job / "memory.max").write_text(f"{16 * gib}\n")
    (job / "memory.current").write_text(f"{4 * gib}\n")
    assert plan.available_memory_gib(proc, v2) == 12
    (job / "memory.max").write_text("max\n")
    assert plan.available_memory_gib(proc, v2) == 40


def test_local_cpu_runs_are_checked_against_the_memory_available(tmp_path, capsys):
    from pretrain import launch as launcher

    assert check(["local.nproc=2"]).fits
    cfg = compose(["model=llama-8b", "fsdp.activation_checkpointing=full", "train.micro_batch=1"])
    target = plan.target_of(cfg)
    assert target.memory_gib == pytest.approx(plan.available_memory_gib(), rel=0.2)
    assert plan.estimate(cfg, target).total > 8e9 * 12  # fp32 weights and AdamW moments alone
    run_dir = tmp_path / "run"
    assert launcher.main(["model=llama-8b", f"hydra.run.dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert "error: llama-8b will not fit: about " in err and "per process (of the memory available now)" in err, err
    assert not run_dir.exists()


def resolved_checkpointing(overrides: list[str]) -> str:
    cfg = compose(overrides)
    return plan.resolve_checkpointing(cfg, plan.target_of(cfg))


def test_auto_checkpointing_is_the_least_that_fits():
    assert compose([]).fsdp.activation_checkpointing == "auto"
    a100 = ["+cluster=a100x8", "train=pretrain"]
    assert resolved_checkpointing([*a100, "model=llama-1b"]) == "none"
    assert resolved_checkpointing([*a100, "model=llama-8b"]) == "selective"
    assert resolved_checkpointing([*a100, "model=llama-8b", "cluster.gpu_mem_gb=40"]) == "full"
    assert resolved_checkpointing([*a100, "model=llama-70b", "cluster.nodes=4"]) == "full"
    assert resolved_checkpointing([*a100, "model=llama-8b", "cluster.gpu_mem_gb=null"]) == "none"  # unknown memory
    assert resolved_checkpointing([*a100, "model=llama-8b", "fsdp.activation_checkpointing=none"]) == "none"
    # Each choice fits and the one before it does not.
    cfg = compose([*a100, "model=llama-8b"])
    target = plan.target_of(cfg)
    assert plan.estimate(cfg, target).fits
    assert not plan.estimate(plan.with_checkpointing(cfg, "none"), target).fits


# The model presets with train=pretrain on the a100x8 node counts the README names for them.
PRESETS = [("llama-1b", 1, []), ("llama-8b", 1, []), ("llama-8b", 4, ["fsdp=hybrid_shard"]), ("llama-70b", 4, [])]


@pytest.mark.parametrize("model,nodes,extra", PRESETS, ids=[f"{m}-{n}nodes" for m, n, _ in PRESETS])
def test_presets_fit_their_a100_node_counts(model, nodes, extra):
    cfg = compose(["+cluster=a100x8", f"cluster.nodes={nodes}", f"model={model}", "train=pretrain", *extra])
    assert plan.check(cfg, plan.target_of(cfg)).fits


def test_plan_names_the_smallest_node_count_for_70b():
    result = plan_cli("+cluster=a100x8", "model=llama-70b", "train=pretrain")
    assert result.returncode == 1
    assert "smallest node count that fits: cluster.nodes=4 (" in result.stdout
    # 2 nodes: too little memory even with full checkpointing; 3 nodes would hold it, but the preset's
    # 1024 sequences a step do not divide over 24 GPUs.
    cfg = compose(["+cluster=a100x8", "cluster.nodes=2", "model=llama-70b", "train=pretrain",
                   "fsdp.activation_checkpointing=full", "train.global_batch_tokens=null", "train.global_batch=96"])
    assert not plan.estimate(cfg, plan.target_of(cfg)).fits


def test_launcher_refuses_a_run_that_will_not_fit_and_names_what_would(tmp_path):
    run_dir = tmp_path / "run"
    result = launch(*TOO_BIG, f"hydra.run.dir={run_dir}")
    assert result.returncode == 2, result.stdout + result.stderr
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert message.startswith("error: llama-8b will not fit: about ")
    assert "GiB per GPU (parameters 3.74 + optimizer state 7.48 + " in message
    assert "cluster a100x8: 1 node x 8 GPUs has 80.0 GiB per GPU" in message
    fixes = message.split("fits with: ")[1].split("; or ")[0].split(" | ")
    assert {fix.split(" (")[0] for fix in fixes} >= {"train.micro_batch=1", "fsdp.activation_checkpointing=selective"}
    assert "plan.force=true" in message
    assert not run_dir.exists() and snapshot(tmp_path) == {}
    # The first suggestion is accepted as it stands.
    first = re.search(r"fits with: (.*?) \(", message).group(1).split()
    accepted = launch(*TOO_BIG, *first, "dry_run=true", f"hydra.run.dir={run_dir}")
    assert accepted.returncode == 0, accepted.stderr


def test_force_submits_anyway_with_a_warning(tmp_path):
    result = launch(*TOO_BIG, "plan.force=true", "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr
    assert "warning: llama-8b will not fit" in result.stderr and "plan.force=true: going ahead" in result.stderr
    assert "#SBATCH --nodes=1" in result.stdout


def plan_cli(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pretrain.plan", *overrides], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_plan_cli_prints_counts_memory_and_time():
    result = plan_cli("+cluster=h100x8", "model=llama-1b", "train=pretrain")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    cfg = compose(["+cluster=h100x8", "model=llama-1b", "train=pretrain"])
    estimate = plan.estimate(cfg, plan.target_of(cfg))
    assert "parameters       1,532,037,120" in out
    assert "8.42 GFLOP (causal attention), 9.23 GFLOP (reference" in out
    for part in estimate.held + estimate.forward_backward + estimate.optimizer_step:
        assert re.search(rf"{re.escape(part.name)}\s+{re.escape(part.detail)}\s+{plan.gib(part.bytes)}\n", out), part
    assert f"total{' ' * 70}" in out and plan.gib(estimate.total) in out and "fits in 79.6 GiB per GPU" in out
    tokens = 100_000 * 4_194_304
    hours = tokens / estimate.tokens_per_s * 8 / 3600
    assert f"= {hours:,.0f} GPU-hours" in out
    assert f"{estimate.tokens_per_s / 8:,.0f} tokens/s per GPU" in out and "assumed MFU 45% of 989 TFLOP/s" in out


def test_plan_cli_exits_1_with_suggestions_when_it_will_not_fit():
    result = plan_cli(*TOO_BIG)
    assert result.returncode == 1
    assert "does NOT fit in 80.0 GiB per GPU" in result.stdout
    fixes = result.stdout.split("would fit:\n")[1]
    assert "\n  train.micro_batch=1 " in "\n" + fixes
    assert "\n  fsdp.activation_checkpointing=selective " in "\n" + fixes
    assert plan_cli("train.micro_batch=0").returncode == 2
