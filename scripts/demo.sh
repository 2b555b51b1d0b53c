#!/usr/bin/env bash
# The one-command demo: a local cluster, the operator from its Helm chart, and
# examples/trainingjob.yaml trained for real (2 nodes x 1 process, DDP on CPU)
# with checkpoints in a local S3 (MinIO). Safe to run again at any time.
#
#   scripts/demo.sh          set up whatever is missing, run the demo job, show the result
#   scripts/demo.sh status   what runs, and the demo job's status
#   scripts/demo.sh down     stop the agent, uninstall the chart, stop the testbed
#
#   DEMO_FRESH=1 scripts/demo.sh   delete the demo job and its checkpoints first (train from step 0)
#
# Pods run as local processes on a test node agent (testbed/kubetrain_testbed/agent.py):
# there is no container engine here. See docs/e2e.md.
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
  cat >"$values" <<EOF
# Written by scripts/demo.sh: run the operator on the agent's node, watching the demo namespace.
namespaces: [$NS]
healthPort: ${DEMO_HEALTH_PORT:-18080}
nodeSelector: {kubetrain.io/agent: "true"}
tolerations: [{key: kubetrain.io/agent, operator: Equal, value: "true", effect: NoSchedule}]
EOF
  kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
  say "helm upgrade --install $RELEASE charts/kubetrain -n $OP_NS"
  helm upgrade --install "$RELEASE" charts/kubetrain -n "$OP_NS" --create-namespace \
    --values "$values" --wait --timeout 4m >/dev/null ||
    { tail -n 30 "$AGENT_LOG" >&2; die "helm install failed"; }
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
spec["checkpoint"]["endpoint"] = os.environ["AWS_ENDPOINT_URL"]
# All pods share this machine's ports: keep clear of torch's default 29500, which tests use.
spec["masterPort"] = int(os.environ.get("DEMO_MASTER_PORT", "29531"))
tpl = spec.setdefault("podTemplate", {})
tpl.setdefault("nodeSelector", {})["kubetrain.io/agent"] = "true"
tpl.setdefault("tolerations", []).append(
    {"key": "kubetrain.io/agent", "operator": "Equal", "value": "true", "effect": "NoSchedule"})
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
    state = f"committed by attempt {m['attempt']}, world size {m['world_size']}" if m else "incomplete (no manifest)"
    print(f"  {d:<18} {n:>3} files {size / 2**20:8.2f} MiB  {state}")
EOF
}

cmd_up() {
  ensure_venv
  say "bringing up the testbed (the first run builds Kubernetes from source: see README)"
  scripts/testbed.sh up
  load_env || die "testbed wrote no $STATE/env"
  start_agent
  install_chart
  create_secret_and_bucket
  [[ ${DEMO_FRESH:-0} == 1 ]] && fresh_start
  say "kubectl apply -f examples/trainingjob.yaml (endpoint and node placement adapted to the testbed)"
  render_job | kubectl apply -n "$NS" -f - >&2
  local phase; phase=$(wait_job)
  report
  say "logs of the training pods: $STATE/agent/$NODE/pods/${NS}_${JOB}-*/trainer.log"
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
