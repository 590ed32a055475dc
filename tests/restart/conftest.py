"""The restart tests' shared rank launcher: its fork server is ended with the test process, and shown to end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from restart_helpers import close_fork_server


@pytest.fixture(scope="session", autouse=True)
def _restart_fork_server() -> Iterator[None]:
    yield
    lost, code = close_fork_server()
    # It served every rank it was asked for (a lost server's ranks would have started as plain processes, and
    # the tests would still pass), and it ends on its own when its socket closes.
    assert not lost, "the restart tests' fork server was lost"
    assert code in (None, 0), f"the restart tests' fork server ended with {code}"
