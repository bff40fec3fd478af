"""How fast `python -m pretrain.data.prepare` tokenizes a real corpus, against what the tokenizer allows.

    python bench/prepare_corpus.py               # once: the corpus (Debian documentation, ~290 MB of text)
    python bench/prepare_throughput.py [--workers 1 2] [--name prepare-throughput]

For each number of workers N, in this order and each in a fresh process:
  ceiling   the `tokenizers` library's own batch encoding (encode_batch and encode_batch_fast, the faster
            counts) of the same documents, already in memory, with N threads (RAYON_NUM_THREADS=N): no
            reading, no writing; only the time inside the encode calls is counted
  prepare   the command, wall clock from start to exit, on the parquet files and on the .jsonl.zst files
  megatron  Megatron-LM's tools/preprocess_data.py approach, emulated (the tool is not in the megatron-core
            wheel on PyPI): a multiprocessing.Pool of N workers, each json.loads one line of a plain jsonl
            and encodes that one document (tokenizer.encode, no batching), imap with chunksize 25, the main
            process appending each document's ids and EOS to a .bin and its length to an index
and the byte-level tokenizer's prepare. The tokenizer is a 32,768-token byte-level BPE trained on the
corpus's first 20 MB (bench/corpus/tokenizer.json): the kind of tokenizer GPT-2 and Llama 3 use.
Writes bench/results/NAME.json and NAME.md, with the machine, the commit and `uptime` before and after.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import common

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
CORPUS = BENCH / "corpus"
TOKENIZER = CORPUS / "tokenizer.json"
ENCODE_BATCH = 1000
EOS = "<|endoftext|>"


def documents() -> list[str]:
    import pyarrow.parquet as pq

    return [text for path in sorted((CORPUS / "parquet").glob("*.parquet"))
            for text in pq.read_table(path, columns=["text"]).column("text").to_pylist()]


def train_tokenizer() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sample, size = [], 0
    for text in documents():
        sample.append(text)
        size += len(text)
        if size > 20_000_000:
            break
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=32768, special_tokens=[EOS],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(TOKENIZER))


def ceiling(threads: str) -> dict:
    """Run in a process whose RAYON_NUM_THREADS is `threads`: the library's batch encoding, nothing else."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    texts = documents()
    result = {}
    for method in ("encode_batch", "encode_batch_fast"):
        encode = getattr(tokenizer, method)
        seconds, tokens = 0.0, 0
        for start in range(0, len(texts), ENCODE_BATCH):
            batch = texts[start:start + ENCODE_BATCH]
            began = time.perf_counter()
            encodings = encode(batch, add_special_tokens=False)
            seconds += time.perf_counter() - began
            tokens += sum(len(e.ids) for e in encodings) + len(batch)  # + one EOS each, as prepare writes
        result[method] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    return result


_encoder: dict = {}


def _megatron_init() -> None:
    from tokenizers import Tokenizer

    _encoder["tokenizer"] = Tokenizer.from_file(str(TOKENIZER))
    _encoder["eos"] = _encoder["tokenizer"].token_to_id(EOS)


def _megatron_encode(line: str) -> tuple[list[int], int]:
    text = json.loads(line)["text"]
    ids = _encoder["tokenizer"].encode(text, add_special_tokens=False).ids
    return ids + [_encoder["eos"]], len(line)


def megatron(workers: str, jsonl: str, out: str) -> dict:
    """preprocess_data.py's loop: Pool(workers).imap(encoder.encode, fin, 25), builder.add_item per document."""
    workers, out = int(workers), Path(out)
    began = time.perf_counter()
    sizes, tokens = [], 0
    with open(jsonl, encoding="utf-8") as fin, open(out, "wb") as sink:
        pool = multiprocessing.Pool(workers, initializer=_megatron_init)
        for ids, _ in pool.imap(_megatron_encode, fin, 25):
            sink.write(np.array(ids, dtype=np.uint16).tobytes())
            sizes.append(len(ids))
            tokens += len(ids)
        pool.close()
        pool.join()
    np.array(sizes, dtype=np.int32).tofile(out.with_suffix(".idx"))
    seconds = time.perf_counter() - began
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def prepare(inputs: Path, tokenizer: str, workers: int, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    began = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pretrain.data.prepare", str(inputs), "--out", str(out),
                             "--tokenizer", tokenizer, "--workers", str(workers)], cwd=REPO, capture_output=True,
                            text=True, check=True)
    seconds = time.perf_counter() - began
    index = json.loads((out / "index.json").read_text())
    tokens = index["num_tokens"]["train"] + index["num_tokens"]["val"]
    own = float(re.search(r"\(([\d,]+) tokens/s\)", result.stdout).group(1).replace(",", ""))
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "shards": len(index["shards"]),
            "documents": index["num_documents"], "own_tokens_per_s": own, "line": result.stdout.strip()}


def in_process(function: str, *args) -> dict:
    """One measurement in a fresh interpreter, the tokenizer's threads fixed before it is imported."""
    threads = str(args[0])
    code = f"import json, sys; sys.path.insert(0, {str(BENCH)!r}); import prepare_throughput as b; " \
           f"print(json.dumps(b.{function}(*{list(map(str, args))!r})))"
    env = {**os.environ, "RAYON_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "true"}
    output = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--name", default="prepare-throughput")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of every measurement; the best counts")
    parser.add_argument("--table", action="store_true", help="only write NAME.md again from NAME.json")
    args = parser.parse_args()
    results = BENCH / "results"
    if args.table:
        (results / f"{args.name}.md").write_text(table(json.loads((results / f"{args.name}.json").read_text())))
        return 0
    if not (CORPUS / "parquet").is_dir():
        print("no corpus: run python bench/prepare_corpus.py first", file=sys.stderr)
        return 1
    if not TOKENIZER.is_file():
        train_tokenizer()
    scratch = Path(tempfile.mkdtemp(prefix="prepare-bench-"))
    plain = scratch / "corpus.jsonl"  # Megatron reads plain jsonl: decompressed before any clock starts
    import zstandard

    with open(plain, "wb") as sink:
        for path in sorted((CORPUS / "jsonl.zst").glob("*.jsonl.zst")):
            sink.write(zstandard.ZstdDecompressor().decompress(path.read_bytes(), max_output_size=1 << 31))
    machine = f"{platform.node()}, {os.cpu_count()} CPUs ({_cpu_model()}), Python {platform.python_version()}"
    record = {"machine": machine,
              "date": time.strftime("%Y-%m-%d %H:%M"), "commit": common.commit(), "corpus": json.loads(
                  (CORPUS / "manifest.json").read_text()), "tokenizer": "byte-level BPE, 32,768 tokens, trained on "
              "the corpus's first 20 MB", "uptime_before": uptime(), "rounds": []}
    for _ in range(args.repeats):  # the machine is shared: every round measures everything, the best counts
        runs = {str(workers): measure(workers, plain, scratch) for workers in args.workers}
        record["rounds"].append({"uptime": uptime(), "runs": runs})  # uptime: the load as the round ended
        print(json.dumps(record["rounds"][-1], indent=1), flush=True)
    record["runs"] = best_of(record["rounds"])
    record["uptime_after"] = uptime()
    shutil.rmtree(scratch, ignore_errors=True)
    (results / f"{args.name}.json").write_text(json.dumps(record, indent=1) + "\n")
    (results / f"{args.name}.md").write_text(table(record))
    print(table(record))
    return 0


def measure(workers: int, plain: Path, scratch: Path) -> dict:
    return {"ceiling": in_process("ceiling", workers),
            "prepare_parquet": prepare(CORPUS / "parquet", str(TOKENIZER), workers, scratch / "out"),
            "prepare_jsonl_zst": prepare(CORPUS / "jsonl.zst", str(TOKENIZER), workers, scratch / "out"),
            "megatron_emulated": in_process("megatron", workers, plain, scratch / "megatron.bin"),
            "prepare_byte_parquet": prepare(CORPUS / "parquet", "byte", workers, scratch / "out")}


def best_of(rounds: list[dict]) -> dict:
    """Per number of workers, the fastest round of each measurement, and prepare's share of the ceiling."""
    best: dict = {}
    for workers in rounds[0]["runs"]:
        runs = {name: max((r["runs"][workers][name] for r in rounds), key=_rate) for name in rounds[0]["runs"][workers]}
        ceiling = _rate(runs["ceiling"])
        for name in ("prepare_parquet", "prepare_jsonl_zst", "megatron_emulated"):
            runs[name] = {**runs[name], "of_ceiling": runs[name]["tokens_per_s"] / ceiling}
        best[workers] = runs
    return best


def _rate(run: dict) -> float:
    """tokens/s of a run; of the ceiling, its faster method."""
    return run["tokens_per_s"] if "tokens_per_s" in run else max(m["tokens_per_s"] for m in run.values())


def table(record: dict) -> str:
    corpus = record["corpus"]
    lines = [f"# prepare throughput ({record['date']}, commit {record['commit']})", "",
             f"Machine: {record['machine']}. Load: before `{record['uptime_before']}`, after "
             f"`{record['uptime_after']}`.", "",
             f"Corpus: {corpus['documents']:,} documents, {corpus['text_bytes'] / 1e6:,.1f} MB of text from the "
             f"documentation of {len(corpus['packages'])} Debian packages ({', '.join(corpus['packages'])}); "
             f"tokenizer: {record['tokenizer']}. Tokens/s, wall clock of the whole command for prepare; the best of "
             f"{len(record['rounds'])} rounds (loads at their ends: "
             f"{'; '.join(r['uptime'].split('load average: ')[1] for r in record['rounds'])}).", "",
             "| workers | ceiling: encode_batch | encode_batch_fast | prepare, parquet | prepare, jsonl.zst "
             "| Megatron-style (emulated) | prepare, byte tokenizer |", "|---|---|---|---|---|---|---|"]
    for workers, runs in record["runs"].items():
        ceiling = runs["ceiling"]
        cells = [f"{ceiling[method]['tokens_per_s']:,.0f}" for method in ("encode_batch", "encode_batch_fast")]
        cells += [f"{runs[n]['tokens_per_s']:,.0f} ({runs[n]['of_ceiling']:.0%})"
                  for n in ("prepare_parquet", "prepare_jsonl_zst", "megatron_emulated")]
        cells.append(f"{runs['prepare_byte_parquet']['tokens_per_s']:,.0f}")
        lines.append(f"| {workers} | " + " | ".join(cells) + " |")
    lines += ["", "Percentages: of the faster of the two ceilings with the same number of threads.", "",
              "Each round (tokens/s; the ceiling is encode_batch_fast, prepare's share of that round's ceiling):", "",
              "| round, load at its end | workers | ceiling | prepare, parquet | prepare, jsonl.zst "
              "| Megatron-style |",
              "|---|---|---|---|---|---|"]
    for number, round_ in enumerate(record["rounds"], start=1):
        for workers, runs in round_["runs"].items():
            ceiling = _rate(runs["ceiling"])
            cells = [f"{runs[n]['tokens_per_s']:,.0f} ({runs[n]['tokens_per_s'] / ceiling:.0%})"
                     for n in ("prepare_parquet", "prepare_jsonl_zst", "megatron_emulated")]
            load = round_["uptime"].split("load average: ")[1]
            lines.append(f"| {number}, {load} | {workers} | {ceiling:,.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
