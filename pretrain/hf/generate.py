"""`python -m pretrain.generate RUN_DIR|EXPORTED_DIR --prompt "..." [--max-new-tokens N --temperature T
--top-p P --seed S --step N]`: what a model says after a prompt.

A run directory: its newest complete checkpoint (or that of --step) and its data's tokenizer. A folder
with a config.json: a Hugging Face Llama folder (`python -m pretrain.export` writes them) and its
tokenizer.json. One process, on the GPU when there is one, in fp32; a KV cache makes each new token one
forward of one position (pretrain.models.sampling). Temperature 0 is greedy and deterministic.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import torch

from pretrain import hf_format, rundir
from pretrain.config import ConfigError, ModelConfig, SamplingConfig, sampling_problem
from pretrain.data import source
from pretrain.data.errors import DataError
from pretrain.data.layout import TOKENIZER_FILE
from pretrain.data.tokenizer import HFTokenizer, Tokenizer
from pretrain.hf import weights
from pretrain.hf.checkpoint_weights import CheckpointWeights
from pretrain.models.llama import Transformer
from pretrain.models.sampling import continue_text
from pretrain.rundir import CheckpointError


def empty_model(cfg: ModelConfig, device: torch.device) -> Transformer:
    """The model with uninitialised weights (no time spent on random ones), to load into."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_buffers()
    return model.eval()


@torch.no_grad()
def from_run(run_dir: Path, step: int | None, device: torch.device) -> tuple[Transformer, Tokenizer]:
    """A run's checkpoint and its data's tokenizer."""
    cfg = rundir.load_config(run_dir)
    path = rundir.checkpoint_of(run_dir, step)
    rundir.check_compatible(path, cfg.model)
    tokenizer = source.tokenizer(cfg)
    if tokenizer is None:
        raise DataError(f"{run_dir} trained on synthetic data, which has no tokenizer to read a prompt with")
    model = empty_model(cfg.model, device)
    stored, state = CheckpointWeights(path), model.state_dict()
    for name in hf_format.parameter_shapes(cfg.model):  # tied embeddings: the output layer is the embedding
        state[name].copy_(stored.read([name])[name])
    return model, tokenizer


def from_folder(folder: Path, device: torch.device) -> tuple[Transformer, Tokenizer]:
    """A Hugging Face Llama folder and its tokenizer.json."""
    cfg = ModelConfig(name=folder.name, **hf_format.model_fields(hf_format.read_config(folder), folder))
    if not (folder / TOKENIZER_FILE).is_file():
        raise DataError(f"{folder} has no {TOKENIZER_FILE}: copy the model's tokenizer there")
    tokenizer = HFTokenizer(folder / TOKENIZER_FILE)
    model = empty_model(cfg, device)
    weights.load(model, cfg, folder)
    return model, tokenizer


def load(path: Path, step: int | None, device: torch.device) -> tuple[Transformer, Tokenizer]:
    if rundir.is_run_dir(path):
        return from_run(path, step, device)
    if (path / hf_format.CONFIG_FILE).is_file():
        if step is not None:
            raise ConfigError(f"--step {step}: {path} is an exported folder, which has one set of weights")
        return from_folder(path, device)
    raise ConfigError(f"{path} is neither a run directory nor a Hugging Face model folder (no {rundir.CONFIG_FILE} "
                      f"with {rundir.MARKER}, no {hf_format.CONFIG_FILE})")


def main(argv: Sequence[str] | None = None) -> int:
    defaults = SamplingConfig()
    parser = argparse.ArgumentParser(prog="python -m pretrain.generate", description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path, metavar="RUN_DIR|EXPORTED_DIR")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--temperature", type=float, default=defaults.temperature, help="0: greedy, deterministic")
    parser.add_argument("--top-p", type=float, default=defaults.top_p)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--step", type=int, help="a run's checkpoint of this step (default: the newest)")
    args = parser.parse_args(argv)
    sampling = SamplingConfig(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    problem = sampling_problem(sampling)
    if problem:
        field, must = problem
        parser.error(f"--{field.replace('_', '-')} {getattr(sampling, field)}: {must}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        model, tokenizer = load(args.model, args.step, device)
        print(args.prompt + continue_text(model, tokenizer, args.prompt, sampling, device))
    except (ConfigError, CheckpointError, DataError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
