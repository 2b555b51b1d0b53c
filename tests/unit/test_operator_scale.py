"""benchmarks/operator_scale.py's ceiling round: the TrainingJob creates run in a second process (the script's
--create-jobs mode). The round's time must cover them (the ceiling is all the work a zero-cost operator leaves to
the control plane, pods and jobs), and a failure in the benchmark's own process must not leave that process
creating jobs. The child here is a stand-in that speaks the same protocol (ready, go, done); no cluster."""

from __future__ import annotations

import importlib.util
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("kubernetes")
psutil = pytest.importorskip("psutil")

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import sys, time, pathlib
pathlib.Path({pid_file!r}).write_text(str(__import__("os").getpid()))
print("ready", flush=True)
assert sys.stdin.readline().strip() == "go"
time.sleep({seconds})
print("done", flush=True)
"""


@pytest.fixture
def bench(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("operator_scale_under_test", ROOT / "benchmarks" / "operator_scale.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script prepends operator/ and testbed/
    spec.loader.exec_module(module)

    def child(seconds: float) -> Path:
        script, pid_file = tmp_path / "child.py", tmp_path / "child.pid"
        script.write_text(CHILD.format(pid_file=str(pid_file), seconds=seconds))
        monkeypatch.setattr(module, "__file__", str(script))
        return pid_file

    module.child = child
    return module


class FakeCore:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def create_namespaced_pod(self, namespace, pod, **kwargs):
        if self.fail:
            raise RuntimeError("the API server said no")

    def delete_collection_namespaced_pod(self, *args, **kwargs):
        pass

    def list_namespaced_pod(self, *args, **kwargs):
        return SimpleNamespace(items=[])


CUSTOM = SimpleNamespace(delete_collection_namespaced_custom_object=lambda *a, **k: None)
PODS = SimpleNamespace(wait=lambda names, timeout: True, running=defaultdict(float))


def test_the_ceiling_rounds_time_covers_the_job_creates(bench):
    bench.child(seconds=1.0)
    result = bench.run_baseline(FakeCore(), CUSTOM, "ns", 2, 1, "pool", 2, PODS, "ceil0", False, with_jobs=True)
    assert result["created_s"] >= 1.0, result


def test_a_failure_in_the_benchmark_stops_the_job_creator(bench):
    pid_file = bench.child(seconds=60)
    with pytest.raises(RuntimeError, match="said no"):
        bench.run_baseline(FakeCore(fail=True), CUSTOM, "ns", 2, 1, "pool", 2, PODS, "ceil0", False, with_jobs=True)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = psutil.pid_exists(pid)
    if left:
        psutil.Process(pid).kill()
    assert not left, "the TrainingJob creator was left running"
