"""Fixtures for the ponte Python tests: providers, a peer process per provider, the import path."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# Test traffic stays on loopback (scripts/test exports the same).
os.environ.setdefault("FI_TCP_IFACE", "lo")
os.environ.setdefault("PONTE_CTRL_ADDR", "127.0.0.1")

# The module from the build tree: PONTE_PY_BUILD (ctest sets it), else build/python.
_build = os.environ.get("PONTE_PY_BUILD", os.path.join(REPO, "build", "python"))
if _build not in sys.path:
    sys.path.insert(0, _build)
os.environ["PYTHONPATH"] = os.pathsep.join([_build] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

import ponte  # noqa: E402
from peers import PeerProcess  # noqa: E402

PROVIDERS = [pytest.param("tcp;ofi_rxm", id="tcp_rxm"), pytest.param("shm", id="shm")]
TIMEOUT_MS = 3000  # the engines' PONTE_TIMEOUT_MS in these tests: failures must show quickly


@pytest.fixture(scope="module", params=PROVIDERS)
def provider(request):
    return request.param


@pytest.fixture(scope="module")
def peer(provider):
    """A peer process (its own engine) for the module's tests on this provider."""
    p = PeerProcess(provider=provider, timeout_ms=TIMEOUT_MS)
    yield p
    p.close()


@pytest.fixture(scope="module")
def engine(provider):
    eng = ponte.Engine(provider=provider, timeout_ms=TIMEOUT_MS)
    yield eng
    eng.close()
