"""The reconciler parses a stored TrainingJob once per stored version (`Reconciler._parsed`): a re-plan on a
pod event reuses it, and any new version (a spec edit, a status write, the job re-created under its name)
is parsed again, so no reconcile plans from an older spec than the one stored."""

from __future__ import annotations

import asyncio

from kubetrain.config import Settings
from kubetrain.reconciler import Reconciler


def job_body(*, nodes: int) -> dict:
    return {"metadata": {"name": "tj", "namespace": "ns", "generation": 1},
            "spec": {"image": "img:1", "nodes": nodes, "trainer": {"builtin": {"task": "regression"}}}}


def _version(body: dict, uid: str, rv: str) -> dict:
    body["metadata"].update(uid=uid, resourceVersion=rv)
    return body


def test_one_parse_per_stored_version_and_a_new_one_for_every_change():
    async def main() -> None:
        rec = Reconciler(api=None, settings=Settings())  # type: ignore[arg-type] - no API call here
        key = ("ns", "tj")
        first = rec._parsed(key, _version(job_body(nodes=2), "u1", "10"))
        assert rec._parsed(key, _version(job_body(nodes=2), "u1", "10")) is first  # the same version again
        edited = rec._parsed(key, _version(job_body(nodes=3), "u1", "11"))
        assert edited is not first and edited.spec.nodes == 3
        recreated = rec._parsed(key, _version(job_body(nodes=2), "u2", "11"))  # same name, same rv: a new uid
        assert recreated.uid == "u2" and recreated.spec.nodes == 2
        unversioned = _version(job_body(nodes=4), "u2", "")
        assert rec._parsed(key, unversioned) is not rec._parsed(key, unversioned)  # no version: never reused
        rec.forget(key)
        assert key not in rec._jobs_parsed

    asyncio.run(main())
