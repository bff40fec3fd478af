"""Models out and in on GPUs: train, export to Hugging Face, compare logits, continue from the export.

    python bench/hf_roundtrip.py --out DIR [--gpus 1] [--model llama-1b] [--steps 40]
    bash bench/device.sh hf-roundtrip          # in a device call: the 1B shape, continued on 1 GPU

1. trains the model --steps steps on the built-in corpus (python -m pretrain.launch, one GPU, bf16),
   with a checkpoint at the end;
2. exports it (python -m pretrain.export, bf16, --max-shard-gb 1 so that the 1B shape is sharded),
   recording the export's time and peak resident memory (one shard's worth, not the model's);
3. compares the logits of the exported model in transformers (LlamaForCausalLM) with ours on the
   same tokens: in fp32 on the same (bf16) weights, which must agree to rounding, and both in bf16,
   within bf16 tolerance (loss within 1%, mean |difference| within 5% of the logits' spread);
4. generates from the exported folder (python -m pretrain.generate, greedy);
5. starts a continued-pretraining run from the exported folder (model.init_from) on --gpus GPUs
   and checks that its first loss is the exported model's loss on the same first batch (within 1%
   of transformers' and of ours in bf16); the trained run's first loss is a fresh model's, for scale.
   That run is compiled and writes samples at its last step (train.sample_every: compiled blocks
   run eagerly for generation), which the CPU tests cannot check.
Writes hf-roundtrip-MODEL-NGPU.json and .md into --out (bench/results by default).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

BF16_LOSS_REL = 0.01
BF16_SPREAD_FRACTION = 0.05
FP32_MAX_ABS = 1e-3
# The export runs in a child that reports its own peak resident memory (the launcher's would mix in).
MEASURED_EXPORT = ("import resource, runpy, sys\nsys.argv = ['pretrain.export', *sys.argv[1:]]\n"
                   "try:\n    runpy.run_module('pretrain.export', run_name='__main__')\nexcept SystemExit as end:\n"
                   "    code = end.code\nprint('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
                   "sys.exit(code)\n")


def train_overrides(args: argparse.Namespace) -> list[str]:
    return [f"model={args.model}", "data=builtin", f"precision={args.precision}", f"train.seq_len={args.seq_len}",
            f"train.micro_batch={args.micro_batch}", f"train.global_batch={args.micro_batch}", f"train.steps={args.steps}",
            "train.log_every=1", "train.eval_every=0", f"train.ckpt_every={args.steps}", "optim.warmup_steps=10",
            "local.nproc=1"]


def continue_overrides(args: argparse.Namespace, folder: Path) -> list[str]:
    return [f"model={args.model}", f"model.init_from={folder}", "data=builtin", f"precision={args.precision}",
            f"train.seq_len={args.seq_len}", f"train.micro_batch={args.micro_batch}",
            f"train.global_batch={args.micro_batch * args.gpus}", "train.steps=5", "train.log_every=1",
            "train.eval_every=0", "train.ckpt_every=0", f"local.nproc={args.gpus}", "fsdp.compile=true",
            "train.sample_every=5"]


def run(command: list[str], log: Path, timeout_s: float) -> dict[str, Any]:
    started = time.time()
    with log.open("w") as out:
        code = subprocess.run(command, cwd=common.REPO, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    return {"exit_code": code, "wall_s": round(time.time() - started, 1), "command": "python " + shlex.join(command[1:])}


def export(run_dir: Path, folder: Path, log: Path, timeout_s: float) -> dict[str, Any]:
    args = [str(run_dir), "--out", str(folder), "--max-shard-gb", "1"]
    result = run([sys.executable, "-c", MEASURED_EXPORT, *args], log, timeout_s)
    peak = [line.split()[1] for line in log.read_text().splitlines() if line.startswith("PEAK_RSS_KB")]
    files = sorted(p.name for p in folder.glob("*.safetensors")) if folder.is_dir() else []
    return {**result, "command": "python -m pretrain.export " + " ".join(args),
            "peak_rss_gb": int(peak[0]) / 2**20 if peak else None, "weights_files": files,
            "weights_gb": sum((folder / f).stat().st_size for f in files) / 1e9}


def logits_gap(ours, theirs, tokens, targets) -> dict[str, Any]:
    """How far transformers' logits are from ours on the same tokens, and the losses of both."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        a = ours(tokens).float()
        b = theirs(tokens).logits.float()
    diff = (a - b).abs()
    loss = [F.cross_entropy(x.flatten(0, 1), targets.flatten()).item() for x in (a, b)]
    return {"max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(), "logits_std": a.std().item(),
            "loss_ours": loss[0], "loss_transformers": loss[1],
            "top1_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}


def compare(run_dir: Path, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Logits of ours and transformers' on a batch of the run's data, in fp32 and in bf16; and the
    exported model's loss on the first global batch of the continued run (as that run reads it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pretrain import rundir
    from pretrain.data import source
    from pretrain.hf.generate import from_run

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ours, _ = from_run(run_dir, None, device)
    with torch.no_grad():
        for parameter in ours.parameters():  # the weights the export holds: ours rounded to bf16
            parameter.copy_(parameter.to(torch.bfloat16).float())
    cfg = rundir.load_config(run_dir)
    data = source.open_train(cfg)
    inputs, targets = (torch.from_numpy(a).to(device) for a in data.get_batch(range(4), args.seq_len, cfg.train.seed))
    result = {}
    for dtype in (torch.float32, torch.bfloat16):  # each as its users load it
        theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        ours.to(dtype)
        ours.init_buffers()  # RoPE stays fp32, as in training (mixed precision casts the parameters only)
        result[str(dtype).removeprefix("torch.").replace("float32", "fp32").replace("bfloat16", "bf16")] = \
            logits_gap(ours, theirs, inputs, targets)
    batch = args.micro_batch * args.gpus  # the continued run's first global batch (its seed is the same)
    inputs, targets = (torch.from_numpy(a).to(device) for a in data.get_batch(range(batch), args.seq_len, cfg.train.seed))
    first = [logits_gap(ours, theirs, inputs[i:i + 1], targets[i:i + 1]) for i in range(batch)]
    result["first_batch_loss"] = {who: sum(f[f"loss_{who}"] for f in first) / batch for who in ("ours", "transformers")}
    return result


def verdicts(result: dict[str, Any]) -> dict[str, bool]:
    fp32, bf16, cont = result["logits"]["fp32"], result["logits"]["bf16"], result["continued"]
    expected = result["logits"]["first_batch_loss"]
    first = cont.get("first_loss")
    return {
        "export_ran": result["export"]["exit_code"] == 0,
        "fp32_logits_agree": fp32["max_abs_diff"] <= FP32_MAX_ABS,
        "bf16_logits_within_tolerance": abs(bf16["loss_ours"] - bf16["loss_transformers"]) <= BF16_LOSS_REL * bf16["loss_ours"]
        and bf16["mean_abs_diff"] <= BF16_SPREAD_FRACTION * bf16["logits_std"],
        "continued_run_starts_at_the_exported_loss": first is not None
        and all(abs(first - expected[who]) <= BF16_LOSS_REL * expected[who] for who in expected),
        "continued_run_wrote_samples": cont["exit_code"] == 0 and bool(cont["samples"]),
    }


def table(result: dict[str, Any]) -> str:
    rows = [f"{result['model']}: trained {result['steps']} steps (loss {result['trained_losses']['first']:.4f} -> "
            f"{result['trained_losses']['last']:.4f}), "
            f"exported, compared, continued on {result['gpus']} GPU(s)", "",
            "| precision | max abs diff | mean abs diff | logits std | loss ours | loss transformers | top-1 agreement |",
            "|---|---|---|---|---|---|---|"]
    for name in ("fp32", "bf16"):
        g = result["logits"][name]
        rows.append(f"| {name} | {g['max_abs_diff']:.3g} | {g['mean_abs_diff']:.3g} | {g['logits_std']:.3g} | "
                    f"{g['loss_ours']:.5f} | {g['loss_transformers']:.5f} | {g['top1_agreement']:.4f} |")
    e, c, first = result["export"], result["continued"], result["logits"]["first_batch_loss"]
    rows += ["", f"export: {e['wall_s']} s, peak resident memory {e['peak_rss_gb'] or float('nan'):.2f} GiB, "
                 f"{len(e['weights_files'])} files, {e['weights_gb']:.2f} GB",
             f"continued run (model.init_from, {result['gpus']} GPU(s)): first loss {c.get('first_loss')}; the exported "
             f"model's on that batch: ours {first['ours']:.5f}, transformers {first['transformers']:.5f} (a fresh "
             f"model's first loss: {result['trained_losses']['first']:.4f})",
             f"generate (greedy) from the export: {json.dumps(result['generated'])}",
             f"samples of the continued run (compiled, step 5): {json.dumps(c['samples'])}", ""]
    rows += [f"- {name}: {'PASS' if ok else 'FAIL'}" for name, ok in result["verdicts"].items()]
    rows += ["", "commands:"] + [f"- `{c}`" for c in result["commands"]]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    parser.add_argument("--gpus", type=int, default=1, help="processes of the continued-pretraining run")
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--runs", type=Path, default=Path("/tmp/hf-roundtrip"))
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    name = f"hf-roundtrip-{args.model}-{args.gpus}gpu"
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.runs, ignore_errors=True)  # a warm machine keeps the last call's runs: start afresh
    trained, folder, continued = args.runs / "trained", args.runs / "exported", args.runs / "continued"

    training = common.launch(train_overrides(args), trained, args.timeout, logs / f"{name}-train.log")
    print("trained", training, flush=True)
    exporting = export(trained, folder, logs / f"{name}-export.log", args.timeout)
    print("exported", exporting, flush=True)
    logits = compare(trained, folder, args)
    print("logits", json.dumps(logits), flush=True)
    generating = run([sys.executable, "-m", "pretrain.generate", str(folder), "--prompt", "The ", "--temperature", "0",
                      "--max-new-tokens", "48"], logs / f"{name}-generate.log", args.timeout)
    generated = (logs / f"{name}-generate.log").read_text().strip().splitlines()[-1:] or [""]
    continuing = common.launch(continue_overrides(args, folder), continued, args.timeout, logs / f"{name}-continue.log")
    losses = {r["step"]: r["loss"] for r in common.metrics(continued) if "loss" in r}
    samples = [s for r in common.metrics(continued) for s in r.get("samples", [])]
    trained_losses = {r["step"]: r["loss"] for r in common.metrics(trained) if "loss" in r}
    result = {**common.stamp(), "model": args.model, "steps": args.steps, "gpus": args.gpus,
              "trained_losses": {"first": trained_losses.get(1, math.nan), "last": trained_losses.get(args.steps, math.nan)},
              "export": exporting, "logits": logits,
              "generated": generated[0], "continued": {**continuing, "first_loss": losses.get(1), "losses": losses, "samples": samples},
              "commands": [training["command"], exporting["command"], generating["command"], continuing["command"]]}
    result["verdicts"] = verdicts(result)
    common.write_result(args.out, name, result, table(result))
    print(table(result))
    return 0 if all(result["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
