#!/usr/bin/env bash
# The one-command demo: a local cluster, the operator from its Helm chart, and
# examples/trainingjob.yaml trained for real (2 nodes x 1 process, DDP on CPU)
# with checkpoints in a local S3 (MinIO). Midway, a higher-priority pod takes
# the node from one of the job's pods through the scheduler; the job restarts
# as a whole gang and resumes from its emergency checkpoint. Safe to run again.
#
#   scripts/demo.sh          set up whatever is missing, run the demo job, show the result
#   scripts/demo.sh status   what runs, and the demo job's status
#   scripts/demo.sh down     stop the agent, uninstall the chart, stop the testbed
#
#   DEMO_FRESH=1 scripts/demo.sh   delete the demo job and its checkpoints first (train from step 0)
#
# Pods run as containers on the testbed's real node (kubelet + containerd, images
# built from the Dockerfiles and pulled from a loopback registry); it needs root.
# DEMO_NODES=agent runs them as local processes on the test node agent instead
# (no preemption there). See docs/e2e.md.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

NS=${DEMO_NAMESPACE:-kubetrain-demo}
OP_NS=${DEMO_OPERATOR_NAMESPACE:-kubetrain-system}
RELEASE=kubetrain
NODE=kubetrain-agent-0
JOB=demo
STATE=${KUBETRAIN_TESTBED_DIR:-$root/.testbed}  # the testbed's state folder (scripts/testbed.sh honours it too)
AGENT_PID=$STATE/agent.pid
AGENT_LOG=$STATE/agent.log
TIMEOUT=${DEMO_TIMEOUT:-900}
PY=$root/.venv/bin/python
MODE=${DEMO_NODES:-real}
[[ $MODE == real && $(id -u) != 0 ]] && { MODE=agent; printf '[demo] not root: pods run on the process agent\n' >&2; }
STEPS=${DEMO_STEPS:-300}

say() { printf '\033[1m[demo]\033[0m %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }

agent_running() { [[ -f $AGENT_PID ]] && kill -0 "$(cat "$AGENT_PID")" 2>/dev/null; }

stop_agent() {
  if agent_running; then
    local pid; pid=$(cat "$AGENT_PID")
    say "stopping the node agent (pid $pid): its pods get SIGTERM first"
    kill -TERM "$pid"
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && { say "agent still alive after 30 s: SIGKILL"; kill -KILL "$pid"; }
  fi
  rm -f "$AGENT_PID"
}

load_env() {
  [[ -f $STATE/env ]] || return 1
  # shellcheck disable=SC1091
  source "$STATE/env"
}

cmd_down() {
  if load_env 2>/dev/null && scripts/testbed.sh status >/dev/null 2>&1; then
    helm uninstall "$RELEASE" -n "$OP_NS" --wait --timeout 2m >/dev/null 2>&1 || true
    kubectl delete namespace "$NS" --ignore-not-found --wait=false >/dev/null 2>&1 || true
  fi
  stop_agent
  scripts/testbed.sh down
  say "down."
}

cmd_status() {
  scripts/testbed.sh status || true
  if agent_running; then say "node agent: running (pid $(cat "$AGENT_PID"), log $AGENT_LOG)"; else say "node agent: stopped"; fi
  if load_env 2>/dev/null; then
    kubectl get nodes -l kubetrain.io/agent=true 2>/dev/null || true
    kubectl get trainingjobs -n "$NS" 2>/dev/null || true
  fi
}

ensure_venv() {
  # One environment recipe for every entry point (cached by dependency set).
  scripts/setup.sh
  export PATH="$root/.venv/bin:$PATH"
}

start_agent() {
  if agent_running; then
    say "node agent already running (pid $(cat "$AGENT_PID"))"
  else
    say "starting the test node agent '$NODE' (log: $AGENT_LOG)"
    PYTHONPATH="$root/testbed${PYTHONPATH:+:$PYTHONPATH}" nohup "$PY" -m kubetrain_testbed.agent \
      --kubeconfig "$KUBECONFIG" --node-name "$NODE" --state-dir "$STATE/agent/$NODE" \
      --taint kubetrain.io/agent=true:NoSchedule >>"$AGENT_LOG" 2>&1 &
    echo $! >"$AGENT_PID"
  fi
  for _ in $(seq 1 60); do kubectl get node "$NODE" >/dev/null 2>&1 && break; sleep 1; done
  kubectl wait --for=condition=Ready "node/$NODE" --timeout=90s >/dev/null ||
    { tail -n 30 "$AGENT_LOG" >&2; die "node $NODE did not become Ready"; }
}

install_chart() {
  local values=$STATE/demo-values.yaml
  if [[ $MODE == real ]]; then
    cat >"$values" <<EOF
# Written by scripts/demo.sh: the operator image from the registry, on the real node, watching the demo namespace.
image: {repository: "${OPERATOR_IMAGE%:*}", tag: "${OPERATOR_IMAGE##*:}"}
namespaces: [$NS]
priorityClassName: kubetrain-demo-system
nodeSelector: {kubetrain.io/real-node: "true"}
tolerations: [{key: kubetrain.io/real-node, operator: Equal, value: "true", effect: NoSchedule}]
EOF
    # The operator outranks everything in the demo: the preemption takes a training pod, never it.
    kubectl apply -f - >/dev/null <<EOF
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata: {name: kubetrain-demo-system}
value: 100000
description: the demo's operator
---
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata: {name: kubetrain-demo-urgent}
value: 1000
description: the demo's preemptor
EOF
  else
    cat >"$values" <<EOF
# Written by scripts/demo.sh: run the operator on the agent's node, watching the demo namespace.
namespaces: [$NS]
healthPort: ${DEMO_HEALTH_PORT:-18080}
nodeSelector: {kubetrain.io/agent: "true"}
tolerations: [{key: kubetrain.io/agent, operator: Equal, value: "true", effect: NoSchedule}]
EOF
  fi
  kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
  # Pods and operator are admitted as PodSecurity "restricted", as in a hardened cluster.
  kubectl label namespace "$NS" pod-security.kubernetes.io/enforce=restricted --overwrite >/dev/null
  say "helm upgrade --install $RELEASE charts/kubetrain -n $OP_NS"
  helm upgrade --install "$RELEASE" charts/kubetrain -n "$OP_NS" --create-namespace \
    --values "$values" --wait --timeout 4m >/dev/null ||
    { if [[ $MODE == real ]]; then kubectl describe pods -n "$OP_NS" >&2; else tail -n 30 "$AGENT_LOG" >&2; fi
      die "helm install failed"; }
}

create_secret_and_bucket() {
  # Credentials go through stdin, never the command line (visible in ps).
  kubectl apply -n "$NS" -f - >/dev/null <<EOF
apiVersion: v1
kind: Secret
metadata: {name: kubetrain-s3}
type: Opaque
stringData:
  accessKeyId: "$AWS_ACCESS_KEY_ID"
  secretAccessKey: "$AWS_SECRET_ACCESS_KEY"
EOF
  "$PY" - <<'EOF'
import boto3, os
s3 = boto3.client("s3")
try:
    s3.create_bucket(Bucket="kubetrain-demo")
except (s3.exceptions.BucketAlreadyOwnedByYou, s3.exceptions.BucketAlreadyExists):
    pass
EOF
}

# examples/trainingjob.yaml as written, plus: the testbed's S3 endpoint and placement on the agent's node.
render_job() {
  "$PY" - <<'EOF'
import json, os, yaml
job = yaml.safe_load(open("examples/trainingjob.yaml"))
spec = job["spec"]
tpl = spec.setdefault("podTemplate", {})
if os.environ["MODE"] == "real":
    # Our image from the registry, MinIO as pods reach it, the real node; long enough to be preempted.
    spec["image"] = os.environ["TRAINER_IMAGE"]
    spec["checkpoint"]["endpoint"] = os.environ["KUBETRAIN_TESTBED_POD_S3_ENDPOINT"]
    spec["resources"] = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "3Gi"}}
    spec["trainer"]["builtin"]["args"].update(max_steps=int(os.environ["STEPS"]), save_steps=25, logging_steps=25)
    label = "kubetrain.io/real-node"
else:
    spec["checkpoint"]["endpoint"] = os.environ["AWS_ENDPOINT_URL"]
    # All pods share this machine's ports: keep clear of torch's default 29500, which tests use.
    spec["masterPort"] = int(os.environ.get("DEMO_MASTER_PORT", "29531"))
    label = "kubetrain.io/agent"
tpl.setdefault("nodeSelector", {})[label] = "true"
tpl.setdefault("tolerations", []).append({"key": label, "operator": "Equal", "value": "true", "effect": "NoSchedule"})
print(json.dumps(job))
EOF
}

fresh_start() {
  say "DEMO_FRESH=1: deleting TrainingJob $JOB and its checkpoints"
  kubectl delete trainingjob "$JOB" -n "$NS" --ignore-not-found --wait=true --timeout=120s >/dev/null
  "$PY" - "$NS" "$JOB" <<'EOF'
import boto3, sys
s3 = boto3.resource("s3")
s3.Bucket("kubetrain-demo").objects.filter(Prefix=f"jobs/{sys.argv[1]}/{sys.argv[2]}/").delete()
EOF
}

wait_job() {
  local start=$SECONDS last="" line phase
  say "waiting for TrainingJob $NS/$JOB (kubectl get tj -n $NS -w shows the same)"
  kubectl get tj "$JOB" -n "$NS" | head -n 1 >&2
  while :; do
    line=$(kubectl get tj "$JOB" -n "$NS" --no-headers 2>/dev/null || true)
    [[ -n $line && $line != "$last" ]] && { echo "$line" >&2; last=$line; }
    phase=$(kubectl get tj "$JOB" -n "$NS" -o jsonpath='{.status.phase}' 2>/dev/null || true)
    [[ $phase == Succeeded || $phase == Failed ]] && { echo "$phase"; return; }
    ((SECONDS - start > TIMEOUT)) && { echo "Timeout"; return; }
    sleep 3
  done
}

report() {
  say "status:"
  kubectl get tj "$JOB" -n "$NS" -o jsonpath='{.status}' | "$PY" -m json.tool >&2
  say "events:"
  kubectl get events -n "$NS" --field-selector "involvedObject.kind=TrainingJob,involvedObject.name=$JOB" \
    --sort-by=.lastTimestamp -o custom-columns=TIME:.lastTimestamp,TYPE:.type,REASON:.reason,MESSAGE:.message >&2
  say "checkpoints in s3://kubetrain-demo/jobs/$NS/$JOB/ (a checkpoint exists once its manifest.json does):"
  "$PY" - "$NS" "$JOB" <<'EOF' >&2
import boto3, collections, json, sys
s3 = boto3.client("s3")
prefix = f"jobs/{sys.argv[1]}/{sys.argv[2]}/"
dirs = collections.defaultdict(lambda: [0, 0, None])
for page in s3.get_paginator("list_objects_v2").paginate(Bucket="kubetrain-demo", Prefix=prefix):
    for o in page.get("Contents", []):
        d, _, name = o["Key"][len(prefix):].partition("/")
        dirs[d][0] += 1
        dirs[d][1] += o["Size"]
        if name == "manifest.json":
            dirs[d][2] = json.loads(s3.get_object(Bucket="kubetrain-demo", Key=o["Key"])["Body"].read())
for d in sorted(dirs, key=lambda x: int(x.rpartition("-")[2]) if x.rpartition("-")[2].isdigit() else -1):
    n, size, m = dirs[d]
    if d == "attempts":  # one claim per attempt (docs/contract.md), not a checkpoint
        print(f"  {d:<18} {n:>3} claims   (one per attempt: which step each attempt restored)")
        continue
    state = f"committed by attempt {m['attempt']}, world size {m['world_size']}" if m else "incomplete (no manifest)"
    print(f"  {d:<18} {n:>3} files {size / 2**20:8.2f} MiB  {state}")
EOF
}

# Midway, a pod of a higher PriorityClass that only fits if a training pod goes: the scheduler preempts one.
preempt_midway() {
  local step=0
  say "waiting for the first committed checkpoint, then a higher-priority pod takes the node"
  for _ in $(seq 1 300); do
    step=$("$PY" - "$NS" "$JOB" <<'EOF' 2>/dev/null || echo 0
import boto3, sys
s3 = boto3.client("s3")
keys = [o["Key"] for p in s3.get_paginator("list_objects_v2").paginate(Bucket="kubetrain-demo",
        Prefix=f"jobs/{sys.argv[1]}/{sys.argv[2]}/checkpoint-") for o in p.get("Contents", [])]
print(max([int(k.split("/")[-2].split("-")[1]) for k in keys if k.endswith("/manifest.json")] or [0]))
EOF
)
    [[ $step -gt 0 ]] && break
    sleep 1
  done
  [[ $step -gt 0 ]] || die "no checkpoint was committed in 5 minutes: kubectl describe pods -n $NS"
  local free; free=$("$PY" - <<'EOF' || die "could not read the real node's free CPU"
import json, subprocess
node = json.loads(subprocess.check_output(["kubectl", "get", "node", "real-node-0", "-o", "json"]))
pods = json.loads(subprocess.check_output(["kubectl", "get", "pods", "-A", "--field-selector",
                                           "spec.nodeName=real-node-0,status.phase=Running", "-o", "json"]))
def cpu(q): return float(q[:-1]) / 1000 if q.endswith("m") else float(q)
used = sum(cpu(c.get("resources", {}).get("requests", {}).get("cpu", "0")) for p in pods["items"]
           for c in p["spec"]["containers"])
print(int((cpu(node["status"]["allocatable"]["cpu"]) - used) * 1000))
EOF
)
  # Just more than what is free: one 500m training pod must go.
  kubectl apply -n "$NS" -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: urgent}
spec:
  priorityClassName: kubetrain-demo-urgent
  restartPolicy: Never
  nodeSelector: {kubetrain.io/real-node: "true"}
  tolerations: [{key: kubetrain.io/real-node, operator: Equal, value: "true", effect: NoSchedule}]
  securityContext: {runAsNonRoot: true, runAsUser: 65534, seccompProfile: {type: RuntimeDefault}}
  containers:
  - name: urgent
    image: $TRAINER_IMAGE
    command: [python, -c, "import time; time.sleep(5)"]
    resources: {requests: {cpu: "$((free + 200))m", memory: 64Mi}}
    securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
EOF
  # Rank 0's log of attempt 1 says where it stopped; keep it before the pod is gone.
  kubectl logs -f -n "$NS" "$JOB-a1-n0" >"$STATE/demo-a1-n0.log" 2>/dev/null &
  say "step $step committed: pod 'urgent' (priority 1000, cpu $((free + 200))m) preempts a training pod"
}

recovery_report() {
  "$PY" - "$NS" "$JOB" "$STATE/demo-a1-n0.log" <<'EOF' >&2
import datetime, json, re, subprocess, sys
ns, job, a1_path = sys.argv[1:4]
def k(*a): return subprocess.run(["kubectl", *a], capture_output=True, text=True).stdout
st = json.loads(k("get", "tj", job, "-n", ns, "-o", "json"))["status"]
def when(text):
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")[:19] + "+00:00") if text else None
events = json.loads(k("get", "events", "-n", ns, "-o", "json"))["items"]
sigterm = sorted(  # the newest: a re-run keeps the events of earlier pods of the same name
    when(e.get("lastTimestamp") or e.get("eventTime")) for e in events
                 if e["reason"] == "Preempted" and e["involvedObject"]["name"].startswith(job + "-a1"))
log = k("logs", "-n", ns, f"{job}-a2-n0")
# The trainer's own log lines carry their time ("2026-12-03 12:10:23,583 [rank 0] INFO ...", UTC).
stamp = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+ \[rank 0\] INFO "
resumed = re.search(stamp + r"resuming from \S*checkpoint-(\d+)", log, re.M)
first = re.search(stamp + r"step (\d+): \{'loss'", log, re.M)
try:
    a1_log = open(a1_path, errors="replace").read()
except OSError:
    a1_log = ""
stopped = re.search(r"SIGTERM: stopped after step (\d+)", a1_log)
print(f"  attempts: {st.get('attempt')}   preemptions: {st.get('preemptions', 0)}   "
      f"failures (backoffLimit spent): {st.get('failures', 0)}")
if resumed:
    r = int(resumed.group(2))
    a1 = int(stopped.group(1)) if stopped else None
    print(f"  attempt 1 stopped after step {a1 if a1 is not None else '?'} (its emergency checkpoint); "
          f"attempt 2 resumed from step {r}; steps lost: {a1 - r if a1 is not None else '?'}")
if sigterm and resumed:
    t = lambda m: when(m.group(1).replace(" ", "T"))
    print(f"  SIGTERM (preempted) -> attempt 2 restored its checkpoint: {(t(resumed) - sigterm[-1]).total_seconds():.0f} s")
    if first:
        print(f"  SIGTERM -> attempt 2's first logged step ({first.group(2)}, logging_steps after the first): "
              f"{(t(first) - sigterm[-1]).total_seconds():.0f} s")
EOF
}

cmd_up() {
  ensure_venv
  say "bringing up the testbed (the first run builds Kubernetes from source: see README)"
  if [[ $MODE == real ]]; then
    scripts/testbed.sh up --nodes real
    load_env || die "testbed wrote no $STATE/env"
    say "building the images from their Dockerfiles (cached layers; the first build downloads torch)"
    local refs; refs=$(scripts/testbed.sh images) || die "image build failed (log: $STATE/run/images.log)"
    OPERATOR_IMAGE=$(echo "$refs" | "$PY" -c 'import json,sys; print([json.loads(l)["ref"] for l in sys.stdin if "operator" in l][0])')
    TRAINER_IMAGE=$(echo "$refs" | "$PY" -c 'import json,sys; print([json.loads(l)["ref"] for l in sys.stdin if "trainer" in l][0])')
    export OPERATOR_IMAGE TRAINER_IMAGE
    say "images: $OPERATOR_IMAGE, $TRAINER_IMAGE"
  else
    scripts/testbed.sh up
    load_env || die "testbed wrote no $STATE/env"
    start_agent
  fi
  export MODE STEPS
  install_chart
  create_secret_and_bucket
  [[ ${DEMO_FRESH:-0} == 1 ]] && fresh_start
  say "kubectl apply -f examples/trainingjob.yaml (endpoint and node placement adapted to the testbed)"
  render_job | kubectl apply -n "$NS" -f - >&2
  local attempt
  attempt=$(kubectl get tj "$JOB" -n "$NS" -o jsonpath='{.status.attempt}' 2>/dev/null || true)
  if [[ $MODE == real && ${attempt:-1} -le 1 ]]; then
    kubectl delete pod urgent -n "$NS" --ignore-not-found >/dev/null
    preempt_midway
  fi
  local phase; phase=$(wait_job)
  report || true
  if [[ $MODE == real && $phase == Succeeded ]]; then
    say "the cluster took a node; the job finished anyway:"
    recovery_report || true
    say "logs of the training pods: kubectl logs -n $NS ${JOB}-a2-n0"
  else
    say "logs of the training pods: $STATE/agent/$NODE/pods/${NS}_${JOB}-*/trainer.log"
  fi
  say "tear down with: scripts/demo.sh down"
  [[ $phase == Succeeded ]] || die "the demo job ended as $phase"
  say "Succeeded."
}

case "${1:-up}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  *) die "usage: scripts/demo.sh [up|status|down]" ;;
esac
