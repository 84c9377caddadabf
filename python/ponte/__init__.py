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
    Communicator = None


def _communicator_from_torch(cls, group=None, **engine_kwargs):
    """A Communicator over an initialised torch.distributed process group (gloo works on CPU): its
    rank and size, and its all_gather_object as the bootstrap AllGather. Keywords as for Engine."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised (call init_process_group first)")
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the group")

    def allgather(data):
        out = [None] * world
        dist.all_gather_object(out, bytes(data), group=group)
        return out

    return cls(rank, world, allgather, **engine_kwargs)


if Communicator is not None:
    Communicator.from_torch = classmethod(_communicator_from_torch)

# Engines still open at exit are closed in order (their workers stopped) before the interpreter
# tears down.
_atexit.register(_close_all)
