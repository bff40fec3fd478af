"""A prepare from start to end: plan the shards, write them with worker processes, publish the index.

    plan = make_plan(...)      the inputs cut into pieces, one per new shard (pretrain.data.inputs)
    begin(plan)                the folder made, the leftovers of an interrupted prepare removed
    write_shards(plan, ...)    each piece tokenized into its shard (pretrain.data.shards), here by
                               `workers` processes, or by the tasks of a Slurm job array
    finish(plan)               every planned shard present: index.json written, replaced shards removed

`prepare()` does all four on this machine. The job array (pretrain.launcher.dataprep) plans on the
login node, saves the plan in the dataset folder (.prepare/plan.json), runs write_shards for a range
of shards in each task, and finish in a last job. Until index.json is replaced the folder holds the
previous dataset, or none: a prepare that fails or is interrupted never leaves a dataset that looks
complete but is not, and a failed first prepare on this machine leaves no folder at all.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import shutil
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from pretrain.data import inputs
from pretrain.data.errors import DataError
from pretrain.data.layout import (FORMAT_VERSION, INDEX_FILE, LEGACY_FORMAT, LEGACY_META_FILE, SHARDS_DIR, SPLITS,
                                  TOKENIZER_DIR, is_dataset, read_index, shard_bin, shard_record, token_dtype,
                                  tokenizer_copy, val_tokens, write_json)
from pretrain.data.progress import Progress
from pretrain.data.shards import index_entry, piece_texts, write_shard
from pretrain.data.tokenizer import BYTE, Tokenizer, load_tokenizer

DEFAULT_VAL_FRACTION = 0.005
DEFAULT_TEXT_FIELD = "text"
# Input bytes per shard: small enough that the last shards of a prepare keep every worker busy.
DEFAULT_SHARD_MB = 32
PLAN_DIR = ".prepare"
PLAN_FILE = "plan.json"


@dataclass
class Plan:
    """Everything the writers of the new shards need; saved as .prepare/plan.json for a job array."""

    out: str
    tokenizer: str
    eos: str | None
    text_field: str
    val_fraction: float
    append: bool
    first_number: int
    pieces: list[list[dict[str, Any]]]
    # Worker processes per machine (per task of a job array); None: the cores available there.
    workers: int | None = None
    # Made by this prepare: removed again if a prepare on this machine fails.
    created: bool = False
    jobs: list[str] = field(default_factory=list)

    @property
    def numbers(self) -> range:
        return range(self.first_number, self.first_number + len(self.pieces))

    def piece(self, number: int) -> inputs.Piece:
        return inputs.piece_from_json(self.pieces[number - self.first_number])

    @property
    def input_bytes(self) -> int:
        return sum(part["size"] for piece in self.pieces for part in piece)

    def save(self) -> None:
        (Path(self.out) / PLAN_DIR).mkdir(exist_ok=True)
        write_json(plan_path(self.out), asdict(self))

    @staticmethod
    def load(out: str | Path) -> Plan:
        path = plan_path(out)
        if not path.is_file():
            raise DataError(f"{out}: no prepare in progress ({path} is missing)")
        return Plan(**json.loads(path.read_text(encoding="utf-8")))


def plan_path(out: str | Path) -> Path:
    return Path(out) / PLAN_DIR / PLAN_FILE


def available_cores() -> int:
    return len(os.sched_getaffinity(0))


def prepare(paths: Sequence[str | Path], out: str | Path, tokenizer: str = BYTE,
            val_fraction: float = DEFAULT_VAL_FRACTION, *, eos: str | None = None,
            text_field: str = DEFAULT_TEXT_FIELD, workers: int | None = 1, shard_mb: float = DEFAULT_SHARD_MB,
            append: bool = False) -> Path:
    """Tokenize `paths` (files, folders, globs) into the dataset folder `out`, here; workers None: one per core."""
    plan = make_plan(paths, out, tokenizer, val_fraction, eos=eos, text_field=text_field, shard_mb=shard_mb,
                     append=append, workers=workers)
    run_here(plan)
    return Path(out)


def run_here(plan: Plan) -> Progress:
    """Every step of the plan on this machine; the progress, with what was done and how long it took."""
    begin(plan)
    progress = Progress(plan.input_bytes)
    try:
        write_shards(plan, plan.numbers, plan.workers or available_cores(), progress)
        progress.close()
        finish(plan)
    except BaseException:
        progress.close()
        abandon(plan)
        raise
    return progress


def make_plan(paths: Sequence[str | Path], out: str | Path, tokenizer: str, val_fraction: float, *,
              eos: str | None, text_field: str, shard_mb: float, append: bool, workers: int | None) -> Plan:
    """Check everything that can be checked before writing, and cut the inputs into the new shards."""
    out = Path(out)
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction {val_fraction}: must be in [0, 1)")
    if shard_mb <= 0:
        raise DataError(f"--shard-mb {shard_mb}: must be above 0")
    if workers is not None and workers < 1:
        raise DataError(f"--workers {workers}: must be at least 1")
    if plan_path(out).is_file():
        raise DataError(f"{out}: a prepare is in progress there ({plan_path(out)}: {_jobs_of(out)}); wait for it to "
                        f"end, or if it has ended without cleaning up, remove {out / PLAN_DIR}")
    loaded = load_tokenizer(tokenizer, eos)
    previous = _previous_index(out, loaded, append)
    files = inputs.find_input_files(paths)
    pieces = [inputs.piece_to_json(p) for p in inputs.plan_pieces(files, max(int(shard_mb * 1e6), 1))]
    return Plan(out=str(out), tokenizer=tokenizer, eos=eos, text_field=text_field, val_fraction=val_fraction,
                append=append, first_number=next_number(previous), pieces=pieces, workers=workers)


def next_number(index: dict[str, Any]) -> int:
    """The first shard number of a new prepare: above every shard of the dataset it appends to or replaces."""
    return max((shard["number"] for shard in index.get("shards", [])), default=-1) + 1


def _jobs_of(out: Path) -> str:
    try:
        jobs = Plan.load(out).jobs
    except (DataError, ValueError, TypeError):
        return "unreadable"
    return f"Slurm jobs {', '.join(jobs)}" if jobs else "no Slurm job recorded"


def _previous_index(out: Path, tokenizer: Tokenizer, append: bool) -> dict[str, Any]:
    """The dataset at `out` that this prepare replaces or appends to ({} for none), checked for an append."""
    if out.exists() and not out.is_dir():
        raise DataError(f"output {out}: not writable (it is a file, not a folder)")
    if not is_dataset(out):
        if append:
            raise DataError(f"--append: no prepared dataset at {out} to add to; leave --append out to make one")
        return {}
    index = read_index(out)
    if not append:
        return index
    if index["format"] == LEGACY_FORMAT:
        raise DataError(f"--append: {out} is a dataset of format {LEGACY_FORMAT} (train.bin, val.bin), which "
                        f"takes no shards; prepare all of its input again without --append")
    if (index.get("tokenizer"), index.get("tokenizer_sha256"), index.get("eos_id")) != (
            tokenizer.name, tokenizer.fingerprint, tokenizer.eos_id):
        raise DataError(f"--append: {out} was prepared with tokenizer {index.get('tokenizer')} (EOS id "
                        f"{index.get('eos_id')}), not {tokenizer.name} (EOS id {tokenizer.eos_id}); append with "
                        "the same --tokenizer and --eos")
    return index


def begin(plan: Plan) -> None:
    """Make the folder (writable) and remove shard files no index names: an interrupted prepare's."""
    out = Path(plan.out)
    plan.created = not out.exists()
    try:
        (out / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DataError(f"output {out}: not writable ({error.strerror or error})") from None
    _remove_unlisted(out, _listed(out))


@contextmanager
def _single_threaded_here() -> Iterator[None]:
    """The tokenizer library's own threads off while this process encodes: one worker, one core."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def write_shards(plan: Plan, numbers: Iterable[int], workers: int, progress: Progress) -> list[dict]:
    """Write the planned shards `numbers`: in this process for one worker, else in `workers` processes,
    the largest pieces first (the last ones then keep every process busy). The records, by number."""
    numbers = sorted(numbers, key=lambda n: -sum(part["size"] for part in plan.pieces[n - plan.first_number]))
    if workers == 1 or len(numbers) <= 1:
        tokenizer = load_tokenizer(plan.tokenizer, plan.eos)
        with _single_threaded_here():
            records = [_write_planned(plan, tokenizer, number, progress.add) for number in numbers]
    else:
        records = _in_processes(plan, numbers, min(workers, len(numbers)), progress)
    return sorted(records, key=lambda record: record["number"])


def _write_planned(plan: Plan, tokenizer: Tokenizer, number: int, report) -> dict:
    piece = plan.piece(number)
    return write_shard(plan.out, number, piece_texts(piece, plan.text_field), [p.describe() for p in piece],
                       tokenizer, token_dtype(tokenizer.vocab_size), report, sum(part.size for part in piece))


def _in_processes(plan: Plan, numbers: list[int], workers: int, progress: Progress) -> list[dict]:
    """Worker processes (spawned: no state inherited) taking shards from a queue; the first error, or a
    worker that dies (out of memory, killed), stops them all."""
    context = multiprocessing.get_context("spawn")
    tasks, results = context.Queue(), context.Queue()
    for number in numbers:
        tasks.put(number)
    for _ in range(workers):
        tasks.put(None)
    processes = [context.Process(target=_worker, args=(asdict(plan), tasks, results), daemon=True)
                 for _ in range(workers)]
    for process in processes:
        process.start()
    records: list[dict] = []
    try:
        while len(records) < len(numbers):
            try:
                kind, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
                if dead:
                    raise DataError(f"a prepare worker died (exit code {dead[0]}: out of memory, or killed); "
                                    "run the prepare again, with fewer --workers if memory is short") from None
                continue
            if kind == "progress":
                progress.add(*payload)
            elif kind == "done":
                records.append(payload)
            else:
                raise payload
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join()
    return records


def _worker(plan_fields: dict, tasks, results) -> None:
    """One worker process: shards from `tasks` until None, records (or the error) to `results`."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        plan = Plan(**plan_fields)
        tokenizer = load_tokenizer(plan.tokenizer, plan.eos)
        while (number := tasks.get()) is not None:
            record = _write_planned(plan, tokenizer, number, lambda *counts: results.put(("progress", counts)))
            results.put(("done", record))
    except (DataError, OSError) as error:
        results.put(("error", error))
    except BaseException:  # noqa: BLE001 - anything else reaches the main process as its traceback
        results.put(("error", RuntimeError(f"prepare worker failed:\n{traceback.format_exc()}")))


def finish(plan: Plan) -> dict[str, Any]:
    """Publish: every planned shard must be complete; then the new index, then the replaced shards go."""
    out = Path(plan.out)
    missing = [n for n in plan.numbers if not shard_record(out, n).is_file()]
    if missing:
        shown = ", ".join(str(n) for n in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise DataError(f"{out}: shards {shown} of {len(plan.pieces)} were not written (their tasks failed or were "
                        "cancelled: see their logs); the previous dataset, if any, is unchanged; run the prepare again")
    tokenizer = load_tokenizer(plan.tokenizer, plan.eos)
    records = [json.loads(shard_record(out, n).read_text(encoding="utf-8")) for n in plan.numbers]
    previous = _current_index(out)
    kept = previous.get("shards", []) if plan.append else []
    new = [index_entry(r, val_tokens(r["tokens"], plan.val_fraction)) for r in records if r["tokens"]]
    shards = kept + new
    if not sum(shard["tokens"] for shard in shards):
        sources = [part["path"] for piece in plan.pieces for part in piece]
        raise DataError(f"no text to tokenize in {_describe(sources)}")
    index = {
        "format": FORMAT_VERSION,
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "tokenizer": tokenizer.name,
        "tokenizer_sha256": tokenizer.fingerprint,
        "num_tokens": {"train": sum(s["tokens"] - s["val_tokens"] for s in shards),
                       "val": sum(s["val_tokens"] for s in shards)},
        "num_documents": sum(shard["documents"] for shard in shards),
        "shards": shards,
    }
    _keep_tokenizer(out, tokenizer)
    write_json(out / INDEX_FILE, index)
    _remove_other_tokenizers(out, tokenizer)
    _remove_unlisted(out, {shard["number"] for shard in shards})
    if not plan.append:
        for name in (LEGACY_META_FILE, *(f"{split}.bin" for split in SPLITS)):
            (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / PLAN_DIR, ignore_errors=True)
    return index


def _keep_tokenizer(out: Path, tokenizer: Tokenizer) -> None:
    """A copy of the tokenizer's files in the dataset, under its sha256 (so a copy never changes under an
    index that names it): exports and generation find the tokenizer even after the original is gone."""
    files = tokenizer.files()
    if not files:
        return
    folder = tokenizer_copy(out, tokenizer.fingerprint)
    folder.mkdir(parents=True, exist_ok=True)
    for name, path in files.items():
        tmp = folder / f".{name}.tmp"
        shutil.copyfile(path, tmp)
        os.replace(tmp, folder / name)


def _remove_other_tokenizers(out: Path, tokenizer: Tokenizer) -> None:
    mine = tokenizer_copy(out, tokenizer.fingerprint) if tokenizer.fingerprint else None
    for folder in (out / TOKENIZER_DIR).glob("*") if (out / TOKENIZER_DIR).is_dir() else []:
        if folder != mine:
            shutil.rmtree(folder, ignore_errors=True)


def _current_index(out: Path) -> dict[str, Any]:
    """The index of the dataset at `out`, or {} where there is none yet."""
    return read_index(out) if is_dataset(out) else {}


def _listed(out: Path) -> set[int]:
    """The numbers of the shards the current index names."""
    return {shard["number"] for shard in _current_index(out).get("shards", [])}


def _remove_unlisted(out: Path, listed: set[int]) -> None:
    for path in (out / SHARDS_DIR).iterdir():
        number = path.name.split(".")[0]
        if not (number.isdigit() and int(number) in listed):
            path.unlink()


def abandon(plan: Plan) -> None:
    """After a failure: the new shards removed, the previous dataset (if any) as it was; a folder this
    prepare made on this machine removed whole."""
    out = Path(plan.out)
    if plan.created and not is_dataset(out):
        shutil.rmtree(out, ignore_errors=True)
        return
    if (out / SHARDS_DIR).is_dir():
        _remove_unlisted(out, _listed(out))
    shutil.rmtree(out / PLAN_DIR, ignore_errors=True)


def write_dataset(documents: Iterable[str], out: str | Path, tokenizer: str, val_fraction: float,
                  source: str) -> Path:
    """Documents held in memory (the built-in corpus) into a dataset of one shard at `out`."""
    previous = _current_index(Path(out))
    plan = Plan(out=str(out), tokenizer=tokenizer, eos=None, text_field=DEFAULT_TEXT_FIELD,
                val_fraction=val_fraction, append=False, first_number=next_number(previous), pieces=[[]])
    begin(plan)
    try:
        loaded = load_tokenizer(tokenizer)
        write_shard(out, plan.first_number, ((text, 0) for text in documents), [source], loaded,
                    token_dtype(loaded.vocab_size), lambda *counts: None)
        finish(plan)
    except BaseException:
        abandon(plan)
        raise
    return Path(out)


def summary(out: str | Path, progress: Progress) -> str:
    """The line a prepare ends with: the dataset, and what this prepare added to it at what speed."""
    index = read_index(Path(out))
    counts = index["num_tokens"]
    return (f"wrote {out}: {counts['train']} train + {counts['val']} val tokens ({index['dtype']}) in "
            f"{len(index['shards'])} shards; this prepare: {progress.tokens:,} tokens of {progress.documents:,} "
            f"documents in {progress.elapsed:.1f} s ({progress.tokens / max(progress.elapsed, 1e-9):,.0f} tokens/s)")


def _describe(sources: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(sources[:limit])
    return shown + (f" (+{len(sources) - limit} more)" if len(sources) > limit else "")
