"""Redaction: secrets (API keys, tokens, passwords) stay in the environment, never in a config or a log.

A secret reaches a job only through the environment it inherits. The config schema has no field
for one; `find_in_config` catches one slipped into the free-form parts (`cluster.env`, setup
lines), and `scrub` blanks secret-looking entries and the values of secret-named environment
variables in anything sent to W&B.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Mapping
from typing import Any

NAME_PATTERNS = ("*KEY*", "*TOKEN*", "*SECRET*", "*PASSWORD*")
REDACTED = "<redacted>"
# Shorter values are too common to blank wherever they appear (e.g. "1", "true").
MIN_SECRET_LENGTH = 8
# NAME=value in a shell line, e.g. `export WANDB_API_KEY=...`.
ASSIGNMENT = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)=(\"[^\"]*\"|'[^']*'|\S+)")


def is_secret_name(name: str) -> bool:
    """An environment-variable-like name (upper case, digits, underscores) that names a secret.

    Lower-case config keys such as `train.global_batch_tokens` are not environment names.
    """
    if not re.fullmatch(r"[A-Z_][A-Z0-9_]*", name):
        return False
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in NAME_PATTERNS)


def environment_secrets(environ: Mapping[str, str] | None = None) -> list[str]:
    """The values of this process's secret-named environment variables, longest first."""
    environ = os.environ if environ is None else environ
    values = {value for name, value in environ.items() if is_secret_name(name) and len(value) >= MIN_SECRET_LENGTH}
    return sorted(values, key=len, reverse=True)


def scrub(data: Any, environ: Mapping[str, str] | None = None) -> Any:
    """A copy of nested dicts/lists/strings with every secret replaced by REDACTED."""
    return _scrub(data, environment_secrets(environ))


def _scrub(data: Any, values: list[str]) -> Any:
    if isinstance(data, Mapping):
        return {key: REDACTED if is_secret_name(str(key)) else _scrub(value, values) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [_scrub(item, values) for item in data]
    if isinstance(data, str):
        return _scrub_text(data, values)
    return data


def _scrub_text(text: str, values: list[str]) -> str:
    for value in values:
        text = text.replace(value, REDACTED)
    return ASSIGNMENT.sub(lambda m: f"{m.group(1)}={REDACTED}" if is_secret_name(m.group(1)) else m.group(0), text)


def find_in_config(data: Any, path: str = "") -> list[str]:
    """Dotted paths of the settings that hold a secret: a secret-named key or a secret assignment."""
    found: list[str] = []
    if isinstance(data, Mapping):
        for key, value in data.items():
            where = f"{path}.{key}" if path else str(key)
            found += [where] if is_secret_name(str(key)) else find_in_config(value, where)
    elif isinstance(data, (list, tuple)):
        for index, item in enumerate(data):
            found += find_in_config(item, f"{path}[{index}]")
    elif isinstance(data, str) and any(_assigns_secret(m) for m in ASSIGNMENT.finditer(data)):
        found.append(path)
    return found


def _assigns_secret(assignment: re.Match) -> bool:
    """NAME=value with a secret NAME and a literal value (`$VAR` or `$(cmd)` only refers to one)."""
    return is_secret_name(assignment.group(1)) and not assignment.group(2).lstrip("\"'").startswith("$")
