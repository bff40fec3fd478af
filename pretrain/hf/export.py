"""`python -m pretrain.export RUN_DIR [--step N] --out DIR [--dtype bf16|fp32]`: a run's checkpoint as a
Hugging Face Llama folder (pretrain.hf_format) that transformers loads as LlamaForCausalLM, and with it
lm-evaluation-harness, vLLM, TRL, PEFT and the hub.

It runs on the CPU in one process with no process group (a login node will do), on a checkpoint written
by any number of processes: the newest complete one unless --step names another, its checksums checked
first. Tensors are read, converted (names, the RoPE row order of wq and wk, dtype) and written one
output shard at a time (--max-shard-gb), so memory stays near one shard whatever the model's size.
The folder is written under a temporary name beside DIR and renamed once complete: a DIR is whole.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from pretrain import hf_format, rundir
from pretrain.config import Config, ConfigError
from pretrain.data.errors import DataError
from pretrain.hf import tokenizer_files
from pretrain.hf.checkpoint_weights import CheckpointWeights
from pretrain.hf.layout import to_hf
from pretrain.rundir import CheckpointError
from pretrain.trainer import checkpoint

MAX_SHARD_GB = 5.0  # as transformers' save_pretrained (10**9 bytes)


class ExportError(RuntimeError):
    """An export that cannot be made; the message says why and what to do."""


@dataclass(frozen=True)
class Exported:
    checkpoint: Path
    folder: Path
    files: list[str]
    total_bytes: int
    tokenizer: str  # what was written for it, in words


def plan_shards(shapes: dict[str, tuple[int, ...]], itemsize: int, max_bytes: float) -> list[list[str]]:
    """The tensors of each output file, in order, each file within max_bytes (or one tensor larger)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_weights(weights: CheckpointWeights, cfg: Config, folder: Path, dtype: torch.dtype,
                  max_bytes: float) -> tuple[list[str], int]:
    """The model's tensors in Hugging Face's names and layout as safetensors files (an index when there
    are several); returns the file names and the total size of the tensors."""
    from safetensors.torch import save_file

    shards = plan_shards(hf_format.parameter_shapes(cfg.model), dtype.itemsize, max_bytes)
    names = ([hf_format.WEIGHTS_FILE] if len(shards) == 1 else
             [f"model-{index:05d}-of-{len(shards):05d}.safetensors" for index in range(1, len(shards) + 1)])
    head_dim = cfg.model.dim // cfg.model.n_heads
    weight_map, total = {}, 0
    for file, shard in zip(names, shards):
        tensors = {}
        for name in shard:  # one tensor read at a time: the shard in the output dtype, plus one tensor
            tensor = weights.read([name])[name]
            tensors[hf_format.hf_name(name)] = to_hf(name, tensor, head_dim).to(dtype).contiguous()
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / hf_format.INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return names, total


def readable_as_umask_allows(folder: Path) -> None:
    """Give the folder and its files the modes new files get here (mkdtemp and safetensors make them
    private, 0700 and 0600): an export is for sharing."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for file in folder.iterdir():
        file.chmod(0o666 & ~umask)


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not an empty folder; give a new or empty folder "
                          "(nothing in it was changed)")


def export(run_dir: Path, out: Path, step: int | None = None, dtype: str = "bf16",
           max_shard_gb: float = MAX_SHARD_GB) -> Exported:
    """Write the run's checkpoint (newest complete, or of `step`) as a Hugging Face Llama folder `out`."""
    run_dir, out = Path(run_dir), Path(out)
    if not rundir.is_run_dir(run_dir):
        raise ExportError(f"{run_dir} is not a run directory (no {rundir.MARKER} and {rundir.CONFIG_FILE}); give "
                          "the hydra.run.dir of a run")
    check_out(out)
    cfg = rundir.load_config(run_dir)
    path = rundir.checkpoint_of(run_dir, step)
    rundir.check_compatible(path, cfg.model)
    damage = checkpoint.problems(path)
    if damage:
        raise CheckpointError(f"checkpoint {path} is damaged ({'; '.join(damage[:3])}); export an earlier one "
                              "with --step N")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        files, total = write_weights(CheckpointWeights(path), cfg, staging, getattr(torch, hf_format.DTYPES[dtype]),
                                     max_shard_gb * 1e9)
        try:
            tokenizer = tokenizer_files.write(cfg, staging)
            said = "none (the run trained on synthetic data)" if tokenizer is None else tokenizer.name
        except DataError as error:
            tokenizer, said = None, f"none: {error}; copy the data's tokenizer.json into {out} yourself"
        eos_id = None if tokenizer is None else tokenizer.eos_id
        write_json(staging / hf_format.CONFIG_FILE, hf_format.config_json(cfg.model, hf_format.DTYPES[dtype], eos_id))
        write_json(staging / hf_format.GENERATION_CONFIG_FILE, {"bos_token_id": None, "eos_token_id": eos_id})
        readable_as_umask_allows(staging)
        check_out(out)  # still free: nothing else wrote there meanwhile
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Exported(path, out, files, total, said)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.export", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory with a complete checkpoint")
    parser.add_argument("--out", required=True, type=Path, help="the folder to write (new or empty)")
    parser.add_argument("--step", type=int, help="the checkpoint's step (default: the newest complete one)")
    parser.add_argument("--dtype", choices=sorted(hf_format.DTYPES), default="bf16",
                        help="the dtype of the exported weights (default: bf16)")
    parser.add_argument("--max-shard-gb", type=float, default=MAX_SHARD_GB,
                        help=f"the largest weights file; above it, shards and an index (default: {MAX_SHARD_GB:g})")
    args = parser.parse_args(argv)
    try:
        done = export(args.run_dir, args.out, args.step, args.dtype, args.max_shard_gb)
    except (ExportError, CheckpointError, ConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # a full disk, a folder one may not write: nothing is left half-written
        print(f"error: could not write {args.out} ({error.strerror or error}); free space or choose another --out",
              file=sys.stderr)
        return 1
    print(f"exported {done.checkpoint} to {done.folder}: {len(done.files)} weights file"
          f"{'s' if len(done.files) > 1 else ''}, {done.total_bytes / 1e6:,.1f} MB in {args.dtype}; "
          f"tokenizer: {done.tokenizer}")
    return 0
