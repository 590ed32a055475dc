"""The defaults the operator gives worker pods: locked down where the template says nothing, as written where
it says something."""

from __future__ import annotations

from typing import Any

import pytest

from stalwart.operator.pod_defaults import SHM_SIZE, SHM_VOLUME, with_defaults

BARE: dict[str, Any] = {"containers": [{"name": "trainer", "image": "t"}]}


def test_a_bare_template_is_locked_down_and_gets_a_memory_backed_shm() -> None:
    spec = with_defaults(BARE)
    assert spec["automountServiceAccountToken"] is False
    (container,) = spec["containers"]
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert container["volumeMounts"] == [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
    assert spec["volumes"] == [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}}]
    assert "securityContext" not in BARE["containers"][0]  # the template itself is not changed


@pytest.mark.parametrize(("template", "check"), [
    ({"automountServiceAccountToken": True, "containers": [{"name": "c"}]},
     lambda s: s["automountServiceAccountToken"] is True),
    ({"containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": True}}]},
     lambda s: s["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is True),
    ({"containers": [{"name": "c", "securityContext": {"capabilities": {"add": ["SYS_PTRACE"]}}}]},
     lambda s: s["containers"][0]["securityContext"]["capabilities"] == {"add": ["SYS_PTRACE"]}),
    ({"containers": [{"name": "c", "securityContext": {"privileged": True}}]},
     lambda s: s["containers"][0]["securityContext"] == {"privileged": True}),
    ({"containers": [{"name": "c", "volumeMounts": [{"name": "mine", "mountPath": "/dev/shm/"}]}],
      "volumes": [{"name": "mine", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}]},
     lambda s: [v["name"] for v in s["volumes"]] == ["mine"]
     and s["containers"][0]["volumeMounts"] == [{"name": "mine", "mountPath": "/dev/shm/"}]),
])
def test_what_the_template_says_is_kept(template: dict[str, Any], check: Any) -> None:
    assert check(with_defaults(template))
