"""The permissions ledger (`permissions.py`) on its own: which answers clear a refusal it reported."""

from __future__ import annotations

import logging

import pytest

from kubetrain.errors import OWNER_FINALIZERS, ForbiddenError, InvalidError
from kubetrain.permissions import Permissions


def _raise(ledger: Permissions, exc: Exception) -> None:
    with pytest.raises(type(exc)), ledger.watching("create pod", "ml"):
        raise exc


def test_an_invalid_pod_does_not_clear_a_refused_owner_finalizers_permission(caplog) -> None:
    """A 422 (another job's invalid pod template) comes from the object's validation, before the admission that
    checks the owner's finalizers: the ledger logged 'create pod in ml is allowed again (RBAC fixed)', which
    was false, and the ERROR again at the next refusal."""
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    ledger = Permissions()
    refused = f'pods "train-a1-n0" is forbidden: {OWNER_FINALIZERS}: , <nil>'
    _raise(ledger, ForbiddenError("create pod", status=403, api_message=refused))
    _raise(ledger, InvalidError("create pod", status=422, api_message="spec.containers[0].image: Required value"))
    _raise(ledger, ForbiddenError("create pod", status=403, api_message=refused))
    levels = [r.levelno for r in caplog.records if r.levelno >= logging.INFO]
    assert levels == [logging.ERROR], [r.getMessage() for r in caplog.records]
    with ledger.watching("create pod", "ml"):
        pass
    assert "allowed again" in caplog.records[-1].getMessage()


def test_an_invalid_object_still_clears_a_refusal_of_the_call_itself(caplog) -> None:
    """RBAC's own check comes before validation: a 422 shows the create itself is granted."""
    caplog.set_level(logging.INFO, logger="kubetrain")
    ledger = Permissions()
    rbac = ('pods is forbidden: User "system:serviceaccount:kt:op" cannot create resource "pods" in API group "" '
            'in the namespace "ml"')
    _raise(ledger, ForbiddenError("create pod", status=403, api_message=rbac))
    _raise(ledger, InvalidError("create pod", status=422, api_message="invalid"))
    assert "allowed again" in caplog.records[-1].getMessage()
    assert ledger.denied == {}
