"""The trainer's half of docs/contract.md: the names and codes it shares with the operator, once.

The two images share no Python imports, so the operator keeps its own copy of
what it reads (`kubetrain.api`). Neither copy is trusted alone:
tests/unit/test_contract.py imports both packages and checks that what the
operator's builders put into a pod is what the launcher parses, that every
documented exit code is classified by the operator as the document says, and
that the document's tables list exactly the names here.
"""

from __future__ import annotations

# --- exit codes: the only failure signal the operator reads from the trainer ------------
EXIT_OK = 0
EXIT_INVALID_CONFIG = 82
"""Can never succeed (bad arguments, S3 access refused past its window): the job fails at once."""
EXIT_PREEMPTED = 83
"""SIGTERM handled: emergency checkpoint taken (if it could be): a preemption, no backoffLimit spent."""
EXIT_STORAGE = 84
"""Checkpoint storage unreachable at start, or final uploads not committed: an application failure (retried)."""

# --- the last-checkpoint record and the pod annotations ---------------------------------
LAST_CHECKPOINT_KIND = "kubetrain.io/last-checkpoint"
"""`kind` of the one-line JSON record in the termination message (and the annotation below)."""
ANNOTATION_LAST_CHECKPOINT = "kubetrain.io/last-checkpoint"
ANNOTATION_CHECKPOINT_SYNC = "kubetrain.io/checkpoint-sync"
"""A short message while checkpoint uploads lag behind; removed once they caught up."""

# --- the failure record: why a pod exited 82, in its termination message ------------------
FAILURE_KIND = "kubetrain.io/failure"
"""`kind` of the one-line JSON record a pod writes instead of the last-checkpoint record when
checkpoint storage refused it at start (it committed nothing then, so nothing is lost)."""
FAILURE_STORAGE_ACCESS_DENIED = "StorageAccessDenied"
"""Storage refused access or has no such bucket (HTTP 401/403/404, STS refused the token, no
credentials at all) for all of KUBETRAIN_S3_AUTH_RETRY_SECONDS."""
FAILURE_STORAGE_REQUEST_INVALID = "StorageRequestInvalid"
"""Storage refused a request as invalid (InvalidBucketName, an STS parameter it does not accept...)."""
FAILURE_REASONS = (FAILURE_STORAGE_ACCESS_DENIED, FAILURE_STORAGE_REQUEST_INVALID)
"""Every `reason` a failure record may carry; the operator accepts no other."""
FAILURE_CODE_PATTERN = r"^[A-Za-z][A-Za-z0-9]{0,62}$"
"""`code`: the store's error code (AccessDenied, InvalidIdentityToken...), or HTTP<status>."""
TERMINATION_MESSAGE_LIMIT = 4096
"""The kubelet keeps at most this many bytes of a termination message."""

# --- the environment of every training container (the operator sets these) --------------
NNODES = "NNODES"
NODE_RANK = "NODE_RANK"
NPROC_PER_NODE = "NPROC_PER_NODE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
JOB_NAME = "KUBETRAIN_JOB_NAME"
NAMESPACE = "KUBETRAIN_NAMESPACE"
ATTEMPT = "KUBETRAIN_ATTEMPT"
JOB_INCARNATION = "KUBETRAIN_JOB_INCARNATION"
POD_NAME = "KUBETRAIN_POD_NAME"
CHECKPOINT_URI = "KUBETRAIN_CHECKPOINT_URI"
AWS_ENDPOINT_URL = "AWS_ENDPOINT_URL"
AWS_ACCESS_KEY_ID = "AWS_ACCESS_KEY_ID"
AWS_SECRET_ACCESS_KEY = "AWS_SECRET_ACCESS_KEY"
AWS_ROLE_ARN = "AWS_ROLE_ARN"
AWS_WEB_IDENTITY_TOKEN_FILE = "AWS_WEB_IDENTITY_TOKEN_FILE"
AWS_ROLE_SESSION_NAME = "AWS_ROLE_SESSION_NAME"
AWS_REGION = "AWS_REGION"
STRATEGY = "KUBETRAIN_STRATEGY"
FSDP_CONFIG = "KUBETRAIN_FSDP_CONFIG"
DEEPSPEED_CONFIG = "KUBETRAIN_DEEPSPEED_CONFIG"
BUILTIN_TASK = "KUBETRAIN_BUILTIN_TASK"
TRAINER_ARGS = "KUBETRAIN_TRAINER_ARGS"
TERMINATION_GRACE_SECONDS = "KUBETRAIN_TERMINATION_GRACE_SECONDS"
METRICS_PORT = "KUBETRAIN_METRICS_PORT"

POD_ENV = (
    NNODES, NODE_RANK, NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT, JOB_NAME, NAMESPACE, ATTEMPT, JOB_INCARNATION,
    POD_NAME, CHECKPOINT_URI, AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ROLE_ARN,
    AWS_WEB_IDENTITY_TOKEN_FILE, AWS_ROLE_SESSION_NAME, AWS_REGION, STRATEGY, FSDP_CONFIG, DEEPSPEED_CONFIG,
    BUILTIN_TASK, TRAINER_ARGS, TERMINATION_GRACE_SECONDS, METRICS_PORT,
)
"""Every variable of the contract's table "Environment of every training container", in its order."""

# --- set by the launcher for its workers ------------------------------------------------
LOCAL_CHECKPOINT_DIR = "KUBETRAIN_LOCAL_CHECKPOINT_DIR"
RESUME_FROM = "KUBETRAIN_RESUME_FROM"
"""The restored checkpoint folder the workers resume from (unset when there is none)."""
RESTORE_OUTCOME_FD = "KUBETRAIN_RESTORE_OUTCOME_FD"
"""Instead of RESUME_FROM, for a built-in trainer started while the launcher restores: the pipe it
reads the restore's outcome from before it trains (handoff.py)."""
SYNC_BY_LAUNCHER = "KUBETRAIN_SYNC_BY_LAUNCHER"
"""`1`: the launcher uploads, so an in-process `CheckpointSyncCallback` stays idle."""
PROGRESS_FILE = "KUBETRAIN_PROGRESS_FILE"
"""Where a worker writes its progress report for the launcher's /metrics and /progress (progress.py)."""
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
"""torch.distributed's variables (the launcher, torchrun and accelerate set them)."""

# --- read by the launcher only, never set by the operator ---------------------------------
LOG_LEVEL = "KUBETRAIN_LOG_LEVEL"
UPLOAD_TIMEOUT = "KUBETRAIN_UPLOAD_TIMEOUT_SECONDS"
RESTORE_TIMEOUT = "KUBETRAIN_RESTORE_TIMEOUT_SECONDS"
CHECKPOINT_SETTLE = "KUBETRAIN_CHECKPOINT_SETTLE_SECONDS"
CHECKPOINT_COMMIT = "KUBETRAIN_CHECKPOINT_COMMIT"
TERMINATION_LOG = "KUBETRAIN_TERMINATION_LOG"
S3_AUTH_RETRY = "KUBETRAIN_S3_AUTH_RETRY_SECONDS"
S3_SSE = "KUBETRAIN_S3_SSE"
"""Server-side encryption the store is asked for on every object written (x-amz-server-side-encryption):
for a bucket policy that refuses writes without it. Unset: the bucket's default encryption."""
S3_SSE_VALUES = ("AES256", "aws:kms", "aws:kms:dsse")
S3_SSE_KMS_KEY_ID = "KUBETRAIN_S3_SSE_KMS_KEY_ID"
"""The KMS key (id, ARN or alias) of `aws:kms`/`aws:kms:dsse`; unset: the account's S3 key (aws/s3)."""
S3_ADDRESSING_STYLE = "KUBETRAIN_S3_ADDRESSING_STYLE"
"""How requests name the bucket: `path` (<endpoint>/<bucket>/<key>), `virtual` (<bucket>.<endpoint host>/<key>) or
`auto` (botocore's choice: on AWS virtual where the bucket name allows it, else path); unset: path for a custom
endpoint, else auto."""
S3_ADDRESSING_STYLES = ("auto", "path", "virtual")

# --- test hooks (docs/contract.md, "Test hooks"): off unless set ---------------------------
TEST_HOLD_AT_STEP = "KUBETRAIN_TEST_HOLD_AT_STEP"
TEST_HF_HOLD = "KUBETRAIN_TEST_HF_HOLD"
TEST_HOLD_SECONDS = "KUBETRAIN_TEST_HOLD_SECONDS"
TEST_UPLOAD_RATE = "KUBETRAIN_TEST_UPLOAD_BYTES_PER_SECOND"
