"""What the CRD leaves to the operator: resource quantities of names its rules do not read.

The CRD installs on Kubernetes 1.30 (tests/integration/api/test_crd_kubernetes_versions.py). On 1.30-1.33
a rule that runs a quantity function over every key of spec.resources.requests or .limits is over the API
server's CEL cost budget, so the CRD's rules read the quantities of named keys only (cpu, memory,
ephemeral-storage, hugepages-2Mi, hugepages-1Gi, nvidia.com/gpu, amd.com/gpu, google.com/tpu), and none
looks at two keys at once. A job with another name's bad quantity is stored; the operator's second look
(kubetrain.spec.Spec.from_storage, which checks every key) must then fail it as InvalidSpec naming the field,
instead of creating pods the pod API refuses on every attempt.
Each case goes through the real API server: stored as the CRD lets it, then read by the operator's parser.
"""

from __future__ import annotations

import pytest

from kubetrain.spec import Spec, SpecError
from test_trainingjob_validation import spec

pytestmark = pytest.mark.integration

# (id, spec.resources, field the operator names, words of its message)
LEFT = [
    ("fractional-other-extended-resource", {"limits": {"example.com/fpga": "500m"}},
     "resources.limits.example.com/fpga", "whole number"),
    ("other-extended-request-not-its-limit",
     {"requests": {"example.com/fpga": 1}, "limits": {"example.com/fpga": 2}},
     "resources.requests.example.com/fpga", "equal to the limit"),
    ("hugepages-request-not-its-limit",
     {"requests": {"hugepages-32Mi": "64Mi"}, "limits": {"hugepages-32Mi": "128Mi", "memory": "1Gi"}},
     "resources.requests.hugepages-32Mi", "equal to the limit"),
    ("hugepages-in-milli-bytes", {"limits": {"hugepages-32Mi": "64m", "memory": "1Gi"}},
     "resources.limits.hugepages-32Mi", "size in bytes"),
    ("hugepages-part-of-a-page", {"limits": {"hugepages-64Ki": "100Ki", "memory": "1Gi"}},
     "resources.limits.hugepages-64Ki", "whole number of 64Ki pages"),
    ("hugepages-size-not-a-size", {"limits": {"hugepages-huge": "2Mi", "memory": "1Gi"}},
     "resources.limits.hugepages-huge", "hugepages-<page size>"),
]


@pytest.mark.parametrize("resources, field, words", [c[1:] for c in LEFT], ids=[c[0] for c in LEFT])
def test_a_quantity_the_crd_does_not_read_is_an_invalid_spec_naming_the_field(submit, resources, field, words):
    stored = submit(spec(resources=resources))
    with pytest.raises(SpecError) as err:
        Spec.from_storage(stored["spec"])
    assert err.value.field_path == field, str(err.value)
    assert words in str(err.value), str(err.value)
