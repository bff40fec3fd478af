"""`python -m pretrain.sync RUN_OR_SWEEP_DIR [--watch SECONDS] [--dry-run]`: upload offline W&B runs.

Run it where there is internet, e.g. on the login node, while or after the jobs run on nodes
without. It finds the offline W&B data of the run, or of every run of a sweep (RUN/wandb/
offline-run-*), and uploads it with wandb's own `wandb sync`, which continues the same W&B run
across the attempts of a requeued job.

    python -m pretrain.sync runs/sweeps/2024-05-01/12-00-00_tiny             # upload what has finished
    python -m pretrain.sync runs/sweeps/2024-05-01/12-00-00_tiny --watch 300 # follow the runs until they end
    python -m pretrain.sync RUN --dry-run                                    # show the wandb commands only

Without --watch, the attempts that have ended are uploaded and one still running is left for
later. With --watch, an attempt still running is followed live (`wandb beta sync --live`), new
attempts and runs are picked up every SECONDS, and it returns once every run has reached its
last step and everything is uploaded (or on Ctrl-C).
"""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pretrain import rundir
from pretrain.tracking import wandb_access, wandb_offline

# A live sync whose attempt died without closing its file waits for more forever; once a newer
# attempt exists it is stopped, given this long to finish what it was uploading.
STOP_GRACE_S = 30.0


@dataclass
class Plan:
    upload: list[Path] = field(default_factory=list)  # finished attempts' files: one `wandb sync`
    follow: list[Path] = field(default_factory=list)  # files still being written, after all earlier ones
    pending: list[Path] = field(default_factory=list)  # every file not uploaded yet, these included

    @property
    def running(self) -> list[Path]:
        return [path for path in self.pending if path not in self.upload]


def plan(run_dirs: list[Path], following: set[Path]) -> Plan:
    """What to upload now: each run's files in attempt order, a still-open one only after the earlier ones.

    A file is finished when its attempt closed it (W&B wrote its exit record) or a later attempt
    of the run has begun (the job was killed and requeued: nothing more will be written to it).
    """
    result = Plan()
    for run_dir in run_dirs:
        files = wandb_offline.fragments(run_dir)
        for index, path in enumerate(files):
            if wandb_offline.is_synced(path) or path in following:
                continue
            result.pending.append(path)
            if index < len(files) - 1 or wandb_offline.is_closed(path):
                result.upload.append(path)
            elif not any(earlier in result.pending for earlier in files[:index]):
                result.follow.append(path)
    return result


def wandb_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "wandb", *args]


def upload_command(paths: list[Path]) -> list[str]:
    return wandb_command("sync", *map(str, paths))


def follow_command(path: Path) -> list[str]:
    return wandb_command("beta", "sync", "--live", str(path))


def server_problem() -> str | None:
    """Why W&B cannot be reached from here, in one line, or None."""
    url = wandb_access.base_url()
    if not wandb_access.has_api_key(url):
        return "no W&B API key here: run `wandb login` or export WANDB_API_KEY"
    reason = wandb_access.unreachable_reason(url)
    if reason is not None:
        return (f"cannot reach the W&B server {url} ({reason}); run pretrain.sync where there is internet, "
                "e.g. on the login node")
    return None


def _report_problem() -> int:
    """1, after printing why, when W&B cannot be reached from here; else 0."""
    problem = server_problem()
    if problem is None:
        return 0
    print(f"error: {problem}", file=sys.stderr)
    return 1


def upload(paths: list[Path]) -> int:
    """Run `wandb sync` on the files; 1 (with a message) unless wandb marked every one as uploaded."""
    subprocess.run(upload_command(paths), check=False)
    missing = [path for path in paths if not wandb_offline.is_synced(path)]
    if missing:
        print(f"error: {len(missing)} of {len(paths)} W&B run files were not uploaded (see wandb's messages above), "
              f"e.g. {missing[0]}; run pretrain.sync again to retry", file=sys.stderr)
        return 1
    return 0


def sync_once(run_dirs: list[Path]) -> int:
    todo = plan(run_dirs, set())
    for path in todo.running:
        print(f"{_run_of(path)}: the attempt writing {path.parent.name} is still running; it is uploaded once it "
              "ends (or follow it live with --watch)")
    if todo.upload:
        return _report_problem() or upload(todo.upload)
    if not any(wandb_offline.fragments(run_dir) for run_dir in run_dirs):
        print("nothing to upload: no offline W&B data here (runs write it with logging.wandb.mode=offline, "
              "or online without network)")
    elif not todo.pending:
        print("nothing to upload: every offline W&B run file here is uploaded")
    return 0


def watch(root: Path, period_s: float) -> int:
    following: dict[Path, subprocess.Popen] = {}
    try:
        while True:
            run_dirs = rundir.run_dirs(root)
            _forget_finished(following)
            _stop_superseded(following)
            todo = plan(run_dirs, set(following))
            if todo.upload:
                upload(todo.upload)  # on failure, the next round tries again
            for path in todo.follow:
                print(f"{_run_of(path)}: following {path.parent.name} live")
                following[path] = subprocess.Popen(follow_command(path))
            if not following and not todo.pending and all(rundir.is_finished(d) for d in run_dirs):
                print(f"every run under {root} has finished and is uploaded")
                return 0
            time.sleep(period_s)
    except KeyboardInterrupt:
        for process in following.values():
            _stop(process)
        return 130


def _forget_finished(following: dict[Path, subprocess.Popen]) -> None:
    for path, process in list(following.items()):
        if process.poll() is not None:
            del following[path]


def _stop_superseded(following: dict[Path, subprocess.Popen]) -> None:
    """Stop following a file whose attempt died without closing it (a newer attempt has begun).

    Everything the attempt wrote has been uploaded live; the file is marked as uploaded so that
    no later sync uploads it again, which would repeat its steps in the W&B run.
    """
    for path, process in list(following.items()):
        if wandb_offline.fragments(_run_of(path))[-1] != path:
            _stop(process)
            wandb_offline.mark_synced(path)
            del following[path]


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _run_of(fragment: Path) -> Path:
    return fragment.parent.parent.parent  # RUN/wandb/offline-run-*/run-ID.wandb


def dry_run(run_dirs: list[Path], watching: bool) -> int:
    todo = plan(run_dirs, set())
    if todo.upload:
        print(f"would upload {len(todo.upload)} finished W&B run file(s):\n  {shlex.join(upload_command(todo.upload))}")
    for path in todo.follow:
        if watching:
            print(f"would follow a running attempt live:\n  {shlex.join(follow_command(path))}")
        else:
            print(f"would leave {path} for later: its attempt is still running")
    if not todo.pending:
        print("nothing to upload")
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pretrain.sync", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="a run directory or a sweep directory")
    parser.add_argument("--watch", type=float, metavar="SECONDS",
                        help="keep uploading, looking for new data every SECONDS, until every run has finished")
    parser.add_argument("--dry-run", action="store_true", help="print the wandb commands instead of running them")
    args = parser.parse_args(argv)
    if args.watch is not None and args.watch <= 0:
        parser.error("--watch SECONDS must be greater than 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    run_dirs = rundir.run_dirs(args.path)
    if not run_dirs:
        print(rundir.not_found(args.path), file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run(run_dirs, watching=args.watch is not None)
    if args.watch is None:
        return sync_once(run_dirs)
    return _report_problem() or watch(args.path, args.watch)


if __name__ == "__main__":
    sys.exit(main())
