"""Where torch.compile's time went in one process: the timed regions of torch's structured trace.

    TORCH_TRACE=/tmp/trace python -m pretrain.launch ...     # or bench/requeue_ab.py --trace /tmp/trace
    python bench/compile_trace.py /tmp/trace

With TORCH_TRACE set, Dynamo, AOT autograd and Inductor write the regions they time (`dynamo_timed`: the
bytecode tracing, the cache lookups and loads, the hash of torch's sources, waiting on kernel loads) as
chromium events into a log per process. This reads the log with the most events (the rank's; compile
workers write little) and tables each region that took at least --min-ms, nested, in order, with its
start from the first region's, and the total per region name. Unlike a sampling profiler it adds
almost nothing to what it measures, but it sees only what torch times: a gap between regions is
the job's own code, or torch's untimed parts.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

MIN_MS = 10.0


def chromium_events(log: Path) -> list[dict[str, Any]]:
    """The chromium events of one structured-trace log: each is a line naming `chromium_event`, then its
    payload as tab-indented lines."""
    lines = log.read_text(errors="replace").split("\n")
    events, index = [], 0
    while index < len(lines):
        index += 1
        if '"chromium_event"' not in lines[index - 1]:
            continue
        payload = []
        while index < len(lines) and lines[index].startswith("\t"):
            payload.append(lines[index][1:])
            index += 1
        try:
            events.append(json.loads("\n".join(payload)))
        except json.JSONDecodeError:  # a log cut short by the job's end
            pass
    return events


def regions(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Begin/end pairs as regions: name, start (s from the first event), duration (s), nesting depth."""
    if not events:
        return []
    origin = min(e["ts"] for e in events)
    open_regions: list[dict[str, Any]] = []
    done = []
    for event in events:
        if event.get("ph") == "B":
            region = {"name": event["name"], "start_s": (event["ts"] - origin) / 1e6, "depth": len(open_regions)}
            open_regions.append(region)
            done.append(region)
        elif event.get("ph") == "E":
            for position in range(len(open_regions) - 1, -1, -1):  # the innermost open region of that name
                if open_regions[position]["name"] == event["name"]:
                    region = open_regions.pop(position)
                    region["dur_s"] = (event["ts"] - origin) / 1e6 - region["start_s"]
                    break
    return [r for r in done if "dur_s" in r]


def summarize(folder: Path, min_ms: float = MIN_MS) -> dict[str, Any]:
    """The regions of the folder's busiest log (at least min_ms long) and every region name's total."""
    parsed = {log: chromium_events(log) for log in folder.glob("*.log")}
    if not parsed:
        return {"log": None, "regions": [], "totals_s": {}}
    busiest = max(parsed, key=lambda log: len(parsed[log]))
    found = regions(parsed[busiest])
    totals: dict[str, float] = defaultdict(float)
    for region in found:
        totals[region["name"]] += region["dur_s"]
    return {"log": busiest.name, "regions": [r for r in found if r["dur_s"] * 1e3 >= min_ms],
            "totals_s": dict(sorted(totals.items(), key=lambda item: -item[1]))}


def table(summary: dict[str, Any]) -> str:
    if not summary["log"]:
        return "no structured trace was written"
    rows = ["| start (s) | region | ms |", "|---|---|---|"]
    rows += [f"| {r['start_s']:.3f} | {'· ' * r['depth']}{r['name']} | {r['dur_s'] * 1e3:.0f} |"
             for r in summary["regions"]]
    totals = ["| region | total ms |", "|---|---|"]
    totals += [f"| {name} | {s * 1e3:.0f} |" for name, s in summary["totals_s"].items() if s * 1e3 >= MIN_MS]
    return f"log {summary['log']}\n\n" + "\n".join(rows) + "\n\n" + "\n".join(totals)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the TORCH_TRACE folder of one job")
    parser.add_argument("--min-ms", type=float, default=MIN_MS)
    args = parser.parse_args(argv)
    print(table(summarize(args.folder, args.min_ms)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
