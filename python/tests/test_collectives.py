"""ponte.Communicator and ponte.EpBuffer from Python: MoE dispatch/combine with W = 2 and 4 rank
processes over tcp;ofi_rxm and shm, checked against the single-process computation; bad input;
a dead rank; torch tensors; torch.distributed bootstrap."""
import pytest

import ponte
from moe_ranks import run_world

pytestmark = pytest.mark.skipif(not hasattr(ponte, "EpBuffer"), reason="ponte built without collectives/")

PROVIDERS = [pytest.param("tcp;ofi_rxm", id="tcp_rxm"), pytest.param("shm", id="shm")]


def assert_all_ok(results, W):
    assert sorted(results) == list(range(W)), "ranks without a result: %s" % results
    for r, res in results.items():
        assert res == "ok", "rank %d: %s" % (r, res)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("W", [2, 4])
def test_moe_float32(W, provider):
    assert_all_ok(run_world(W, "moe", provider), W)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_moe_bfloat16_w2(provider):
    assert_all_ok(run_world(2, "moe", provider, dtype="bfloat16", hidden=64), 2)


def test_moe_bfloat16_w4_tcp():
    assert_all_ok(run_world(4, "moe", "tcp;ofi_rxm", dtype="bfloat16", hidden=64), 4)


def test_bad_input_leaves_the_buffer_usable():
    assert_all_ok(run_world(2, "bad_input", "tcp;ofi_rxm"), 2)


def test_dead_rank_fails_the_survivors_within_the_timeout():
    # tcp only: a process killed while it holds its shm region lock can wedge shm writers
    # (libfabric 1.17; see test_engine.py).
    results = run_world(3, "dead", "tcp;ofi_rxm")
    assert 2 not in results  # the victim exited without a result
    assert results.get(0) == "ok", results.get(0)
    assert results.get(1) == "ok", results.get(1)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_ctrl_c_ends_a_collective_wait_and_retires_the_communicator(provider):
    assert_all_ok(run_world(2, "interrupt", provider, timeout_ms=30000), 2)


def test_communicator_arguments():
    with pytest.raises(ValueError, match="rank"):
        ponte.Communicator(2, 2, lambda b: [b, b])
    with pytest.raises(TypeError, match="allgather"):
        ponte.Communicator(0, 1, "not callable")
    with pytest.raises(ValueError, match="allgather returned 2 entries for world 1"):
        ponte.Communicator(0, 1, lambda b: [b, b], provider="tcp;ofi_rxm")

    class Boom(Exception):
        pass

    def fails(b):
        raise Boom("from the allgather")

    with pytest.raises(Boom):  # the callable's own exception comes back
        ponte.Communicator(0, 1, fails, provider="tcp;ofi_rxm")
    # A world of one: everything stays local.
    with ponte.Communicator(0, 1, lambda b: [b], provider="tcp;ofi_rxm", timeout_ms=3000) as comm:
        comm.barrier()
        with pytest.raises(ValueError, match="num_experts"):
            ponte.EpBuffer(comm, 0, 8, 4, 1)
        with pytest.raises(ValueError, match="dtype"):
            ponte.EpBuffer(comm, 2, 8, 4, 1, dtype="float16")
        import numpy as np
        ep = ponte.EpBuffer(comm, 2, 8, 4, 2)
        x = np.arange(32, dtype=np.float32).reshape(4, 8)
        idx = np.array([[0, 1], [1, -1], [-1, -1], [0, 0]], np.int64)
        recv_x, recv_count, h = ep.dispatch(x, idx)
        assert recv_count.tolist() == [3, 2]
        out = ep.combine(recv_x, np.ones((4, 2), np.float32), h)
        np.testing.assert_allclose(out, x * np.array([2, 1, 0, 2], np.float32)[:, None])
        with pytest.raises(ValueError, match="src_info"):
            h.src_info  # released by combine
        recv_x, recv_count, h = ep.dispatch(x, idx)
        with pytest.raises(TypeError, match="handle must be a ponte.EpHandle, not str"):
            ep.combine(recv_x, np.ones((4, 2), np.float32), "a handle")
        other = ponte.EpBuffer(comm, 2, 8, 4, 2)
        with pytest.raises(ValueError, match="handle: it belongs to another EpBuffer"):
            other.combine(recv_x, np.ones((4, 2), np.float32), h)
        other.close()
        ep.combine(recv_x, np.ones((4, 2), np.float32), h)  # the handle still serves its own EpBuffer
        # Rows of more dimensions than the binding keeps inline (8): the same rows, the same result.
        x10 = x.reshape((1,) * 8 + (4, 8))
        recv_x, recv_count, h = ep.dispatch(x10, idx)
        assert recv_count.tolist() == [3, 2]
        out = ep.combine(recv_x, np.ones((4, 2), np.float32), h)
        np.testing.assert_allclose(out, x * np.array([2, 1, 0, 2], np.float32)[:, None])
        with pytest.raises(ValueError, match="hidden=8"):
            ep.dispatch(x.reshape((1,) * 9 + (32,)), idx)  # its last dimension is not hidden
        with pytest.raises(ValueError, match="topk_idx: shape"):  # all ten dimensions are seen, not the last two
            ep.dispatch(x, idx.reshape((1,) * 8 + (4, 2)))
        # numpy arrays the binding does not read directly: the buffer protocol's errors, or the same result.
        with pytest.raises(ValueError, match="x: .* not C-contiguous"):
            ep.dispatch(np.asfortranarray(x), idx)
        with pytest.raises(TypeError, match="x: dtype"):
            ep.dispatch(x.astype(">f4"), idx)  # big-endian
        frozen = np.zeros_like(recv_x)
        frozen.flags.writeable = False
        with pytest.raises(TypeError, match="recv_x is read-only"):
            ep.dispatch(x, idx, recv_x=frozen)

        class Sub(np.ndarray):
            pass

        recv_x, recv_count, h = ep.dispatch(x.view(Sub), idx.view(Sub))
        assert recv_count.tolist() == [3, 2]
        out = ep.combine(recv_x, np.ones((4, 2), np.float32).view(Sub), h)
        np.testing.assert_allclose(out, x * np.array([2, 1, 0, 2], np.float32)[:, None])
    assert comm.closed
    with pytest.raises(ponte.Error) as e:
        comm.barrier()
    assert e.value.code == ponte.Code.CANCELLED


def test_torch_tensors_in_an_epbuffer():
    torch = pytest.importorskip("torch")
    with ponte.Communicator(0, 1, lambda b: [b], provider="tcp;ofi_rxm", timeout_ms=3000) as comm:
        ep = ponte.EpBuffer(comm, 2, 8, 4, 2)
        x = torch.arange(32, dtype=torch.float32).reshape(4, 8)
        idx = torch.tensor([[0, 1], [1, -1], [-1, -1], [0, 0]])
        expect = x * torch.tensor([2.0, 1.0, 0.0, 2.0])[:, None]
        recv_x, recv_count, h = ep.dispatch(x, idx)
        assert isinstance(recv_x, torch.Tensor) and recv_count.tolist() == [3, 2]  # torch in, torch out
        out = ep.combine(recv_x, torch.ones(4, 2), h)
        assert isinstance(out, torch.Tensor) and torch.equal(out, expect)
        # A subclass (nn.Parameter, which requires grad) is read as a tensor; int32 indices and float64
        # weights are converted.
        recv_x, recv_count, h = ep.dispatch(torch.nn.Parameter(x.clone()), idx.int())
        assert recv_count.tolist() == [3, 2]
        assert torch.equal(ep.combine(recv_x, torch.ones(4, 2, dtype=torch.float64), h), expect)
        with pytest.raises(ValueError, match="x: a meta tensor; only CPU tensors"):
            ep.dispatch(torch.zeros(4, 8, device="meta"), idx)
        with pytest.raises(ValueError, match="x: the tensor is not contiguous"):
            ep.dispatch(torch.zeros(8, 4).t(), idx)
        with pytest.raises(ValueError, match="x: the tensor cannot be read as CPU memory"):
            ep.dispatch(torch.zeros(4, 8).to_sparse(), idx)
        with pytest.raises(ValueError, match="x: the tensor is a negated view"):
            ep.dispatch(torch._neg_view(x), idx)  # its memory holds x, its values are -x
        # A tensor written in the call that requires grad: refused while autograd records (torch refuses
        # such an out= tensor too), taken under torch.no_grad(); a tensor only read may require grad.
        recv_x, recv_count, h = ep.dispatch(x, idx)
        out = torch.zeros(4, 8, requires_grad=True)
        with pytest.raises(ValueError, match="out: the tensor requires grad and autograd is recording"):
            ep.combine(recv_x, torch.ones(4, 2), h, out=out)
        with pytest.raises(ValueError, match="recv_x: the tensor requires grad and autograd is recording"):
            ep.dispatch(x, idx, recv_x=recv_x.clone().requires_grad_())
        assert torch.count_nonzero(out) == 0  # nothing was written
        with torch.no_grad():
            ep.combine(recv_x, torch.ones(4, 2), h, out=out)
        assert torch.equal(out.detach(), expect)
        recv_x, recv_count, h = ep.dispatch(x, idx, recv_x=torch.zeros_like(recv_x, requires_grad=False))
        assert torch.equal(ep.combine(recv_x, torch.ones(4, 2, requires_grad=True), h), expect)
        # A tensor a call writes has its version counter bumped, as by torch's in-place ops: autograd
        # then refuses a backward pass through values the write replaced, instead of using them.
        s = torch.ones((), requires_grad=True)
        recv_x, recv_count, h = ep.dispatch(x, idx)
        y = (recv_x * s).sum()  # saves recv_x, for the gradient of s
        out = torch.zeros(4, 8)
        versions = (recv_x._version, recv_count._version, out._version)
        assert ep.combine(recv_x, torch.ones(4, 2), h, out=out) is out and out._version > versions[2]
        again, count_again, h = ep.dispatch(x, idx, recv_x=recv_x, recv_count=recv_count)
        assert again is recv_x and count_again is recv_count
        assert recv_x._version > versions[0] and recv_count._version > versions[1]
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()
        base = torch.zeros(2, 4, 8)  # a view keeps its base, and shares its counter
        view = base[1]
        before = base._version
        assert torch.equal(ep.combine(recv_x, torch.ones(4, 2), h, out=view), expect)
        assert view._base is base and base._version > before and torch.equal(base[1], expect)
        with torch.no_grad():  # a parameter updated in place, as an optimizer step does
            param = torch.nn.Parameter(torch.zeros(4, 8))
            before = param._version
            recv_x, recv_count, h = ep.dispatch(x, idx)
            ep.combine(recv_x, torch.ones(4, 2), h, out=param)
        assert param._version > before and param.requires_grad and torch.equal(param.detach(), expect)
        with torch.inference_mode():  # an inference tensor has no counter: written all the same
            frozen = torch.zeros(4, 8)
        recv_x, recv_count, h = ep.dispatch(x, idx)
        assert torch.equal(ep.combine(recv_x, torch.ones(4, 2), h, out=frozen), expect)
        # Each dtype named right, the first time (read from torch) and the second (remembered), and
        # the buffer still works after every refusal.
        for _ in range(2):
            for dt in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float64",
                       "complex64"):
                with pytest.raises(TypeError, match=f"x: dtype {dt}, but the EpBuffer is float32"):
                    ep.dispatch(torch.zeros(4, 8, dtype=getattr(torch, dt)), idx)
            recv_x, recv_count, h = ep.dispatch(x, idx)
            assert torch.equal(ep.combine(recv_x, torch.ones(4, 2), h), expect)
        # bfloat16 rows, and a 1-byte view of them refused as int8.
        ep16 = ponte.EpBuffer(comm, 2, 8, 4, 2, dtype="bfloat16")
        x16 = x.to(torch.bfloat16)
        recv_x, recv_count, h = ep16.dispatch(x16, idx)
        assert recv_x.dtype == torch.bfloat16 and recv_count.tolist() == [3, 2]
        assert torch.equal(ep16.combine(recv_x, torch.ones(4, 2), h), expect.to(torch.bfloat16))
        with pytest.raises(TypeError, match="x: dtype int8"):
            ep16.dispatch(x16.view(torch.int8), idx)
