"""The only module that talks to S3.

Everything above it (sync, launch) speaks in checkpoints and steps; this module
turns that into S3 objects under `KUBETRAIN_CHECKPOINT_URI`:

    <uri>/checkpoint-<step>/<files...>
    <uri>/checkpoint-<step>/manifest.node-<r>.json   (sharded multi-node only)
    <uri>/checkpoint-<step>/manifest.json            (written LAST: the commit)

Errors are `storage_errors`' types (temporary, permanent, refused access), with
messages that never carry credentials; when to retry is `retry.py`'s business.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

from kubetrain_trainer.decisions import MultipartUpload, RemoteCheckpoint
from kubetrain_trainer.hashing import DIGEST_PART, HashCancelled
from kubetrain_trainer.landing import fetch_whole, keep_verified, landing_file, link_or_copy, verified
from kubetrain_trainer.layout import (
    CLAIMS_FOLDER,
    MANIFEST_NAME,
    checkpoint_dirname,
    node_part_name,
    parse_checkpoint_dirname,
    parse_claim_name,
)
from kubetrain_trainer.manifest import XXH128, AttemptClaim, FileEntry, Manifest, ManifestError, NodePart
from kubetrain_trainer.storage_config import (UPLOAD_RATE_ENV, S3Location, StorageConfig, content_md5_instead_of_crc32,
                                              s3_compatible)
from kubetrain_trainer.ranged import fetch_ranges
from kubetrain_trainer.rank_files import NodeRanks, is_rank_files_record
from kubetrain_trainer.storage_errors import (
    PROGRAMMING_ERRORS, ChecksumError, DigestMismatchError, StorageError, StorageTemporaryError, TransferStopped, classify,
    error_code,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


class _Throttle:
    """Caps the bytes per second of all of a store's uploads together (every transfer thread reserves
    its chunk's time on one clock and sleeps until then: the read of the request body, and so the send,
    waits). Only the `KUBETRAIN_TEST_UPLOAD_BYTES_PER_SECOND` test hook creates one."""

    def __init__(self, rate: int, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate, self.clock, self.sleep = rate, clock, sleep
        self._lock = threading.Lock()
        self._free_at = 0.0

    def __call__(self, sent: int) -> None:
        with self._lock:
            now = self.clock()
            self._free_at = max(self._free_at, now) + sent / self.rate
            wait = self._free_at - now
        if wait > 0:
            self.sleep(wait)


class CheckpointStore:
    """Checkpoints of one job in one S3 location. Thread-safe for concurrent calls."""

    def __init__(self, config: StorageConfig, *, client: Any | None = None) -> None:
        self.config = config
        self.location = S3Location.parse(config.uri)
        self._made_client = client
        self._client_lock = threading.Lock()
        from boto3.s3.transfer import TransferConfig

        self._transfer = TransferConfig(
            multipart_threshold=config.multipart_threshold,
            multipart_chunksize=config.multipart_chunksize,
            max_concurrency=config.max_concurrency,
            use_threads=config.max_concurrency > 1,
        )
        self._throttle = _Throttle(config.test_upload_bytes_per_second) if config.test_upload_bytes_per_second \
            else None
        self._encryption = {k: v for k, v in (("ServerSideEncryption", config.server_side_encryption),
                                              ("SSEKMSKeyId", config.sse_kms_key_id)) if v}  # every object written
        self.bytes_sent = 0
        """Bytes its uploads have sent so far, counted as they go out (the uploader's rate estimate)."""
        if self._throttle is not None:
            log.warning("%s=%d: uploads are slowed down (a test hook; never set it in production)",
                        UPLOAD_RATE_ENV, config.test_upload_bytes_per_second)

    @property
    def _client(self) -> Any:
        """The S3 client, built on first use inside a call (`_call`): what building it raises (Pod Identity's
        agent not up yet, a missing profile) is a storage failure like any other, never a launcher crash."""
        with self._client_lock:
            if self._made_client is None:
                self._made_client = _make_client(self.config)
            return self._made_client

    # ------------------------------------------------------------ reading

    def checkpoint_uri(self, step: int) -> str:
        return f"s3://{self.location.bucket}/{self.location.key(checkpoint_dirname(step))}"

    def list_checkpoints(self) -> list[RemoteCheckpoint]:
        """Every `checkpoint-<step>/` folder with its listing and parsed manifest (None if torn)."""
        listings: dict[int, dict[str, int]] = {}
        base = self.location.key() + "/" if self.location.prefix else ""
        for obj in self._list(base):
            rest = obj["Key"][len(base) :]
            folder, _, rel = rest.partition("/")
            step = parse_checkpoint_dirname(folder)
            if step is None or not rel:
                continue
            listings.setdefault(step, {})[rel] = int(obj["Size"])
        out = []
        for step, listing in sorted(listings.items()):
            manifest = None
            if MANIFEST_NAME in listing:
                manifest = self.read_manifest(step)
            out.append(RemoteCheckpoint(step=step, manifest=manifest, listing=listing))
        return out

    def read_manifest(self, step: int) -> Manifest | None:
        """The parsed manifest of `step`, None when absent or invalid (an invalid one is a torn commit)."""
        data = self._get(self.location.key(checkpoint_dirname(step), MANIFEST_NAME))
        if data is None:
            return None
        try:
            return Manifest.from_json(data)
        except ManifestError as e:
            log.warning("checkpoint-%d: invalid manifest ignored: %s", step, e)
            return None

    def read_node_parts(self, step: int) -> list[NodePart]:
        folder = self.location.key(checkpoint_dirname(step))
        parts = []
        for obj in self._list(folder + "/"):
            name = obj["Key"][len(folder) + 1 :]
            if name.startswith("manifest.node-") and name.endswith(".json"):
                data = self._get(obj["Key"])
                if data is None:
                    continue
                try:
                    parts.append(NodePart.from_json(data))
                except ManifestError as e:
                    log.warning("checkpoint-%d: invalid node part %s ignored: %s", step, name, e)
        return parts

    def download_checkpoint(self, manifest: Manifest, dest: Path, *, node: NodeRanks | None = None,
                            cancelled: Callable[[], bool] = lambda: False) -> Path:
        """Download the files of a committed checkpoint into `dest/checkpoint-<step>`, each one verified.

        Files land in a sibling `.restoring` folder that is renamed into place
        only after every digest matched, so a crash never leaves a half
        restored folder under the final name. Files already present locally
        with the right digest (under the final name, or in the staging folder of
        a try that a storage error cut short) are not fetched again. With `node`, the files that
        only other nodes' ranks load stay in storage (`rank_files.py`): the
        strategy's records are fetched first and say which. Once `cancelled()` (SIGTERM), every
        transfer stops at its next chunk (`TransferStopped`), leaving only the staging folder.
        """
        final = dest / checkpoint_dirname(manifest.step)
        staging = dest / f".{checkpoint_dirname(manifest.step)}.restoring"
        dest.mkdir(parents=True, exist_ok=True)
        try:  # a try cut short (a storage error) leaves its whole files in staging: they stay
            staged = keep_verified(staging, manifest.files, cancelled=cancelled)
            for f in manifest.files:
                target = staging / f.path
                target.parent.mkdir(parents=True, exist_ok=True)
                existing = final / f.path
                if f.path not in staged and verified(existing, f, cancelled=cancelled):
                    link_or_copy(existing, target)
        except HashCancelled:
            raise TransferStopped(f"checkpoint-{manifest.step}: stopped (SIGTERM) checking local files") from None
        try:
            wanted = list(manifest.files)
            if node is not None and (records := [f for f in wanted if is_rank_files_record(f.path)]):
                self._fetch_all(manifest.step, [f for f in records if not (staging / f.path).exists()], staging,
                                cancelled)
                skip = node.not_needed(wanted, {f.path: (staging / f.path).read_bytes() for f in records})
                wanted = [f for f in wanted if f.path not in skip]
                if skip:
                    log.info("checkpoint-%d: %d of %d MiB are this node's (ranks %d-%d); the other ranks' "
                             "shards stay in storage", manifest.step, sum(f.size for f in wanted) >> 20,
                             manifest.total_bytes >> 20, node.ranks[0], node.ranks[-1])
            self._fetch_all(manifest.step, [f for f in wanted if not (staging / f.path).exists()], staging, cancelled)
        except ChecksumError:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        (staging / MANIFEST_NAME).write_bytes(manifest.to_json())
        if final.exists():
            shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        return final

    def _fetch_all(self, step: int, missing: list[FileEntry], staging: Path,
                   cancelled: Callable[[], bool] = lambda: False) -> None:
        """Fetch `missing` into `staging`, each file hashed as its bytes land, while others download."""
        # Only files at or above the multipart threshold are fetched in parts: they share the parts in flight.
        big = sum(1 for f in missing if f.size >= self.config.multipart_threshold)
        parts = max(self.config.max_concurrency,
                    self.config.download_parts_in_flight // max(1, min(self.config.file_concurrency, big)))

        def fetch(f: FileEntry) -> None:
            target = staging / f.path
            key = self.location.key(checkpoint_dirname(step), f.path)
            size, digest = self._call("download", key, lambda: self._download(key, target, step, parts, f.algorithm,
                                                                                   cancelled, f.size))
            if size != f.size or digest != f.digest:
                raise DigestMismatchError(f"checkpoint-{step}/{f.path}: downloaded bytes do not match the manifest")

        self._each(missing, fetch)

    def _download(self, key: str, target: Path, step: int, parts: int, algorithm: str,
                  cancelled: Callable[[], bool] = lambda: False, size: int | None = None) -> tuple[int, str]:
        """(bytes, `algorithm` digest) of the object `key` written to `target`: one plain GET below the multipart
        threshold (`landing.fetch_whole`), else up to `parts` ranged GETs in flight (`ranged.fetch_ranges` for
        an xxh128 record of known size, s3transfer for a sha256 one)."""
        from boto3.s3.transfer import TransferConfig

        bucket, check = self.location.bucket, lambda: _stop_if(cancelled, key)
        try:
            if size is not None and size < self.config.multipart_threshold:
                return fetch_whole(lambda: self._client.get_object(Bucket=bucket, Key=key)["Body"], target, algorithm,
                                   check)
            if size is not None and algorithm == XXH128 and self.config.download_chunksize % DIGEST_PART == 0:
                return fetch_ranges(lambda r: self._client.get_object(Bucket=bucket, Key=key, Range=r), target, size,
                                    range_size=self.config.download_chunksize, workers=parts, check=check)
            config = TransferConfig(multipart_threshold=self.config.multipart_threshold, use_threads=parts > 1,
                                    multipart_chunksize=self.config.download_chunksize, max_concurrency=parts)
            with open(target, "w+b") as fh:
                written = landing_file(fh, algorithm)
                try:
                    self._client.download_fileobj(bucket, key, written, Config=config, Callback=lambda _n: check())
                    return written.size, written.hexdigest()
                finally:
                    written.close()  # a sha256 one's thread reads `fh`: stopped before the file is closed
        except (DigestMismatchError, StorageTemporaryError) as e:  # `fetch_ranges`: another size, another range
            raise type(e)(f"checkpoint-{step}: s3://{bucket}/{key}: {e}") from None
        except Exception as e:  # a vanished object is data (this checkpoint is gone), not access
            if error_code(e) in ("NoSuchKey", "404", "NotFound"):
                raise ChecksumError(f"checkpoint-{step}: s3://{bucket}/{key} is gone") from None
            raise

    # ------------------------------------------------------------ writing

    def upload_file(self, step: int, local: Path, rel: str, *, folder: str | None = None,
                    still_allowed: Callable[[], None] | None = None) -> None:
        """Upload one file. `still_allowed` is called as bytes go out (it may skip calls, e.g. once a
        second) and raises to stop the transfer: a multipart upload is then aborted, a single PUT cut
        off before S3 stores it, so a fenced writer stops within one part, not one whole file."""
        key = self.location.key(folder or checkpoint_dirname(step), rel)
        throttle = self._throttle

        def progress(sent: int) -> None:
            self.bytes_sent += sent  # (from several threads: a rate's estimate, a lost increment is no harm)
            if throttle is not None:
                throttle(sent)
            if still_allowed is not None:
                still_allowed()

        extra: dict[str, Any] = {"Callback": progress} if still_allowed is not None or throttle is not None else {}
        if self._encryption:
            extra["ExtraArgs"] = self._encryption
        self._call("upload", key, lambda: self._client.upload_file(
            str(local), self.location.bucket, key, Config=self._transfer, **extra
        ))

    def put_bytes(self, step: int, rel: str, data: bytes, *, folder: str | None = None) -> None:
        key = self.location.key(folder or checkpoint_dirname(step), rel)
        self._call("put", key, lambda: self._client.put_object(
            Bucket=self.location.bucket, Key=key, Body=data, ContentType="application/json", **self._encryption
        ))

    def read_named_manifest(self, folder: str) -> Manifest | None:
        """The manifest of a non-checkpoint folder (e.g. `final`), None when absent or invalid."""
        data = self._get(self.location.key(folder, MANIFEST_NAME))
        try:
            return Manifest.from_json(data) if data is not None else None
        except ManifestError:
            return None

    def folder_uri(self, folder: str) -> str:
        return f"s3://{self.location.bucket}/{self.location.key(folder)}"

    def write_claim(self, claim: AttemptClaim) -> None:
        self.put_bytes(0, claim.name, claim.to_json(), folder=CLAIMS_FOLDER)

    def read_claim(self, incarnation: int, attempt: int) -> AttemptClaim | None:
        data = self._get(self.location.key(CLAIMS_FOLDER, AttemptClaim(incarnation, attempt).name))
        try:
            return AttemptClaim.from_json(data) if data is not None else None
        except ManifestError:
            return None

    def list_claims(self) -> list[tuple[int, int]]:
        """(incarnation, attempt) of every attempt that has started (from the object names alone)."""
        base = self.location.key(CLAIMS_FOLDER) + "/"
        return [w for obj in self._list(base) if (w := parse_claim_name(obj["Key"][len(base):])) is not None]

    def write_node_part(self, part: NodePart) -> None:
        self.put_bytes(part.step, node_part_name(part.node_rank), part.to_json())

    def commit(self, manifest: Manifest) -> None:
        """Write `manifest.json`: from now on the checkpoint exists for resume."""
        self.put_bytes(manifest.step, MANIFEST_NAME, manifest.to_json())

    def uncommit(self, step: int, *, folder: str | None = None) -> None:
        """Remove a manifest first, so a folder being rewritten is torn, never a mix of two commits."""
        key = self.location.key(folder or checkpoint_dirname(step), MANIFEST_NAME)
        self._call("delete", key, lambda: self._client.delete_object(Bucket=self.location.bucket, Key=key))

    def delete_checkpoint(self, step: int) -> None:
        """Delete a checkpoint folder, manifest FIRST (so it stops being complete before it loses files)."""
        self.uncommit(step)
        folder = self.location.key(checkpoint_dirname(step)) + "/"
        keys = [obj["Key"] for obj in self._list(folder)]
        for i in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
            self._call("delete", folder, lambda: self._client.delete_objects(Bucket=self.location.bucket, Delete=batch))

    def list_multipart_uploads(self) -> list[MultipartUpload]:
        """Incomplete multipart uploads under this job's prefix."""
        base = self.location.key() + "/" if self.location.prefix else ""

        def run() -> list[MultipartUpload]:
            # Filtered here, not with Prefix: MinIO lists in-progress uploads for a Prefix only when
            # it is a whole object key (measured against the testbed's MinIO), AWS for any prefix.
            out: list[MultipartUpload] = []
            paginator = self._client.get_paginator("list_multipart_uploads")
            for page in paginator.paginate(Bucket=self.location.bucket):
                for u in page.get("Uploads", []):
                    if u["Key"].startswith(base):
                        out.append(MultipartUpload(key=u["Key"], upload_id=u["UploadId"], initiated=u["Initiated"]))
            return out

        return self._call("list uploads", base, run)

    def abort_multipart_upload(self, upload: MultipartUpload) -> None:
        self._call("abort upload", upload.key, lambda: self._client.abort_multipart_upload(
            Bucket=self.location.bucket, Key=upload.key, UploadId=upload.upload_id))

    def upload_files(self, step: int, folder: Path, files: tuple[FileEntry, ...]) -> None:
        for f in files:
            self.upload_file(step, folder / f.path, f.path)

    def each_upload(self, items: Iterable[T], fn: Callable[[T], object]) -> None:
        """`fn(item)` for every item, up to `config.upload_file_concurrency` at once (as `_each`)."""
        self._each(items, fn, width=self.config.upload_file_concurrency)

    def _each(self, items: Iterable[T], fn: Callable[[T], object], *, width: int | None = None) -> None:
        """`fn(item)` for every item, up to `width` (default `config.file_concurrency`) at once. After a
        failure no new item starts; once the running ones end, the failure of the earliest item (in
        `items` order) is raised."""
        items = list(items)
        width = max(1, min(self.config.file_concurrency if width is None else width, len(items)))
        if width == 1:
            for item in items:
                fn(item)
            return
        with ThreadPoolExecutor(max_workers=width, thread_name_prefix="s3-files") as pool:
            futures: list[Future[object]] = [pool.submit(fn, item) for item in items]
            wait(futures, return_when=FIRST_EXCEPTION)
            for fut in futures:
                fut.cancel()  # not yet started: never starts
        for fut in futures:
            if not fut.cancelled() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]

    def check_access(self) -> None:
        """One cheap call that fails permanently on a missing bucket or bad credentials."""
        self._call("head_bucket", "", lambda: self._client.head_bucket(Bucket=self.location.bucket))

    # ------------------------------------------------------------ plumbing

    def _list(self, prefix: str) -> list[dict[str, Any]]:
        def run() -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = []
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.location.bucket, Prefix=prefix):
                out.extend(page.get("Contents", []))
            return out

        return self._call("list", prefix, run)

    def _get(self, key: str) -> bytes | None:
        def run() -> bytes | None:
            try:
                return self._client.get_object(Bucket=self.location.bucket, Key=key)["Body"].read()
            except Exception as e:  # NoSuchKey is data, not an error
                if error_code(e) in ("NoSuchKey", "404", "NotFound"):
                    return None
                raise

        return self._call("get", key, run)

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except (StorageError, TransferStopped, *PROGRAMMING_ERRORS):  # a bug is not a storage failure: never retried as one
            raise
        except Exception as e:  # noqa: BLE001 - classified below, never swallowed
            raise classify(e, op=op, where=f"s3://{self.location.bucket}/{key}") from None


def _stop_if(cancelled: Callable[[], bool], key: str) -> None:
    """A transfer's progress callback: stop it once `cancelled()` (s3transfer ends it with this error)."""
    if cancelled():
        raise TransferStopped(f"{key}: stopped (SIGTERM)")


def _make_client(config: StorageConfig) -> Any:
    """An S3 client on boto3's default credential chain: keys from the environment, or temporary
    credentials (web identity token exchanged through STS, container or instance credentials)
    that botocore refreshes by itself before they expire, also in the middle of a transfer."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import NoCredentialsError

    # Our own retry loop (with a deadline) sits above this; botocore's
    # standard mode covers the fast retries of a single request.
    boto_config = Config(
        connect_timeout=config.connect_timeout_s,
        read_timeout=config.read_timeout_s,
        retries={"max_attempts": 3, "mode": "standard"},
        # A restore has every file's parts in flight at once (`_download`'s share of them each).
        max_pool_connections=max(10, config.download_parts_in_flight,
                                 max(config.file_concurrency, config.upload_file_concurrency) * config.max_concurrency),
        # S3-compatible servers (MinIO) address buckets by path, not by host, unless told otherwise.
        s3={"addressing_style": config.addressing_style or ("path" if config.endpoint_url else "auto")},
        # None leaves botocore's own setting (StorageConfig: `when_required` for a custom endpoint).
        request_checksum_calculation=config.request_checksum_calculation,
        response_checksum_validation=config.response_checksum_validation,
    )
    session = boto3.session.Session()
    if session.get_credentials() is None:  # none found yet (IMDS slow or throttled): no client, the next call looks again
        raise NoCredentialsError()
    client = session.client("s3", endpoint_url=config.endpoint_url, region_name=config.region, config=boto_config)
    if s3_compatible(config.endpoint_url):  # DeleteObjects with Content-MD5, as before botocore 1.36
        client.meta.events.register("before-call.s3.DeleteObjects", content_md5_instead_of_crc32)
    return client
