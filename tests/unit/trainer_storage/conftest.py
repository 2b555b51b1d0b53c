"""Fixtures for the storage unit tests: `mem_s3`, an in-memory stand-in for the boto3 S3 client calls
`CheckpointStore` makes (objects in a dict, keyed by object key), so a real `CheckpointStore` runs
against it without MinIO. `mem_store(uri)` builds such a store."""

from __future__ import annotations

import io
import re
import threading

import pytest
from botocore.response import StreamingBody


def _s3_error(op: str, code: str = "NoSuchKey", status: int = 404, message: str = "not found"):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": message},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, op)


class _Paginator:
    def __init__(self, client: "MemS3", name: str) -> None:
        self.client, self.name = client, name

    def paginate(self, Bucket, Prefix=""):
        if self.name == "list_multipart_uploads":
            yield {"Uploads": []}
            return
        keys = sorted(k for k in self.client.objects if k.startswith(Prefix))
        if not keys:
            yield {}
        for i in range(0, len(keys), 1000):
            yield {"Contents": [{"Key": k, "Size": len(self.client.objects[k])} for k in keys[i:i + 1000]]}


class MemS3:
    """The S3 client calls `CheckpointStore` makes (boto3's argument names), on a dict of key -> bytes."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def get_paginator(self, name):
        return _Paginator(self, name)

    def get_object(self, Bucket, Key, Range=None):
        """As S3 answers: the whole object, or for `Range="bytes=a-b"` its bytes a to b (cut at its end) with
        `ContentRange` naming the object's size, or InvalidRange (416) when it ends before byte a."""
        if Key not in self.objects:
            raise _s3_error("GetObject")
        data = self.objects[Key]
        if Range is None:
            return {"Body": StreamingBody(io.BytesIO(data), len(data)), "ContentLength": len(data)}  # botocore's body
        first, last = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", Range).groups())
        if first >= len(data):
            raise _s3_error("GetObject", "InvalidRange", 416, "The requested range is not satisfiable")
        part = data[first:last + 1]
        return {"Body": StreamingBody(io.BytesIO(part), len(part)), "ContentLength": len(part),
                "ContentRange": f"bytes {first}-{first + len(part) - 1}/{len(data)}"}

    def put_object(self, Bucket, Key, Body, **kw):
        self.objects[Key] = bytes(Body)

    def delete_object(self, Bucket, Key):
        self.objects.pop(Key, None)

    def delete_objects(self, Bucket, Delete):
        for o in Delete["Objects"]:
            self.objects.pop(o["Key"], None)
        return {}

    def upload_file(self, Filename, Bucket, Key, Config=None, Callback=None):
        with open(Filename, "rb") as fh:
            data = fh.read()
        if Callback:
            Callback(len(data))
        self.objects[Key] = data

    def download_fileobj(self, Bucket, Key, Fileobj, Config=None, Callback=None):
        if Key not in self.objects:
            raise _s3_error("GetObject")
        Fileobj.seek(0)
        Fileobj.write(self.objects[Key])
        if Callback:
            Callback(len(self.objects[Key]))

    def head_bucket(self, Bucket):
        return {}


@pytest.fixture
def mem_s3() -> MemS3:
    return MemS3()


@pytest.fixture
def mem_store(mem_s3):
    """Factory: a real `CheckpointStore` at `uri` on the `mem_s3` client."""
    from kubetrain_trainer.storage import CheckpointStore, StorageConfig

    return lambda uri="s3://b/ns/job": CheckpointStore(StorageConfig(uri=uri), client=mem_s3)
