"""Mixtures (data.mix): exact shares, samples that depend only on (seed, index), checks before anything
runs, and real runs whose resume and world size change nothing of what they read."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pretrain.data.build import prepare
from pretrain.data.dataset import TokenDataset
from pretrain.data.mixture import MIX_BLOCK, MixtureDataset, block_counts
from pretrain.data.sampling import rank_indices
from tests.helpers import MINI_MODEL, assert_same_losses, launch, losses, metrics

SOURCES = {"code": "def f(x):\n    return x + 1\n", "math": "1 + 1 = 2; 2 * 3 = 6.\n", "web": "The web page says hi.\n"}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, Path]:
    """Three byte-level datasets whose text tells them apart, each with a validation split."""
    root = tmp_path_factory.mktemp("mix")
    made = {}
    for name, text in SOURCES.items():
        (root / f"{name}.txt").write_text(text * 400)
        made[name] = prepare([root / f"{name}.txt"], root / name, val_fraction=0.2)
    return made


def mixture(datasets: dict[str, Path], weights: dict[str, float]) -> MixtureDataset:
    return MixtureDataset({name: TokenDataset(datasets[name]) for name in weights}, weights)


def mix_override(datasets: dict[str, Path], weights: dict[str, float]) -> str:
    entries = ",".join(f"{name}:{{path:{datasets[name]},weight:{weight}}}" for name, weight in weights.items())
    return f"+data.mix={{{entries}}}"


def test_block_counts_are_the_weights_in_whole_samples():
    assert block_counts([70, 20, 10]) == [7000, 2000, 1000]
    assert block_counts([0.7, 0.2, 0.1]) == [7000, 2000, 1000]
    assert block_counts([1, 1, 1]) == [3334, 3333, 3333]
    assert sum(block_counts([3, 5, 11, 0.5])) == MIX_BLOCK


def test_each_block_holds_the_shares_exactly_and_each_source_is_read_in_order(datasets):
    mix = mixture(datasets, {"web": 70, "code": 20, "math": 10})
    located = [mix.locate(i, seed=7) for i in range(2 * MIX_BLOCK)]
    for block in range(2):
        shares = Counter(mix.names[s] for s, _ in located[block * MIX_BLOCK:(block + 1) * MIX_BLOCK])
        assert shares == {"web": 7000, "code": 2000, "math": 1000}
    for source, count in enumerate(mix.counts):
        own = [j for s, j in located if s == source]
        assert own == list(range(2 * count))  # every sample of the source once, in its own order
    assert located[:50] != [mix.locate(i, seed=8) for i in range(50)]  # the seed orders each block


def test_a_sample_depends_only_on_the_seed_and_its_index(datasets):
    weights = {"web": 7, "code": 2, "math": 1}
    indices = random.Random(0).sample(range(10 * MIX_BLOCK), 200)
    reference = [mixture(datasets, weights).locate(i, seed=3) for i in indices]
    shuffled = sorted(zip(indices, reference), key=lambda pair: -pair[0])
    fresh = mixture(datasets, weights)
    assert all(fresh.locate(i, seed=3) == expected for i, expected in shuffled)
    # Whatever the world size, the ranks' micro-batches of a step are the same samples.
    start, global_batch = 5 * MIX_BLOCK - 8, 16
    whole = np.concatenate(fresh.get_batch(list(range(start, start + global_batch)), seq_len=8, seed=3))
    for world in (1, 2, 4):
        parts = [fresh.get_batch(rank_indices(start, global_batch, world, rank, 2, micro), seq_len=8, seed=3)
                 for rank in range(world) for micro in range(global_batch // (world * 2))]
        assert np.array_equal(np.concatenate([np.concatenate(p) for p in zip(*parts)]), whole)


def test_samples_come_from_their_source(datasets):
    mix = mixture(datasets, {"web": 1, "code": 1})
    inputs, _ = mix.get_batch(list(range(64)), seq_len=16, seed=0)
    for index, row in enumerate(inputs):
        source, own = mix.locate(index, seed=0)
        expected = TokenDataset(datasets[mix.names[source]]).window(own, 16, 0)[:-1]
        assert np.array_equal(row, expected)


@pytest.mark.parametrize("weights, message", [
    ({"web": 0, "code": 1}, "data.mix.web.weight=0.0: must be a number above 0"),
    ({"web": 1, "code": -2}, "data.mix.code.weight=-2.0: must be a number above 0"),
    ({"web": 1, "code": 0.00001}, "data.mix.code.weight=1e-05: less than one sample in 10000"),
])
def test_a_mixture_is_checked_before_anything_runs(datasets, tmp_path, weights, message):
    result = launch(mix_override(datasets, weights), "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2 and result.stderr.startswith(f"error: {message}"), result.stderr
    assert not (tmp_path / "run").exists()


def test_mixture_paths_names_and_tokenizers_are_checked(datasets, tmp_path):
    missing = {**datasets, "web": tmp_path / "nowhere"}
    result = launch(mix_override(missing, {"web": 1, "code": 1}), "dry_run=true", f"hydra.run.dir={tmp_path / 'r'}")
    assert result.returncode == 2 and f"error: data.mix.web: data.path={tmp_path / 'nowhere'}: no prepared dataset" \
        in result.stderr, result.stderr
    both = launch(mix_override(datasets, {"web": 1}), f"data.path={datasets['code']}", "dry_run=true")
    assert both.returncode == 2 and "data.mix and data.path=" in both.stderr and "keep one of them" in both.stderr
    named = launch(mix_override({"a/b": datasets["web"]}, {"a/b": 1}), "dry_run=true")
    assert named.returncode == 2 and "a source's name must be letters, digits and _.-" in named.stderr

    tokenizers = pytest.importorskip("tokenizers")
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "</s>": 1, "hi": 2}, unk_token="<unk>"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    words.save(str(tmp_path / "words.json"))
    (tmp_path / "hi.txt").write_text("hi " * 3000)
    other = prepare([tmp_path / "hi.txt"], tmp_path / "words", tokenizer=str(tmp_path / "words.json"))
    mixed = launch(mix_override({**datasets, "words": other}, {"web": 1, "words": 1}), "dry_run=true")
    assert mixed.returncode == 2 and "data.mix: web and words differ in their tokenizer" in mixed.stderr, mixed.stderr


RUN = ("train.steps=12", "train.log_every=1", "train.ckpt_every=6", "train.eval_every=6", "train.eval_batches=1",
       "precision=fp32", "train.global_batch=8", "train.micro_batch=2", *MINI_MODEL)


def test_a_mixture_trains_resumes_exactly_and_reads_the_same_on_two_processes(datasets, tmp_path):
    mix = mix_override(datasets, {"web": 70, "code": 20, "math": 10})
    whole, split, two = tmp_path / "whole", tmp_path / "split", tmp_path / "two"
    result = launch(mix, *RUN, f"hydra.run.dir={whole}")
    assert result.returncode == 0, result.stderr[-2000:]
    evals = [r for r in metrics(whole) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [6, 12]
    for record in evals:  # per source, and their mean weighted as the mixture is
        per_source = {name: record[f"eval_loss/{name}"] for name in SOURCES}
        assert record["eval_loss"] == pytest.approx(0.7 * per_source["web"] + 0.2 * per_source["code"]
                                                    + 0.1 * per_source["math"])
    assert "eval loss" in result.stdout + result.stderr and "(code " in (whole / "train.log").read_text()

    assert launch(mix, *RUN, "train.stop_at_step=6", f"hydra.run.dir={split}").returncode == 0
    resumed = launch(mix, *RUN, f"hydra.run.dir={split}")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-2000:]
    assert_same_losses(losses(split), losses(whole), range(7, 13))

    assert launch(mix, *RUN, "local.nproc=2", f"hydra.run.dir={two}").returncode == 0
    for step in range(1, 13):  # the same samples; only the order of floating-point reductions differs
        assert losses(two)[step] == pytest.approx(losses(whole)[step], abs=2e-3), step
