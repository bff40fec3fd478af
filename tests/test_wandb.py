"""W&B from rank 0 with the real wandb library, offline: one run per training run, resumed into the same
W&B run, sweeps grouped, online falling back to offline, uploading with pretrain.sync, and no secret leaked.

W&B's offline files are read back with wandb's own Record protos (tests/wandb_records.py).
"""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pretrain import redaction, rundir
from pretrain.tracking import sync, wandb_access
from pretrain.hosts import free_port
from pretrain.tracking.wandb_offline import fragments, is_closed, is_synced, mark_synced, run_id
from tests.helpers import REPO, launch, losses, metrics
from tests.wandb_records import wandb_config, wandb_history, wandb_run_record

SHORT = ("train.steps=6", "train.log_every=2", "train.eval_every=0", "train.seq_len=64", "train.global_batch=8",
         "train.micro_batch=4")
OFFLINE = "logging.wandb.mode=offline"
# Shaped like a real W&B key (40+ letters and digits), so that wandb takes it for one.
MARKER = "pretrainsecretmarker0123456789abcdefghijklmn"
SLURM_JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_RESTART_COUNT": "0"}


def only_fragment(run_dir: Path) -> Path:
    found = fragments(run_dir)
    assert len(found) == 1, found
    return found[0]


def saved_state(run_dir: Path) -> dict:
    return json.loads((run_dir / "wandb_run.json").read_text())


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


class RecordingServer:
    """A local HTTP server that answers every request with 401 and keeps the request bodies."""

    def __init__(self) -> None:
        bodies = self.bodies = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                bodies.append(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                self.send_response(401)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"errors": [{"message": "not a real W&B server"}]}')

            do_GET = do_HEAD = do_PUT = do_POST

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recording_server():
    server = RecordingServer()
    yield server
    server.close()


# ---- training runs ------------------------------------------------------------------------------

def test_two_process_run_makes_one_wandb_run_with_its_steps_and_config(tmp_path):
    run_dir = tmp_path / "run"
    result = launch("local.nproc=2", OFFLINE, *SHORT, "train.eval_every=6", "train.eval_batches=1",
                    f"hydra.run.dir={run_dir}", env=SLURM_JOB)
    assert result.returncode == 0, result.stderr + result.stdout
    fragment = only_fragment(run_dir)  # rank 1 made none
    assert run_id(fragment) == saved_state(run_dir)["id"]
    assert is_closed(fragment)

    history = wandb_history(fragment)
    assert [row["_step"] for row in history] == [2, 4, 6]
    logged = {r["step"]: r for r in metrics(run_dir) if "loss" in r}
    for row in history:
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mem_gb", "skipped_steps", "restarts"):
            assert row[key] == logged[row["_step"]][key], key
    assert history[-1]["eval_loss"] == next(r["eval_loss"] for r in metrics(run_dir) if "eval_loss" in r)

    config = wandb_config(fragment)
    resolved = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
    assert {key: config[key] for key in resolved} == resolved
    assert config["job"] == {"restarts": 0, "slurm_job_id": "4242", "slurm_nodelist": "node[01-02]",
                             "slurm_restart_count": "0"}
    assert wandb_run_record(fragment).display_name == "run"  # the run directory's name


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory) -> Path:
    """A run whose first attempt logged step 4 to W&B and died before checkpointing it, then was resumed."""
    run_dir = tmp_path_factory.mktemp("resumed") / "run"
    run = (OFFLINE, *SHORT, "train.ckpt_every=2", f"hydra.run.dir={run_dir}")
    first = launch(*run, "train.stop_at_step=4")
    assert first.returncode == 0, first.stderr + first.stdout
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")  # as if killed between the log and the checkpoint
    second = launch(*run)
    assert second.returncode == 0, second.stderr + second.stdout
    assert "resumed from" in second.stdout and "step_00000002" in second.stdout
    return run_dir


def test_resumed_run_continues_the_same_wandb_run_without_repeated_or_missing_steps(resumed_run):
    attempts = fragments(resumed_run)
    assert len(attempts) == 2
    assert {run_id(f) for f in attempts} == {saved_state(resumed_run)["id"]}
    steps = [row["_step"] for fragment in attempts for row in wandb_history(fragment)]
    assert steps == [2, 4, 6]  # step 4, recomputed after the resume, is not sent twice
    assert sorted(losses(resumed_run)) == [2, 4, 6]
    assert wandb_config(attempts[0])["job"]["restarts"] == 0
    assert wandb_config(attempts[1])["job"]["restarts"] == 1
    assert saved_state(resumed_run)["last_step"] == 6


def test_sweep_points_share_a_group_named_after_the_sweep(tmp_path):
    sweep = tmp_path / "lr-sweep"
    result = launch("-m", "optim.lr=1e-3,3e-3", OFFLINE, *SHORT, f"hydra.sweep.dir={sweep}")
    assert result.returncode == 0, result.stderr + result.stdout
    records = [wandb_run_record(only_fragment(run_dir)) for run_dir in rundir.run_dirs(sweep)]
    assert [r.run_group for r in records] == ["lr-sweep", "lr-sweep"]
    assert [r.display_name for r in records] == ["optim.lr=0.001", "optim.lr=0.003"]
    assert len({r.run_id for r in records}) == 2


def test_disabled_wandb_is_never_imported(tmp_path):
    run_dir = tmp_path / "run"
    code = ("import sys; from pretrain import launch; "
            f"code = launch.main({list(SHORT) + [f'hydra.run.dir={run_dir}']!r}); "
            "print('wandb imported:', 'wandb' in sys.modules); sys.exit(code)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr + result.stdout
    assert "wandb imported: False" in result.stdout
    assert not (run_dir / "wandb").exists() and not (run_dir / "wandb_run.json").exists()


# ---- online, offline ----------------------------------------------------------------------------

def test_online_needs_a_key_and_a_server_that_answers(tmp_path, recording_server):
    home = {"HOME": str(tmp_path)}
    mode, why = wandb_access.choose_mode("online", home)
    assert mode == "offline" and "no API key" in why
    (tmp_path / ".netrc").write_text(f"machine 127.0.0.1 login user password {MARKER}\n")
    (tmp_path / ".netrc").chmod(0o600)
    mode, why = wandb_access.choose_mode("online", {**home, "WANDB_BASE_URL": closed_port_url()})
    assert mode == "offline" and "not reachable" in why
    assert wandb_access.choose_mode("online", {**home, "WANDB_BASE_URL": recording_server.url}) == ("online", None)
    assert wandb_access.choose_mode("offline", {}) == ("offline", None)


@pytest.mark.parametrize("server", ["unreachable", "refusing"])
def test_an_online_run_that_cannot_reach_wandb_logs_offline_and_writes_the_key_nowhere(tmp_path, server,
                                                                                        recording_server):
    run_dir = tmp_path / "run"
    url = closed_port_url() if server == "unreachable" else recording_server.url
    result = launch("logging.wandb.mode=online", *SHORT, f"hydra.run.dir={run_dir}",
                    env={"WANDB_API_KEY": MARKER, "WANDB_BASE_URL": url})
    assert result.returncode == 0, result.stderr + result.stdout
    notices = [line for line in result.stdout.splitlines() if "W&B:" in line and "logging offline" in line]
    reason = "is not reachable" if server == "unreachable" else "could not start the online run"
    assert len(notices) == 1 and reason in notices[0], result.stdout
    assert [row["_step"] for row in wandb_history(only_fragment(run_dir))] == [2, 4, 6]
    assert_marker_nowhere(tmp_path, result)


def assert_marker_nowhere(root: Path, result: subprocess.CompletedProcess) -> None:
    assert MARKER not in result.stdout + result.stderr
    written = [path for path in root.rglob("*") if path.is_file() and not path.is_symlink()]
    leaks = [path for path in written if MARKER.encode() in path.read_bytes()]
    assert not leaks, leaks


def test_a_secret_in_the_config_is_refused_before_anything_is_written(tmp_path):
    run_dir = tmp_path / "run"
    result = launch("+cluster=a100x8", f"+cluster.env.WANDB_API_KEY={MARKER}",
                    f"hydra.run.dir={run_dir}")
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: cluster.env.WANDB_API_KEY holds a secret; keep keys and tokens out of "
                                     "the config, in your environment (e.g. export WANDB_API_KEY=...), where jobs "
                                     "get them from")
    assert not run_dir.exists()


def test_scrub_blanks_secret_names_assignments_and_environment_values():
    environ = {"WANDB_API_KEY": MARKER, "HF_TOKEN": "short", "PATH": "/usr/bin"}
    data = {"cluster": {"env": {"GITHUB_TOKEN": "ghp_x", "NCCL_DEBUG": "INFO"},
                        "setup": ["export AWS_SECRET_ACCESS_KEY=abc123 && make", f"echo {MARKER}"]},
            "train": {"global_batch_tokens": 4096}, "data": {"path": "/usr/bin"}}
    assert redaction.scrub(data, environ) == {
        "cluster": {"env": {"GITHUB_TOKEN": "<redacted>", "NCCL_DEBUG": "INFO"},
                    "setup": ["export AWS_SECRET_ACCESS_KEY=<redacted> && make", "echo <redacted>"]},
        "train": {"global_batch_tokens": 4096}, "data": {"path": "/usr/bin"}}
    assert redaction.find_in_config(data) == ["cluster.env.GITHUB_TOKEN", "cluster.setup[0]"]
    assert redaction.find_in_config({"setup": ["export HF_TOKEN=$HF_TOKEN"]}) == []


def test_a_slurm_dry_run_puts_the_key_in_no_script(tmp_path):
    result = launch("+cluster=a100x8", "dry_run=true", "logging.wandb.mode=online",
                    f"hydra.run.dir={tmp_path / 'run'}", env={"WANDB_API_KEY": MARKER})
    assert result.returncode == 0, result.stderr + result.stdout
    assert "#SBATCH" in result.stdout  # the job script it would submit
    assert_marker_nowhere(tmp_path, result)


# ---- pretrain.sync ------------------------------------------------------------------------------

def sync_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "pretrain.sync", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_sync_dry_run_names_each_attempt_in_order(resumed_run):
    result = sync_cli(str(resumed_run), "--dry-run")
    assert result.returncode == 0, result.stderr
    first, second = fragments(resumed_run)
    assert f"-m wandb sync {first} {second}" in result.stdout


def test_sync_sends_the_runs_to_the_configured_server(resumed_run, tmp_path, recording_server):
    run_dir = shutil.copytree(resumed_run, tmp_path / "run", symlinks=True)
    result = sync_cli(str(run_dir), env={"WANDB_API_KEY": MARKER, "WANDB_BASE_URL": recording_server.url})
    # wandb sync asked this server about the run; the server refused, so nothing counts as uploaded.
    graphql = [json.loads(body) for body in recording_server.bodies if body.startswith(b'{"query"')]
    assert any(request.get("variables", {}).get("name") == saved_state(run_dir)["id"] for request in graphql), graphql
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: 2 of 2 W&B run files were not uploaded")
    assert not any(is_synced(f) for f in fragments(run_dir))


def test_sync_fails_in_one_line_when_the_server_is_unreachable(resumed_run):
    result = sync_cli(str(resumed_run), env={"WANDB_API_KEY": MARKER, "WANDB_BASE_URL": closed_port_url()})
    assert result.returncode == 1
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith("error: cannot reach the W&B server http://127.0.0.1:")


def test_sync_plan_keeps_attempt_order_and_follows_only_a_running_attempt(resumed_run, tmp_path):
    run_dir = shutil.copytree(resumed_run, tmp_path / "run", symlinks=True)
    first, second = fragments(run_dir)
    state_file = run_dir / "wandb_run.json"  # its attempt has not ended: it is still writing
    state = json.loads(state_file.read_text())
    state["ended"].remove(second.parent.name)
    state_file.write_text(json.dumps(state))
    assert not is_closed(second) and is_closed(first)
    todo = sync.plan([run_dir], set())
    assert (todo.upload, todo.follow) == ([first], [])  # the running attempt waits for the earlier one
    mark_synced(first)
    todo = sync.plan([run_dir], set())
    assert (todo.upload, todo.follow) == ([], [second])
    assert sync.plan([run_dir], {second}).pending == []
    # A newer attempt began: the one before was killed and will never be closed, so it is uploaded as it is.
    third = run_dir / "wandb" / f"offline-run-29990101_000000-{run_id(second)}" / second.name
    shutil.copytree(second.parent, third.parent)
    todo = sync.plan([run_dir], set())
    assert (todo.upload, todo.follow) == ([second], [])
    mark_synced(second)
    assert sync.plan([run_dir], set()).follow == [third]


def test_watch_returns_once_every_run_is_finished_and_uploaded(resumed_run, tmp_path, monkeypatch):
    run_dir = shutil.copytree(resumed_run, tmp_path / "run", symlinks=True)
    marks = "import sys, pathlib; [pathlib.Path(p + '.synced').touch() for p in sys.argv[1:]]"
    monkeypatch.setattr(sync, "upload_command", lambda paths: [sys.executable, "-c", marks, *map(str, paths)])
    assert sync.watch(run_dir, period_s=0.1) == 0
    assert all(is_synced(f) for f in fragments(run_dir))


def test_sync_of_runs_without_wandb_data_needs_no_server(tmp_path):
    (tmp_path / "config.yaml").write_text("train:\n  steps: 6\n")  # a run directory, W&B disabled
    rundir.mark(tmp_path)
    result = sync_cli(str(tmp_path), env={"WANDB_BASE_URL": closed_port_url()})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("nothing to upload: no offline W&B data here")
