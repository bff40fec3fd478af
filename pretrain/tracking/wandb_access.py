"""Whether W&B can work online from here: an API key, and a server that answers.

The compute nodes of many clusters have no internet. `choose_mode` turns a requested `online`
into `offline`, with a one-line reason, when no key is configured or the server does not answer
an HTTP request within a few seconds, so that a job never hangs or fails because of W&B.
Nothing here imports wandb.
"""

from __future__ import annotations

import netrc
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

DEFAULT_BASE_URL = "https://api.wandb.ai"
PROBE_TIMEOUT_S = 3.0


def base_url(environ: Mapping[str, str] | None = None) -> str:
    environ = os.environ if environ is None else environ
    return environ.get("WANDB_BASE_URL") or DEFAULT_BASE_URL


def has_api_key(url: str, environ: Mapping[str, str] | None = None) -> bool:
    """A key in WANDB_API_KEY (or an identity token file), or in ~/.netrc for the server's host."""
    environ = os.environ if environ is None else environ
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    path = Path(environ.get("NETRC") or Path(environ.get("HOME") or Path.home()) / ".netrc")
    try:
        return netrc.netrc(path).authenticators(urlsplit(url).hostname or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def unreachable_reason(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None if the server answers an HTTP request within `timeout_s` (any status will do), else why not.

    urllib follows the HTTP(S)_PROXY settings as wandb does. The request runs in a thread so
    that a slow name lookup, which socket timeouts do not cover, cannot hold the caller longer.
    """
    outcome: dict[str, str] = {}

    def request() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout_s).close()
            outcome["ok"] = ""
        except urllib.error.HTTPError:
            outcome["ok"] = ""  # an answer, even an error status, means the server is there
        except (OSError, ValueError) as err:
            outcome["error"] = str(getattr(err, "reason", None) or err) or type(err).__name__

    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if "ok" in outcome:
        return None
    return outcome.get("error", f"no answer in {timeout_s:g} s")


def choose_mode(requested: str, environ: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """The mode to run W&B in, and why, when `online` had to become `offline`."""
    if requested != "online":
        return requested, None
    url = base_url(environ)
    if not has_api_key(url, environ):
        return "offline", f"no API key (WANDB_API_KEY, or ~/.netrc for {urlsplit(url).hostname})"
    reason = unreachable_reason(url)
    if reason is not None:
        return "offline", f"the server {url} is not reachable: {reason}"
    return "online", None
