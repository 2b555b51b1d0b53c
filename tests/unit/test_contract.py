"""docs/contract.md checked from both sides at once: this test may import both packages.

The images share no imports, so each side keeps its own copy of the names and
codes (`kubetrain.api`, `kubetrain_trainer.contract`). Here the operator's
builders produce each example job's pods, the launcher parses their
environment and command as it would in the pod, and every documented exit
code goes through the operator's planner to the reading the document gives it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain import api, builders, values
from kubetrain.observe import Observed, PodView
from kubetrain.plan import plan
from kubetrain.records import parse_checkpoint_record
from kubetrain_trainer import builtin, contract, launch_config
from kubetrain_trainer.storage import StorageConfig

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = (ROOT / "docs" / "contract.md").read_text()
EXAMPLES = sorted((ROOT / "examples").glob("trainingjob*.yaml"))
CREATED = "2026-01-01T12:00:00Z"
NOT_THE_CONTRACT = {"HOME"}
"""Set by the operator for the image's sake (a read-only root file system), not read by the trainer."""


def _section(title: str) -> str:
    start = CONTRACT.index(f"## {title}")
    end = CONTRACT.find("\n## ", start + 1)
    return CONTRACT[start:end if end > 0 else None]


def _example(path: Path) -> api.Job:
    body = yaml.safe_load(path.read_text())
    body["metadata"].update(namespace="ml", uid="uid-1", generation=1, creationTimestamp=CREATED)
    job = api.Job.from_storage(body)
    assert job.spec is not None, f"{path.name}: {job.spec_error}"
    return job


def _pod_env(entries: list[dict[str, Any]], pod_name: str) -> dict[str, str]:
    """The environment the kubelet would give the container (secrets stand in as placeholders)."""
    env: dict[str, str] = {}
    for e in entries:
        if "value" in e:
            env[e["name"]] = e["value"]
            continue
        source = e["valueFrom"]
        if source.get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[e["name"]] = pod_name
        elif "secretKeyRef" in source:
            env[e["name"]] = f"<{source['secretKeyRef']['name']}/{source['secretKeyRef']['key']}>"
        else:
            raise AssertionError(f"{e['name']}: a source this test does not resolve: {source}")
    return env


def _documented_env() -> list[str]:
    names: list[str] = []
    for row in _section("Environment of every training container").splitlines():
        if row.startswith("| `"):
            names += re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split("|")[1])
    return names


def _mounted(env: dict[str, str], job: api.Job, mount_dir: Path) -> dict[str, str]:
    """`env` with the DeepSpeed ConfigMap the operator builds mounted at `mount_dir` instead of its mountPath."""
    path = env.get(contract.DEEPSPEED_CONFIG)
    if not path:
        return env
    assert Path(path).parent == Path(builders.DEEPSPEED_DIR)
    data = builders.get_deepspeed_configmap(job=job)["data"]
    for key, text in data.items():
        (mount_dir / key).write_text(text)
    return {**env, contract.DEEPSPEED_CONFIG: str(mount_dir / Path(path).name)}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_pod_parses_in_the_launcher_as_the_operator_meant(path: Path, tmp_path: Path) -> None:
    job = _example(path)
    spec = job.spec
    assert spec is not None
    for rank in range(spec.nodes):
        pod = builders.get_pod(job=job, attempt=3, rank=rank)
        container = pod["spec"]["containers"][0]
        env = _pod_env(container["env"], pod["metadata"]["name"])
        launcher = tuple(builders.LAUNCHER)
        assert tuple(container["command"][:len(launcher)]) == launcher
        cfg = launch_config.LaunchConfig.from_env(env, container["command"][len(launcher):])

        assert (cfg.nnodes, cfg.node_rank, cfg.nproc_per_node) == (spec.nodes, rank, spec.procs_per_node)
        assert (cfg.master_addr, cfg.master_port) == (builders.get_master_addr(job), spec.master_port)
        assert (cfg.attempt, cfg.incarnation) == (3, job.incarnation) and cfg.incarnation > 0
        assert (cfg.job_name, cfg.namespace, cfg.pod_name) == (job.name, "ml", pod["metadata"]["name"])
        assert cfg.strategy == spec.strategy.type
        assert cfg.checkpoint_uri == (builders.get_checkpoint_uri(job) or None)
        assert cfg.grace_s == pod["spec"]["terminationGracePeriodSeconds"]
        assert cfg.builtin == (not spec.trainer.command)
        if spec.trainer.command:
            assert cfg.command == tuple(spec.trainer.command)
        if spec.checkpoint is not None:
            storage = StorageConfig.from_env(env)
            assert (storage.uri, storage.endpoint_url, storage.region) == (
                cfg.checkpoint_uri, spec.checkpoint.endpoint or None, spec.checkpoint.region)
        if cfg.builtin:
            task, args, _ = builtin.load_config(_mounted(env, job, tmp_path), [])
            assert task == spec.trainer.builtin_task and args.strategy == spec.strategy.type
            assert args.max_steps == spec.trainer.builtin_args.get("max_steps", args.max_steps)
            if spec.strategy.type == "fsdp":
                assert args.fsdp_config == dict(spec.strategy.fsdp or {})
            if spec.strategy.type == "zero3":
                assert any(m["mountPath"] == builders.DEEPSPEED_DIR for m in container["volumeMounts"])
                assert json.loads(Path(args.deepspeed).read_text()) == dict(spec.strategy.deepspeed_config)


def test_the_examples_cover_every_strategy_and_both_kinds_of_trainer() -> None:
    specs = [_example(p).spec for p in EXAMPLES]
    assert {s.strategy.type for s in specs} == set(launch_config.STRATEGIES)
    assert {bool(s.trainer.command) for s in specs} == {True, False}
    assert any(s.checkpoint is not None for s in specs)


def test_the_operator_sets_only_documented_variables_and_the_trainer_knows_the_table() -> None:
    documented = _documented_env()
    assert documented == list(contract.POD_ENV), "kubetrain_trainer/contract.py POD_ENV follows the table"
    mentioned = set(re.findall(r"`([A-Z][A-Z0-9_]+)(?:=[^`]*)?`", CONTRACT))
    for path in EXAMPLES:
        job = _example(path)
        user = {e["name"] for e in job.spec.env}
        names = {e["name"] for e in builders.get_env(job=job, attempt=1, rank=0)} - user - NOT_THE_CONTRACT
        assert names <= mentioned, f"{path.name}: variables docs/contract.md does not name: {names - mentioned}"


def test_spec_env_cannot_move_the_store_off_spec_checkpoint_endpoint() -> None:
    # botocore takes the S3 endpoint from AWS_ENDPOINT_URL_S3 before AWS_ENDPOINT_URL, and from neither with
    # AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true. The trainer puts the operator's AWS_ENDPOINT_URL first
    # (storage_config.endpoint_variable), but with no spec.checkpoint.endpoint either of the others would send a
    # job's checkpoints off AWS S3 (or, in user code, its other S3 calls elsewhere): spec.env may set none of them.
    from kubetrain_trainer.storage_config import ENDPOINT_ENV, IGNORE_ENDPOINTS_ENV

    crd = yaml.safe_load((ROOT / "crds" / "trainingjob.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = [r for r in spec["x-kubernetes-validations"] if "'AWS_" in r["rule"]]
    for name in (*ENDPOINT_ENV, IGNORE_ENDPOINTS_ENV):
        assert any(f"'{name}'" in rule["rule"] and name in rule["message"] for rule in rules), name
    env = {"KUBETRAIN_CHECKPOINT_URI": "s3://b/p", "AWS_ENDPOINT_URL": "http://minio:9000"}
    assert StorageConfig.from_env(env).endpoint_url == "http://minio:9000"  # what the operator sets is the store
    # ... also beside an AWS_ENDPOINT_URL_S3 of a job stored before the rule (or from envFrom): its checkpoints stay
    for extra in ({"AWS_ENDPOINT_URL_S3": "http://data:9000"}, {IGNORE_ENDPOINTS_ENV: "true"}):
        assert StorageConfig.from_env({**env, **extra}).endpoint_url == "http://minio:9000"


def _pod(code: int | None, *, rank: int, disruption: bool = False, phase: str | None = None) -> PodView:
    state = {"terminated": {"exitCode": code}} if code is not None else {"running": {}}
    conditions = [{"type": "Ready", "status": "False", "lastTransitionTime": CREATED}]
    if disruption:
        conditions.append({"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"})
    view = PodView.from_storage({
        "metadata": {"name": f"tj-a1-n{rank}", "labels": {
            api.LABEL_JOB: "tj", api.LABEL_ATTEMPT: "1", api.LABEL_RANK: str(rank)}},
        "spec": {"nodeName": "node-0"},
        "status": {"phase": phase or ("Running" if code is None else "Succeeded" if code == 0 else "Failed"),
                   "conditions": conditions, "containerStatuses": [{"name": api.CONTAINER_NAME, "state": state}]},
    })
    assert view is not None
    return view


def _reading(code: int, *, disruption: bool = False) -> str:
    """What the operator makes of node rank 0 exiting with `code` while rank 1 runs (0: both succeed)."""
    job = api.Job.from_storage({
        "metadata": {"name": "tj", "namespace": "ns", "uid": "u", "generation": 1, "creationTimestamp": CREATED},
        "spec": {"image": "img:1", "nodes": 2, "trainer": {"builtin": {"task": "regression"}},
                 "runPolicy": {"backoffLimit": 3}},
        "status": {"phase": "Running", "attempt": 1, "nodesTotal": 2, "startTime": CREATED, "observedGeneration": 1},
    })
    other = _pod(0 if code == 0 else None, rank=1)
    status = plan(job, Observed(pods=(_pod(code, rank=0, disruption=disruption), other), nodes={}),
                  values.parse_time(CREATED)).status
    assert status is not None, f"exit {code}: the operator wrote no status"
    if status.phase in ("Succeeded", "Failed"):
        return status.phase.lower()
    if status.preemptions == 1 and status.failures == 0:
        return "preemption"
    if status.failures == 1 and status.preemptions == 0:
        return "application failure"
    return f"unexpected: {status.phase}, {status.preemptions} preemption(s), {status.failures} failure(s)"


def test_every_documented_exit_code_reads_on_the_operator_side_as_documented() -> None:
    table = _section("Exit codes")
    rows = {tuple(int(c) for c in re.findall(r"`(\d+)`", m.group(1))): m.group(2)
            for m in re.finditer(r"^\| ((?:`\d+`(?:, )?)+) \| [^|]+ \| (.+) \|$", table, re.M)}
    by_code = {code: reading for codes, reading in rows.items() for code in codes}
    assert set(by_code) == {0, 82, 83, 84, 137, 143}, "the table's codes changed: extend this test"
    assert "any other non-zero" in table and "application failure" in table
    assert (contract.EXIT_OK, contract.EXIT_INVALID_CONFIG, contract.EXIT_PREEMPTED, contract.EXIT_STORAGE) \
        == (0, 82, 83, 84)
    assert (api.EXIT_INVALID_CONFIG, api.EXIT_PREEMPTED) == (contract.EXIT_INVALID_CONFIG, contract.EXIT_PREEMPTED)

    assert "job succeeds" in by_code[0] and _reading(contract.EXIT_OK) == "succeeded"
    assert "fails at once" in by_code[82] and _reading(contract.EXIT_INVALID_CONFIG) == "failed"
    assert "**preemption**" in by_code[83] and _reading(contract.EXIT_PREEMPTED) == "preemption"
    assert "**application failure**" in by_code[84] and _reading(contract.EXIT_STORAGE) == "application failure"
    for code in (137, 143):
        assert "DisruptionTarget" in by_code[code]
        assert _reading(code, disruption=True) == "preemption"
        assert _reading(code) == "application failure"
    assert _reading(1) == _reading(2) == "application failure"  # "any other non-zero"


def test_the_last_checkpoint_record_and_annotations_agree() -> None:
    from kubetrain_trainer.commit import CommittedCheckpoint

    text = CommittedCheckpoint(step=1200, uri="s3://b/p/ml/j/checkpoint-1200", time="2026-01-01T00:00:00Z").to_json()
    assert json.loads(text)["kind"] == contract.LAST_CHECKPOINT_KIND
    parsed = parse_checkpoint_record(text)
    assert parsed is not None and (parsed.step, parsed.uri) == (1200, "s3://b/p/ml/j/checkpoint-1200")
    assert (api.ANNOTATION_LAST_CHECKPOINT, api.ANNOTATION_CHECKPOINT_SYNC) == (
        contract.ANNOTATION_LAST_CHECKPOINT, contract.ANNOTATION_CHECKPOINT_SYNC)
    report = _section("Reporting the last checkpoint")
    assert f"`{contract.ANNOTATION_LAST_CHECKPOINT}`" in report and f"`{contract.ANNOTATION_CHECKPOINT_SYNC}`" in report


def test_the_failure_record_reads_on_the_operator_side_as_the_trainer_means_it() -> None:
    from kubetrain.records import MAX_RECORD_BYTES, parse_failure_record
    from kubetrain_trainer.failure import FailureRecord

    assert contract.FAILURE_KIND == api.FAILURE_RECORD_KIND
    assert set(contract.FAILURE_REASONS) == set(api.FAILURE_REASONS)
    assert contract.FAILURE_CODE_PATTERN == api.FAILURE_CODE.pattern
    assert contract.TERMINATION_MESSAGE_LIMIT == MAX_RECORD_BYTES
    section = _section("Reporting a failure")
    assert f'"{contract.FAILURE_KIND}"' in section
    assert all(f"`{reason}`" in section for reason in contract.FAILURE_REASONS), "every reason is documented"

    # What a pod of example job ml/demo writes when its storage refuses it, through the planner.
    job = _example(ROOT / "examples" / "trainingjob.yaml")
    where = builders.get_checkpoint_uri(job)
    for reason in contract.FAILURE_REASONS:
        text = FailureRecord(reason=reason, code="AccessDenied", where=where).to_json()
        parsed = parse_failure_record(text)
        assert parsed is not None and (parsed.reason, parsed.code, parsed.where) == (reason, "AccessDenied", where)
        rank0 = PodView.from_storage({
            "metadata": {"name": "demo-a1-n0", "labels": {api.LABEL_JOB: "demo", api.LABEL_ATTEMPT: "1",
                                                         api.LABEL_RANK: "0"}},
            "status": {"phase": "Failed", "containerStatuses": [{"name": api.CONTAINER_NAME, "state": {
                "terminated": {"exitCode": contract.EXIT_INVALID_CONFIG, "message": text + "\n"}}}]}})
        running = api.Job(**{**job.__dict__, "status": api.Status.from_storage(
            {"phase": "Running", "attempt": 1, "nodesTotal": 2, "startTime": CREATED})})
        status = plan(running, Observed(pods=(rank0, _pod(None, rank=1))), values.parse_time(CREATED)).status
        assert status is not None and status.phase == "Failed"
        failed = status.condition("Failed")
        assert failed is not None and failed.reason == reason
        assert "code AccessDenied" in failed.message and f"at {where}" in failed.message


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_reference_in_an_example_command_is_filled_by_the_pod_or_the_launcher(path: Path) -> None:
    """A `$(NAME)` in an example's command must be expanded by Kubernetes (the pod's env lists NAME)
    or by the launcher (command.LAUNCHER_SET); any other one would reach the program as written,
    e.g. accelerate launch given the literal text `$(NODE_RANK)` as its machine rank."""
    from kubetrain_trainer.command import LAUNCHER_SET

    job = _example(path)
    pod = builders.get_pod(job=job, attempt=1, rank=0)
    container = pod["spec"]["containers"][0]
    listed = {e["name"] for e in container["env"]}
    user_command = container["command"][len(builders.LAUNCHER):]
    refs = {m for arg in user_command for m in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg)}
    assert refs <= listed | LAUNCHER_SET, f"{path.name}: unfilled {sorted(refs - listed - LAUNCHER_SET)}"


def test_the_accelerate_example_joins_one_rendezvous_across_its_nodes() -> None:
    """Without the machine flags every pod of examples/trainingjob-command.yaml would start its own
    single-machine run: each pod must pass its own rank and node 0's address."""
    job = _example(ROOT / "examples" / "trainingjob-command.yaml")
    assert job.spec is not None and job.spec.nodes > 1
    for rank in range(job.spec.nodes):
        pod = builders.get_pod(job=job, attempt=1, rank=rank)
        container = pod["spec"]["containers"][0]
        env = _pod_env(container["env"], pod["metadata"]["name"])
        command = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a)
                   for a in container["command"][len(builders.LAUNCHER):]]
        assert command[0] == "--"
        command = command[1:]
        flags = dict(zip(command[2::2], command[3::2]))
        assert command[:2] == ["accelerate", "launch"]
        assert flags["--num_machines"] == str(job.spec.nodes)
        assert flags["--machine_rank"] == str(rank)
        assert flags["--main_process_ip"] == builders.get_master_addr(job)
        assert flags["--main_process_port"] == str(job.spec.master_port)
