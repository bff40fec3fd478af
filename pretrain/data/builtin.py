"""A small built-in English corpus that needs no download.

It is made of documentation that ships with every CPython install: the Python
language reference topics used by ``help()`` (``pydoc_data``) and the
docstrings of a fixed list of standard-library modules and their public
classes and functions. About 1.3 MB; identical for a given Python version.
"""

import importlib
import inspect
import platform
import warnings
from pathlib import Path

from pydoc_data.topics import topics as REFERENCE_TOPICS

from pretrain.data.build import write_dataset
from pretrain.data.layout import INDEX_FILE
from pretrain.data.tokenizer import BYTE

# Pure-Python or always-built modules only, so the corpus does not depend on
# optional C extensions of a particular Python build.
STDLIB_MODULES = (
    "abc", "argparse", "array", "ast", "asyncio.events", "asyncio.queues", "asyncio.streams",
    "asyncio.tasks", "base64", "bdb", "bisect", "builtins", "calendar", "cmd", "code", "codecs",
    "codeop", "collections", "collections.abc", "concurrent.futures", "configparser",
    "contextlib", "contextvars", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "dis", "doctest", "email.headerregistry", "email.message", "email.utils", "enum", "filecmp",
    "fileinput", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob",
    "graphlib", "gzip", "hashlib", "heapq", "hmac", "html.parser", "http.client", "http.cookies",
    "http.server", "imaplib", "inspect", "io", "ipaddress", "itertools", "json", "locale",
    "logging", "mailbox", "math", "mimetypes", "multiprocessing.pool", "numbers", "operator",
    "optparse", "os", "pathlib", "pdb", "pickle", "pickletools", "plistlib", "pprint", "queue",
    "quopri", "random", "re", "reprlib", "runpy", "sched", "secrets", "selectors", "shelve",
    "shlex", "shutil", "smtplib", "socket", "statistics", "string", "struct", "subprocess", "sys",
    "tarfile", "tempfile", "textwrap", "threading", "time", "timeit", "tokenize", "trace",
    "traceback", "types", "typing", "unittest.case", "unittest.mock", "urllib.parse",
    "urllib.request", "uuid", "warnings", "weakref", "wsgiref.handlers", "xml.dom.minidom",
    "xml.etree.ElementTree", "xml.sax.handler", "zipfile", "zoneinfo",
)  # fmt: skip
BUILTIN_SOURCE = f"builtin:python-{platform.python_version()}-docs"
BUILTIN_VAL_FRACTION = 0.02


def builtin_documents() -> list[str]:
    """Reference topics, then one document per module, in a fixed order."""
    seen: set[str] = set()  # re-exported objects would otherwise repeat their docstrings
    documents = [REFERENCE_TOPICS[key] for key in sorted(REFERENCE_TOPICS)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # e.g. typing.io on access
        documents += [_module_document(name, seen) for name in STDLIB_MODULES]
    return [document for document in documents if document]


def builtin_corpus_text() -> str:
    return "\n\n".join(builtin_documents())


def ensure_builtin_dataset(out: Path) -> Path:
    """Prepare the built-in corpus (byte tokenizer) into ``out`` unless already there.

    Call it from one process (e.g. rank 0, then barrier): concurrent writers
    would replace each other's files.
    """
    out = Path(out)
    if not (out / INDEX_FILE).exists():  # a run directory's corpus of format 1 is prepared again, the same tokens
        write_dataset(builtin_documents(), out, BYTE, BUILTIN_VAL_FRACTION, BUILTIN_SOURCE)
    return out


def _module_document(module_name: str, seen: set[str]) -> str:
    module = importlib.import_module(module_name)
    sections = [_section(module_name, module, seen)]
    for name in dir(module):  # dir() is sorted
        member = getattr(module, name)
        if name.startswith("_") or not (inspect.isclass(member) or inspect.isroutine(member)):
            continue
        sections.append(_section(f"{module_name}.{name}", member, seen))
        if inspect.isclass(member):
            sections += [
                _section(f"{module_name}.{name}.{attribute}", value, seen)
                for attribute, value in sorted(vars(member).items())
                if not attribute.startswith("_") and _is_documented_attribute(value)
            ]
    return "\n\n".join(section for section in sections if section)


def _is_documented_attribute(value: object) -> bool:
    return inspect.isroutine(value) or isinstance(value, (property, classmethod, staticmethod))


def _section(title: str, obj: object, seen: set[str]) -> str:
    """``title`` and the cleaned docstring of ``obj``; empty if none or seen before."""
    doc = getattr(obj, "__doc__", None)
    if not isinstance(doc, str) or not doc.strip():
        return ""
    doc = inspect.cleandoc(doc)
    if doc in seen:
        return ""
    seen.add(doc)
    return f"{title}\n\n{doc}"
