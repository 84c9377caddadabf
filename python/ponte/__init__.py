"""ponte: one RDMA transport stack for LLM systems, from Python.

``ponte.Engine`` moves bytes between processes (write, read, paged_write, scatter, immediates),
with operations waited for outside the GIL. Import from the build tree with
``PYTHONPATH=build/python /usr/bin/python3``. See README.md ("Python").
"""
import atexit as _atexit

from ._ponte import *  # noqa: F401,F403
from ._ponte import Code, Engine, Error, Operation, Region, wait_all, _close_all

__all__ = ["Code", "Engine", "Error", "Operation", "Region", "wait_all"]

try:  # the collectives (MoE) binding, where the C++ collectives library was built
    from ._ponte import Communicator, EpBuffer, EpHandle  # noqa: F401

    __all__ += ["Communicator", "EpBuffer", "EpHandle"]
except ImportError:  # pragma: no cover - depends on the build
    pass

# Engines still open at exit are closed in order (their workers stopped) before the interpreter
# tears down.
_atexit.register(_close_all)
