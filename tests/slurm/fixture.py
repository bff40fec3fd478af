"""pytest fixture ``slurm_cluster``: a real two-node Slurm cluster on localhost.

The cluster is started once per test session by ``tests/slurm/localcluster.sh``
in a fresh temporary directory and stopped at the end of the session. While it
runs, ``SLURM_CONF`` in ``os.environ`` points at its ``slurm.conf``, so the
Slurm commands (and code under test that calls them, e.g. submitit) talk to it.

Use it either through the plugin entry in ``tests/conftest.py``::

    pytest_plugins = ["tests.slurm.fixture"]

(which also registers the ``slurm`` marker), or by importing it explicitly in a
test module::

    from tests.slurm.fixture import slurm_cluster  # noqa: F401

Both may be combined: the cluster is shared, never started twice.

If the Slurm packages are missing and cannot be installed (not root, no
apt-get, no network), tests using the fixture are skipped -- unless the
environment variable ``CI`` is set (to anything but ``""``, ``0``, ``false``,
``no``), in which case they fail: CI must never silently skip Slurm tests. A
cluster that is installed but fails to start is always an error.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

SCRIPT = Path(__file__).resolve().with_name("localcluster.sh")

#: Job states after which a job will not run again (REQUEUED is not one).
FINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "TIMEOUT",
    }
)

#: Fields asked from sacct; each row of ``SlurmCluster.sacct`` has these keys
#: plus "Restarts".
SACCT_FIELDS = (
    "JobID",
    "JobName",
    "State",
    "ExitCode",
    "NodeList",
    "NNodes",
    "AllocTRES",
    "Start",
    "End",
)

_PROGRAMS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd", "sbatch", "srun", "sacct")


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``slurm`` marker (when loaded through ``pytest_plugins``)."""
    config.addinivalue_line("markers", "slurm: needs the real local Slurm cluster (fixture slurm_cluster)")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _unavailable(reason: str) -> None:
    """Skip, or fail when running in CI."""
    if in_ci():
        pytest.fail(f"Slurm test cluster unavailable: {reason} (CI is set, so this is an error, not a skip)", pytrace=False)
    pytest.skip(f"Slurm test cluster unavailable: {reason}")


def _missing_programs() -> list[str]:
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    return [p for p in _PROGRAMS if shutil.which(p, path=path) is None]


@dataclass
class SlurmCluster:
    """A running local cluster. ``env`` is ``os.environ`` plus ``SLURM_CONF``."""

    dir: Path
    conf: Path
    env: dict[str, str]
    script: Path = SCRIPT
    #: Extra environment for localcluster.sh (its port settings).
    script_env: dict[str, str] = field(default_factory=dict)

    @property
    def log_dir(self) -> Path:
        return self.dir / "log"

    # -- running commands -------------------------------------------------

    def run(self, *args: str, check: bool = True, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess[str]:
        """Run a command (e.g. ``"scontrol", "requeue", job_id``) against this cluster."""
        proc = subprocess.run(
            list(args), env=kwargs.pop("env", self.env), capture_output=True, text=True, timeout=timeout, **kwargs
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(args)} exited {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
            )
        return proc

    def sbatch(self, *args: str, cwd: str | os.PathLike[str] | None = None) -> str:
        """Submit with ``sbatch --parsable ARGS``; returns the job id."""
        out = self.run("sbatch", "--parsable", *args, cwd=cwd).stdout.strip()
        return out.split(";")[0]

    # -- looking at jobs ----------------------------------------------------

    def sacct(self, job_id: str | int) -> list[dict[str, str]]:
        """All accounting records of a job, including those of earlier runs.

        One dict per sacct line (``sacct --duplicates``: the allocation, then
        its steps, for each run), keys ``SACCT_FIELDS`` plus "Restarts".
        "State" is the first word only ("CANCELLED by 0" -> "CANCELLED").
        A requeued run's allocation record has State "REQUEUED".
        "Restarts" (sacct has no such field in Slurm 22.05) is the number of
        runs before the one the record belongs to: 0 for the first run, so on
        the last allocation record it is the job's restart count.
        """
        proc = self.run(
            "sacct",
            "-j",
            str(job_id),
            "--duplicates",
            "--parsable2",
            "--noheader",
            "--format=" + ",".join(SACCT_FIELDS),
        )
        rows: list[dict[str, str]] = []
        runs = -1
        for line in proc.stdout.splitlines():
            if not line.strip():
                continue
            values = line.split("|")
            row = dict(zip(SACCT_FIELDS, values))
            row["State"] = row.get("State", "").split(" ")[0]
            if "." not in row["JobID"]:  # allocation record: a new run starts
                runs += 1
            row["Restarts"] = str(max(runs, 0))
            rows.append(row)
        return rows

    def squeue_state(self, job_id: str | int) -> str | None:
        """The job's state in the queue (e.g. "PENDING", "RUNNING"), None once it has left it."""
        proc = self.run("squeue", "-h", "-j", str(job_id), "-o", "%T", check=False)
        if proc.returncode != 0:  # "Invalid job id" once the job has aged out
            return None
        return proc.stdout.strip() or None

    def scontrol_job(self, job_id: str | int) -> dict[str, str] | None:
        """slurmctld's record of the job (``scontrol show job -o``) as a dict, e.g.
        "JobState", "NodeList", "Restarts", "ExitCode"; None once slurmctld has
        forgotten it (MinJobAge=300 s after it ended). Values containing spaces
        (Command=, WorkDir=) are cut at the first space."""
        proc = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        if proc.returncode != 0 or not proc.stdout.strip():
            return None
        return dict(re.findall(r"(?:^|\s)([\w:/]+)=(\S*)", proc.stdout))

    def restarts(self, job_id: str | int) -> int:
        """How often the job was requeued (from scontrol, or from sacct once slurmctld forgot it)."""
        info = self.scontrol_job(job_id)
        if info is not None and info.get("Restarts", "").isdigit():
            return int(info["Restarts"])
        allocs = [r for r in self.sacct(job_id) if r["JobID"] == str(job_id)]
        return int(allocs[-1]["Restarts"]) if allocs else 0

    def wait_job(self, job_id: str | int, timeout: float = 120, poll: float = 0.5) -> str:
        """Wait until the job has finished for good; return its final state.

        Finished means slurmctld has it in a final state (a requeued job is
        waited for until its last run ends), e.g. "COMPLETED", "FAILED",
        "CANCELLED", "TIMEOUT", and sacct has caught up: the latest allocation
        record has the same state and node list. (Accounting is asynchronous:
        for a second or more after a job ends, its sacct record can still say
        PENDING/RUNNING or list only the batch node.) Raises TimeoutError with
        diagnostics after ``timeout`` seconds.
        """
        job_id = str(job_id)
        deadline = time.monotonic() + timeout
        settle_deadline = None
        while True:
            info = self.scontrol_job(job_id)
            allocs = [r for r in self.sacct(job_id) if r["JobID"] == job_id]
            last = allocs[-1] if allocs else None
            if info is None:  # slurmctld forgot it: sacct is all there is
                if last is not None and last["State"] in FINAL_STATES:
                    return last["State"]
            elif info.get("JobState") in FINAL_STATES:
                state = info["JobState"]
                if last is not None and last["State"] == state and _same_nodes(last["NodeList"], info.get("NodeList")):
                    return state
                # Do not wait forever for sacct to agree on details.
                settle_deadline = settle_deadline or time.monotonic() + 20
                if time.monotonic() > settle_deadline:
                    return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not finished after {timeout}s\n{self.describe_job(job_id)}")
            time.sleep(poll)

    def describe_job(self, job_id: str | int) -> str:
        """scontrol and sacct views of a job plus the slurmctld log tail, for error messages."""
        parts = []
        proc = self.run("scontrol", "show", "job", str(job_id), check=False)
        parts.append("scontrol show job:\n" + (proc.stdout or proc.stderr))
        proc = self.run("sacct", "-j", str(job_id), "--duplicates", "-P", "--format=" + ",".join(SACCT_FIELDS), check=False)
        parts.append("sacct:\n" + (proc.stdout or proc.stderr))
        parts.append("slurmctld log tail:\n" + self.log_tail("slurmctld"))
        return "\n".join(parts)

    def kill_node(self, name: str) -> None:
        """Node `name` dies at once: its slurmd, step daemons and job processes (localcluster.sh node-kill)."""
        proc = _run_script("node-kill", str(self.dir), name, extra_env=self.script_env, timeout=60)
        assert proc.returncode == 0, proc.stderr

    def start_node(self, name: str) -> None:
        """Node `name` comes back: its slurmd starts and slurmctld has it in service again."""
        proc = _run_script("node-start", str(self.dir), name, extra_env=self.script_env, timeout=120)
        assert proc.returncode == 0, proc.stderr

    def log_tail(self, daemon: str, lines: int = 30) -> str:
        """Last lines of DIR/log/DAEMON.log (munged, mariadbd, slurmdbd, slurmctld, slurmd-n1, slurmd-n2)."""
        path = self.log_dir / f"{daemon}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"({path}: {e})"


def _same_nodes(sacct_nodes: str, scontrol_nodes: str | None) -> bool:
    none = ("", "None assigned", "(null)")
    return sacct_nodes == scontrol_nodes or (sacct_nodes in none and (scontrol_nodes or "") in none)


# -- starting and stopping -------------------------------------------------

# One cluster per process, shared by every registration of the fixture (the
# plugin entry and explicit imports each create their own fixture definition).
_shared: dict[str, object] = {"cluster": None, "users": 0}


PORT_VARIABLES = ("LOCALCLUSTER_CTLD_PORT", "LOCALCLUSTER_DBD_PORT", "LOCALCLUSTER_SLURMD_PORT")


def _script_env() -> dict[str, str]:
    """The ports given in the environment (several people testing on one machine pick their own), else
    own ports per pytest-xdist worker, so parallel workers do not collide."""
    given = {name: os.environ[name] for name in PORT_VARIABLES if name in os.environ}
    if given:
        return given
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    m = re.fullmatch(r"gw(\d+)", worker)
    if not m:
        return {}
    offset = 100 * (int(m.group(1)) + 1)
    return {
        "LOCALCLUSTER_CTLD_PORT": str(16817 + offset),
        "LOCALCLUSTER_DBD_PORT": str(16819 + offset),
        "LOCALCLUSTER_SLURMD_PORT": str(17001 + offset),
    }


def _run_script(*args: str, extra_env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env={**os.environ, **extra_env},
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def _ensure_installed() -> None:
    if os.name != "posix" or shutil.which("bash") is None:
        _unavailable("needs Linux with bash")
    missing = _missing_programs()
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        _unavailable(f"missing {' '.join(missing)}; install them with `sudo bash {SCRIPT} install`")
    try:
        proc = _run_script("install", extra_env={}, timeout=600)
    except subprocess.TimeoutExpired:
        _unavailable(f"missing {' '.join(missing)}; `{SCRIPT} install` timed out")
    missing = _missing_programs()
    if proc.returncode != 0 or missing:
        outcome = f"failed (exit {proc.returncode})" if proc.returncode else "did not provide them"
        _unavailable(f"missing {' '.join(missing)}; `{SCRIPT} install` {outcome}:\n{proc.stderr[-3000:]}")


def _cluster_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("slurm")
    if len(str(d)) > 60:  # unix socket paths under it must stay short
        d = Path(tempfile.mkdtemp(prefix="pretrain-slurm-", dir="/tmp"))
    return d


def _start(tmp_path_factory: pytest.TempPathFactory) -> SlurmCluster:
    _ensure_installed()
    if os.geteuid() != 0:
        _unavailable("localcluster.sh must run as root (SlurmUser=root, mknod, /etc/hosts)")
    d = _cluster_dir(tmp_path_factory)
    extra = _script_env()
    try:
        proc = _run_script("start", str(d), extra_env=extra, timeout=300)
    except subprocess.TimeoutExpired as e:
        _run_script("stop", str(d), extra_env=extra, timeout=120)
        pytest.fail(f"localcluster.sh start {d} timed out:\n{e.stderr}", pytrace=False)
    m = re.search(r"^export SLURM_CONF=(.+)$", proc.stdout, re.M)
    if proc.returncode != 0 or not m:
        pytest.fail(
            f"localcluster.sh start {d} failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}", pytrace=False
        )
    conf = Path(m.group(1).strip())
    env = {**os.environ, "SLURM_CONF": str(conf)}
    return SlurmCluster(dir=d, conf=conf, env=env, script_env=extra)


def _stop(cluster: SlurmCluster) -> None:
    proc = _run_script("stop", str(cluster.dir), extra_env=cluster.script_env, timeout=180)
    if proc.returncode != 0:
        raise RuntimeError(f"localcluster.sh stop {cluster.dir} failed:\n{proc.stderr}")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """The local Slurm cluster (session-wide); see SlurmCluster for its interface."""
    if _shared["cluster"] is None:
        _shared["cluster"] = _start(tmp_path_factory)
    cluster: SlurmCluster = _shared["cluster"]  # type: ignore[assignment]
    _shared["users"] = int(_shared["users"]) + 1  # type: ignore[call-overload]
    mp = pytest.MonkeyPatch()
    mp.setenv("SLURM_CONF", str(cluster.conf))
    try:
        yield cluster
    finally:
        mp.undo()
        _shared["users"] = int(_shared["users"]) - 1  # type: ignore[call-overload]
        if _shared["users"] == 0:
            _shared["cluster"] = None
            _stop(cluster)
