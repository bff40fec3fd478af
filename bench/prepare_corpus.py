"""Build the benchmark corpus of bench/prepare_throughput.py: documentation of Debian packages, as text.

    python bench/prepare_corpus.py            # into bench/corpus/ (git-ignored); about 5 minutes

Downloads a fixed list of Debian documentation packages (`apt-get download`: the versions of the
machine's package lists, recorded in bench/corpus/manifest.json), unpacks them (`dpkg-deb -x`), and
turns every documentation file into one document: HTML to its text (tags, scripts and styles
dropped), reStructuredText, POD, Markdown and plain text as they are, gzip-compressed ones
decompressed. Exact duplicates and documents under 200 characters are left out. The documents, in
the order of their paths, are written as 16 parquet files (a "text" column) and 16 .jsonl.zst files
(a "text" key), the formats FineWeb and the Pile ship in. Nobody here wrote any of it.
"""

from __future__ import annotations

import gzip
import hashlib
import html.parser
import json
import subprocess
import sys
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "corpus"
PACKAGES = ("linux-doc-6.1", "python3.11-doc", "rust-doc", "openjdk-17-doc", "python-django-doc", "cmake-doc",
            "perl-doc", "postgresql-doc-15", "ruby3.1-doc", "nodejs-doc", "git-doc", "sphinx-doc")
TEXT_SUFFIXES = (".txt", ".rst", ".md", ".pod", ".pm", ".pl", ".tex", ".texi", ".adoc", ".asciidoc")
HTML_SUFFIXES = (".html", ".htm", ".xhtml")
MIN_CHARACTERS = 200
FILES = 16


class _Text(html.parser.HTMLParser):
    """The text of an HTML page: what a reader sees, without scripts, styles and navigation markup."""

    SKIPPED = {"script", "style", "head", "nav"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skipping = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIPPED:
            self.skipping += 1
        elif tag in ("p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "pre", "section"):
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self.SKIPPED and self.skipping:
            self.skipping -= 1

    def handle_data(self, data):
        if not self.skipping:
            self.parts.append(data)


def html_text(source: str) -> str:
    parser = _Text()
    parser.feed(source)
    lines = (line.rstrip() for line in "".join(parser.parts).splitlines())
    text, blank = [], False
    for line in lines:
        if line.strip() or not blank:
            text.append(line)
        blank = not line.strip()
    return "\n".join(text).strip()


def document(path: Path) -> str | None:
    name = path.name.lower()
    raw = path.read_bytes()
    if name.endswith(".gz"):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError):
            return None
        name = name[:-3]
    if b"\0" in raw[:8192]:
        return None
    text = raw.decode("utf-8", errors="replace")
    if name.endswith(HTML_SUFFIXES):
        return html_text(text)
    if name.endswith(TEXT_SUFFIXES) or "." not in name or name.startswith(("readme", "changelog", "news")):
        return text
    return None


def download_and_unpack() -> dict[str, str]:
    debs = CORPUS / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    missing = [p for p in PACKAGES if not list(debs.glob(f"{p}_*.deb"))]
    if missing:
        subprocess.run(["apt-get", "download", *missing], cwd=debs, check=True)
    versions = {}
    for package in PACKAGES:
        deb = next(debs.glob(f"{package}_*.deb"))
        versions[package] = deb.name
        target = CORPUS / "unpacked" / package
        if not target.is_dir():
            target.mkdir(parents=True)
            subprocess.run(["dpkg-deb", "-x", str(deb), str(target)], check=True)
    return versions


def main() -> int:
    versions = download_and_unpack()
    seen: set[str] = set()
    documents: list[str] = []
    for path in sorted(p for p in (CORPUS / "unpacked").rglob("*") if p.is_file() and not p.is_symlink()):
        text = document(path)
        if text is None or len(text) < MIN_CHARACTERS:
            continue
        digest = hashlib.sha1(text.encode("utf-8", errors="replace")).hexdigest()
        if digest not in seen:
            seen.add(digest)
            documents.append(text)
    write(documents)
    size = sum(len(text.encode("utf-8", errors="replace")) for text in documents)
    manifest = {"packages": versions, "documents": len(documents), "text_bytes": size, "files": FILES}
    (CORPUS / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"{len(documents):,} documents, {size / 1e6:,.1f} MB of text in {CORPUS}/parquet and {CORPUS}/jsonl.zst")
    return 0


def write(documents: list[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    for folder in ("parquet", "jsonl.zst"):
        (CORPUS / folder).mkdir(exist_ok=True)
    per_file = -(-len(documents) // FILES)
    for number in range(FILES):
        chunk = documents[number * per_file: (number + 1) * per_file]
        pq.write_table(pa.table({"text": chunk}), CORPUS / "parquet" / f"part-{number:02d}.parquet",
                       row_group_size=2048)
        lines = "".join(json.dumps({"text": text}) + "\n" for text in chunk).encode("utf-8", errors="replace")
        compressed = zstandard.ZstdCompressor(level=3).compress(lines)
        (CORPUS / "jsonl.zst" / f"part-{number:02d}.jsonl.zst").write_bytes(compressed)


if __name__ == "__main__":
    sys.exit(main())
