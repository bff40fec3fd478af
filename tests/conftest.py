import os
import sys
import time

import pytest

from pretrain.launcher.local import threads_per_rank

# Keep every test off the network and away from a user's W&B account.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers reads the folders the tests write, never the hub
# Commands the tests run by name (`python`, and `python3` inside the stand-in container) are those of the
# environment running the tests, as in a user's activated environment, also when CI calls .venv/bin/python.
os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])
# pytest-xdist's workers run their tests' training processes side by side. Each with a thread per CPU, they
# spin against each other: two one-rank runs on the 2-core CI machine went at a quarter of one's speed each
# (1,470 tok/s against 5,500 alone; with a thread each, 2,950). So the workers share the CPUs out, as the
# launcher does between the ranks of one run.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(_workers)))


@pytest.fixture(autouse=True)
def _no_jobs_left_behind(request):
    """After a test that used the Slurm cluster, cancel whatever it left in the queue, so a failed test's
    jobs cannot hold the nodes that the next test needs. Before it, refuse to run where pytest-xdist did
    not group it: two workers would start two clusters, whose jobs then fail under each other's load."""
    if "slurm_cluster" not in request.fixturenames:
        yield
        return
    # pytest-xdist sets option.loadgroup in its workers for --dist loadgroup (their own --dist is "no").
    if getattr(request.config.option, "loadgroup", False) and not request.node.nodeid.endswith("@slurm"):
        pytest.fail("this Slurm test was not put in the 'slurm' group of pytest-xdist (its node id has no @slurm), "
                    "so another worker may start a second cluster: check the pytest and pytest-xdist versions "
                    "against pyproject.toml's pin", pytrace=False)
    yield
    cluster = request.getfixturevalue("slurm_cluster")
    cluster.run("scancel", "--user", "root", check=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and cluster.run("squeue", "-h", check=False).stdout.strip():
        time.sleep(0.5)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Run in parallel (pytest -n 2 --dist loadgroup), every test of the Slurm cluster goes to one
    worker: the cluster is started once per worker, on fixed ports. The other worker takes the rest.
    First among the plugins: pytest-xdist's own hook turns the marks into groups, so they must be there
    before it runs (after it, some of these tests went to the other worker)."""
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("slurm"))
