"""kwok Stage configuration: how fake nodes and pods move through their lives.

kwok v0.8.0 run as a plain binary has no built-in stages: it refuses to start
without some. These are ours, written out at `up` into the run folder and
passed with `--config`:

- node-initialize / node-heartbeat: fake nodes become Ready; kwok renews
  their Leases.
- kubetrain-node-lost: a node annotated `kwok.kubetrain.io/node-lost` (any
  value) reports Ready=Unknown, as when its kubelet vanished: the node
  lifecycle controller taints it `node.kubernetes.io/unreachable:NoExecute`
  and taint-eviction deletes its pods once their toleration expires. Removing
  the annotation makes the node Ready again. (kwok keeps renewing Leases of
  every node it has seen, so stopping them is not an option.)
- pod-ready: a pod bound to a kwok node becomes Running and Ready with an IP.
- pod-delete: a pod being deleted is removed, as a kubelet would after its
  grace period.
- kubetrain-pod-exit: a Running pod annotated `kwok.kubetrain.io/exit-code: "N"`
  terminates every container with exit code N (phase Succeeded for 0, Failed
  otherwise), optionally after `kwok.kubetrain.io/exit-delay` (a Go duration
  such as "3s", counted from when the pod reached Running), with the
  termination `message` from `kwok.kubetrain.io/message` and `reason` from
  `kwok.kubetrain.io/reason`. This is how operator tests make training pods
  finish or fail on demand.
"""

from __future__ import annotations

#: Annotation keys of the pod-exit stage, for tests to import.
EXIT_CODE_ANNOTATION = "kwok.kubetrain.io/exit-code"
EXIT_DELAY_ANNOTATION = "kwok.kubetrain.io/exit-delay"
EXIT_MESSAGE_ANNOTATION = "kwok.kubetrain.io/message"
EXIT_REASON_ANNOTATION = "kwok.kubetrain.io/reason"
NODE_LOST_ANNOTATION = "kwok.kubetrain.io/node-lost"

_NODE_INITIALIZE = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: node-initialize
spec:
  resourceRef: {apiGroup: v1, kind: Node}
  selector:
    matchExpressions:
    - key: '.metadata.annotations["kwok.kubetrain.io/node-lost"]'
      operator: 'DoesNotExist'
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: 'NotIn'
      values: ['True']
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      {{ range NodeConditions }}
      - lastHeartbeatTime: {{ $now | Quote }}
        lastTransitionTime: {{ $now | Quote }}
        message: {{ .message | Quote }}
        reason: {{ .reason | Quote }}
        status: {{ .status | Quote }}
        type: {{ .type | Quote }}
      {{ end }}
      addresses:
      - address: {{ NodeIP | Quote }}
        type: InternalIP
      - address: {{ NodeName | Quote }}
        type: Hostname
      allocatable:
      {{ with .status.allocatable }}
      {{ YAML . 1 }}
      {{ else }}
        cpu: "32"
        memory: 256Gi
        pods: "110"
      {{ end }}
      capacity:
      {{ with .status.capacity }}
      {{ YAML . 1 }}
      {{ else }}
        cpu: "32"
        memory: 256Gi
        pods: "110"
      {{ end }}
      nodeInfo:
        architecture: amd64
        operatingSystem: linux
        kubeletVersion: {{ printf "kwok-%s" Version | Quote }}
        kubeProxyVersion: {{ printf "kwok-%s" Version | Quote }}
        containerRuntimeVersion: {{ printf "kwok-%s" Version | Quote }}
        kernelVersion: {{ printf "kwok-%s" Version | Quote }}
      phase: Running
"""

_NODE_HEARTBEAT = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: node-heartbeat-with-lease
spec:
  resourceRef: {apiGroup: v1, kind: Node}
  selector:
    matchExpressions:
    - key: '.metadata.annotations["kwok.kubetrain.io/node-lost"]'
      operator: 'DoesNotExist'
    - key: '.status.phase'
      operator: 'In'
      values: ['Running']
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: 'In'
      values: ['True']
  delay:
    durationMilliseconds: 300000
    jitterDurationMilliseconds: 310000
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      {{ range NodeConditions }}
      - lastHeartbeatTime: {{ $now | Quote }}
        message: {{ .message | Quote }}
        reason: {{ .reason | Quote }}
        status: {{ .status | Quote }}
        type: {{ .type | Quote }}
      {{ end }}
"""

_NODE_LOST = f"""\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: kubetrain-node-lost
spec:
  resourceRef: {{apiGroup: v1, kind: Node}}
  selector:
    matchExpressions:
    - key: '.metadata.annotations["{NODE_LOST_ANNOTATION}"]'
      operator: 'Exists'
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: 'NotIn'
      values: ['Unknown']
  next:
    statusTemplate: |
      {{{{ $now := Now }}}}
      conditions:
      - lastHeartbeatTime: {{{{ $now | Quote }}}}
        lastTransitionTime: {{{{ $now | Quote }}}}
        message: "Kubelet stopped posting node status."
        reason: NodeStatusUnknown
        status: "Unknown"
        type: Ready
"""

_POD_READY = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-ready
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.phase'
      operator: 'In'
      values: ['Pending']
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: 'NotIn'
      values: ['True']
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - lastTransitionTime: {{ $now | Quote }}
        status: "True"
        type: Initialized
      - lastTransitionTime: {{ $now | Quote }}
        status: "True"
        type: Ready
      - lastTransitionTime: {{ $now | Quote }}
        status: "True"
        type: ContainersReady
      {{ range .spec.readinessGates }}
      - lastTransitionTime: {{ $now | Quote }}
        status: "True"
        type: {{ .conditionType | Quote }}
      {{ end }}
      containerStatuses:
      {{ range .spec.containers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: true
        started: true
        restartCount: 0
        state:
          running:
            startedAt: {{ $now | Quote }}
      {{ end }}
      initContainerStatuses:
      {{ range .spec.initContainers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: true
        restartCount: 0
        state:
          terminated:
            exitCode: 0
            finishedAt: {{ $now | Quote }}
            reason: Completed
            startedAt: {{ $now | Quote }}
      {{ end }}
      hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
      hostIPs:
      - ip: {{ NodeIPWith .spec.nodeName | Quote }}
      {{ $podIP := PodIPWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) }}
      podIP: {{ $podIP | Quote }}
      podIPs:
      - ip: {{ $podIP | Quote }}
      phase: Running
      startTime: {{ $now | Quote }}
"""

_POD_EXIT = f"""\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: kubetrain-pod-exit
spec:
  resourceRef: {{apiGroup: v1, kind: Pod}}
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.phase'
      operator: 'In'
      values: ['Running']
    - key: '.metadata.annotations["{EXIT_CODE_ANNOTATION}"]'
      operator: 'Exists'
  delay:
    durationMilliseconds: 0
    durationFrom:
      expressionFrom: '.metadata.annotations["{EXIT_DELAY_ANNOTATION}"]'
  next:
    statusTemplate: |
      {{{{ $now := Now }}}}
      {{{{ $ann := .metadata.annotations }}}}
      {{{{ $code := index $ann "{EXIT_CODE_ANNOTATION}" }}}}
      {{{{ $ok := eq $code "0" }}}}
      {{{{ $reason := or ( index $ann "{EXIT_REASON_ANNOTATION}" ) ( and $ok "Completed" ) "Error" }}}}
      {{{{ $message := or ( index $ann "{EXIT_MESSAGE_ANNOTATION}" ) "" }}}}
      {{{{ $started := or .status.startTime $now }}}}
      conditions:
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "False"
        reason: {{{{ if $ok }}}}PodCompleted{{{{ else }}}}PodFailed{{{{ end }}}}
        type: Ready
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "False"
        reason: {{{{ if $ok }}}}PodCompleted{{{{ else }}}}PodFailed{{{{ end }}}}
        type: ContainersReady
      containerStatuses:
      {{{{ range .spec.containers }}}}
      - image: {{{{ .image | Quote }}}}
        name: {{{{ .name | Quote }}}}
        ready: false
        started: false
        restartCount: 0
        state:
          terminated:
            exitCode: {{{{ $code }}}}
            reason: {{{{ $reason | Quote }}}}
            message: {{{{ $message | Quote }}}}
            startedAt: {{{{ $started | Quote }}}}
            finishedAt: {{{{ $now | Quote }}}}
      {{{{ end }}}}
      phase: {{{{ if $ok }}}}Succeeded{{{{ else }}}}Failed{{{{ end }}}}
"""

_POD_DELETE = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-delete
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'Exists'
  next:
    delete: true
"""

STAGES_YAML = "---\n".join([_NODE_INITIALIZE, _NODE_HEARTBEAT, _NODE_LOST, _POD_READY, _POD_EXIT, _POD_DELETE])
"""The whole --config file for kwok."""
