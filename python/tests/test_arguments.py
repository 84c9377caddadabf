"""Bad arguments raise ValueError/TypeError naming the argument; nothing crashes the interpreter.
One engine connected to itself (no second process needed to refuse input)."""
import os
import time

import numpy as np
import pytest

import ponte


@pytest.fixture(scope="module")
def self_link():
    eng = ponte.Engine(provider="tcp;ofi_rxm", timeout_ms=3000)
    buf = np.zeros(1 << 16, dtype=np.uint8)
    reg = eng.register(buf)
    pid = eng.connect(eng.address())
    yield eng, reg, pid, reg.descriptor()
    reg.close()
    eng.close()


def test_region_arguments(self_link):
    eng, reg, pid, desc = self_link
    with pytest.raises(TypeError, match="region must be a ponte.Region"):
        eng.write(pid, np.zeros(8, np.uint8), 0, 8, desc, 0)  # an unregistered buffer
    with pytest.raises(ValueError, match="offset"):
        eng.write(pid, reg, 1 << 16, 1, desc, 0)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        eng.write(pid, reg, -1, 1, desc, 0)
    with pytest.raises(TypeError, match="nbytes must be an integer"):
        eng.write(pid, reg, 0, "8", desc, 0)
    with pytest.raises(ValueError, match="remote_offset"):
        eng.write(pid, reg, 0, 16, desc, (1 << 16) - 8)
    with pytest.raises(ValueError, match="imm"):
        eng.write(pid, reg, 0, 16, desc, 0, imm=1 << 32)
    with pytest.raises(ValueError, match="offset"):
        eng.read(pid, reg, 10, 1 << 16, desc, 0)


def test_bad_descriptor_bytes(self_link):
    eng, reg, pid, desc = self_link
    for bad in (b"", desc[:10], desc[:-1], b"\x00" * len(desc), bytes([desc[0] + 1]) + desc[1:], eng.address()):
        with pytest.raises(ValueError, match="remote"):
            eng.write(pid, reg, 0, 8, bad, 0)
    with pytest.raises(TypeError, match="remote must be bytes"):
        eng.write(pid, reg, 0, 8, "not bytes", 0)
    with pytest.raises(TypeError, match="remote must be bytes"):
        eng.write(pid, reg, 0, 8, None, 0)
    # bytearray and memoryview of good bytes work
    eng.write(pid, reg, 0, 8, bytearray(desc), 0).wait(10)
    eng.write(pid, reg, 0, 8, memoryview(desc), 0).wait(10)


def _landed(buf, off, want, timeout_s=10.0):
    """Whether buf[off:] shows want before the deadline (a plain write's completion at the sender
    does not say that its bytes have landed: poll for them)."""
    deadline = time.monotonic() + timeout_s
    while not np.array_equal(buf[off:off + len(want)], want):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_descriptors_switch_and_ended_operations_reused(self_link):
    """The binding keeps the descriptor it decoded last and the operations that ended: a write to
    another region's descriptor lands there, a bytearray changed in place is read again, and an
    operation that reuses an ended one's state waits for its own completion."""
    eng, reg, pid, desc = self_link
    bufs = [np.zeros(4096, dtype=np.uint8) for _ in range(2)]
    regs = [eng.register(b) for b in bufs]
    descs = [r.descriptor() for r in regs]
    src = np.frombuffer(bytes(range(256)) * 16, dtype=np.uint8).copy()
    reg_src = eng.register(src)
    try:
        for k in range(6):  # alternate the two descriptors, each write checked where it landed
            i = k % 2
            eng.write(pid, reg_src, k, 64, descs[i], 64 * k).wait(10)
            assert _landed(bufs[i], 64 * k, src[k:k + 64]), "write %d to region %d" % (k, i)
            assert not bufs[1 - i][64 * k:64 * k + 64].any(), "write %d also reached region %d" % (k, 1 - i)
        mutable = bytearray(descs[0])
        eng.write(pid, reg_src, 0, 16, mutable, 1024).wait(10)
        mutable[:] = descs[1]
        eng.write(pid, reg_src, 16, 16, mutable, 1024).wait(10)
        assert _landed(bufs[0], 1024, src[0:16])
        assert _landed(bufs[1], 1024, src[16:32])
        with pytest.raises(ValueError, match="remote"):
            eng.write(pid, reg_src, 0, 8, descs[0][:-1], 0)  # after a good descriptor: still refused
        for r in range(3):
            # An operation that failed, dropped: the next one takes its state, and is not done
            # before the immediate it counts is sent (none has been), then is.
            with pytest.raises(ponte.Error):
                eng.expect_imm(0x1234560 + r, 1, timeout_s=0.05).wait(10)
            op = eng.expect_imm(0x1234570 + r, 1, timeout_s=10)
            assert not op.done(), "round %d: a fresh operation reported done" % r
            eng.imm(pid, 0x1234570 + r).wait(10)
            op.wait(10)
            assert op.done()
    finally:
        reg_src.close()
        for x in regs:
            x.close()


def test_bad_addresses_and_peers(self_link):
    eng, reg, pid, desc = self_link
    addr = eng.address()
    for bad in (addr[:-1], desc, b"\x00" * 64, b""):
        with pytest.raises(ValueError, match="addr"):
            eng.connect(bad)
    with pytest.raises(ValueError, match="unknown peer"):
        eng.write(4000, reg, 0, 8, desc, 0)
    with pytest.raises(ValueError, match="peer"):
        eng.write(-1, reg, 0, 8, desc, 0)
    with pytest.raises(ValueError, match="count"):
        eng.expect_imm(1, 0)
    with pytest.raises(ValueError, match="timeout_s"):
        eng.expect_imm(1, 1, timeout_s=-1)


def test_paged_and_scatter_arguments(self_link):
    eng, reg, pid, desc = self_link
    with pytest.raises(ValueError, match="dst_pages"):
        eng.paged_write(pid, reg, [0, 1], desc, [0], 4096)
    with pytest.raises(ValueError, match="src_pages\\[1\\]"):
        eng.paged_write(pid, reg, [0, 16], desc, [0, 1], 4096)
    with pytest.raises(ValueError, match="dst_pages\\[0\\]"):
        eng.paged_write(pid, reg, [0], desc, [16], 4096)
    with pytest.raises(ValueError, match="src_pages\\[0\\]"):
        eng.paged_write(pid, reg, np.array([-1], np.int64), desc, [0], 4096)
    with pytest.raises(TypeError, match="src_pages"):
        eng.paged_write(pid, reg, np.array([0.5]), desc, [0], 4096)
    with pytest.raises(ValueError, match="page_size"):
        eng.paged_write(pid, reg, [0], desc, [0], 0)
    with pytest.raises(TypeError, match="targets\\[0\\]"):
        eng.scatter(reg, [pid])
    with pytest.raises(ValueError, match="targets\\[1\\]"):
        eng.scatter(reg, [(pid, 0, 8, desc, 0), (pid, 0, 8)])
    with pytest.raises(ValueError, match="targets\\[0\\].remote_offset"):
        eng.scatter(reg, [(pid, 0, 8, desc, 1 << 16)])


def test_register_arguments(self_link):
    eng, reg, pid, desc = self_link
    with pytest.raises(TypeError, match="read-only"):
        eng.register(b"immutable bytes")
    with pytest.raises(TypeError, match="buf must be"):
        eng.register("a string")
    with pytest.raises(TypeError, match="buf must be"):
        eng.register(12)
    with pytest.raises(ValueError, match="buf"):
        eng.register(np.zeros((8, 8))[:, 0])  # not contiguous
    with pytest.raises(ValueError, match="empty"):
        eng.register(bytearray())
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        ponte.Engine(colour="blue")
    with pytest.raises(ValueError, match="backend"):
        ponte.Engine(backend="carrier-pigeon")
    with pytest.raises(TypeError, match="idle_wake must be a bool"):
        ponte.Engine(idle_wake=1)
    with pytest.raises(TypeError, match="progress_cores must be a sequence"):
        ponte.Engine(progress_cores=2)
    with pytest.raises(TypeError, match="progress_cores must be a sequence"):
        ponte.Engine(progress_cores="2")
    with pytest.raises(ValueError, match=r"progress_cores\[i\] must be in \[0, 1023\]"):
        ponte.Engine(progress_cores=[0, -1])
    with pytest.raises(TypeError, match=r"progress_cores\[i\]"):
        ponte.Engine(progress_cores=[1.5])
    outside = max(os.sched_getaffinity(0)) + 1
    if outside < 1024:
        with pytest.raises(ValueError, match="may not run on core %d" % outside):
            ponte.Engine(progress_cores=[outside])


def test_region_keeps_its_object_alive_and_closes(self_link):
    eng, reg, pid, desc = self_link
    r = eng.register(bytearray(b"\x01" * 4096))  # nobody else holds the bytearray
    assert bytes(r.obj[:4]) == b"\x01" * 4
    eng.write(pid, r, 0, 4096, desc, 0).wait(10)
    r.close()
    assert r.closed and r.obj is None
    with pytest.raises(ValueError, match="closed"):
        eng.write(pid, r, 0, 8, desc, 0)
    r.close()  # twice: no-op


def test_operation_api(self_link):
    eng, reg, pid, desc = self_link
    op = eng.write(pid, reg, 0, 8, desc, 8)
    ponte.wait_all([op], timeout_s=10)
    assert op.done() and "done" in repr(op)
    with pytest.raises(TypeError):
        ponte.wait_all([op, 3])
    assert issubclass(ponte.Error, RuntimeError)


def test_vectorcall_write_and_operation_arguments(self_link):
    """Engine.write, Operation.wait and Operation.done are plain CPython methods (not pybind11's):
    their argument handling is the binding's own, so check it like pybind11's."""
    eng, reg, pid, desc = self_link
    # Keywords, in any order, and imm=None spelled out, all work.
    eng.write(peer=pid, region=reg, offset=0, nbytes=8, remote=desc, remote_offset=16).wait(timeout_s=10)
    eng.write(pid, reg, 0, 8, remote_offset=16, remote=desc, imm=None).wait(10)
    op = eng.write(pid, reg, 0, 8, desc, 16)
    assert op.wait() is None and op.wait(None) is None and op.done() is True
    with pytest.raises(TypeError, match="missing required argument 'remote_offset'"):
        eng.write(pid, reg, 0, 8, desc)
    with pytest.raises(TypeError, match="at most 7 arguments"):
        eng.write(pid, reg, 0, 8, desc, 0, None, 1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bytes'"):
        eng.write(pid, reg, 0, 8, desc, 0, bytes=3)
    with pytest.raises(TypeError, match="multiple values for argument 'offset'"):
        eng.write(pid, reg, 0, 8, desc, 0, offset=1)
    with pytest.raises(TypeError, match="peer must be an integer"):
        eng.write("x", reg, 0, 8, desc, 0)
    with pytest.raises(TypeError):  # the method checks its self, as any method does
        ponte.Engine.write(object(), pid, reg, 0, 8, desc, 0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'timeout'"):
        op.wait(timeout=1)
    with pytest.raises(TypeError, match="at most 1 argument"):
        op.wait(1, 2)
    with pytest.raises(ValueError, match="timeout_s"):
        op.wait(-1)
    with pytest.raises(TypeError, match="timeout_s"):
        op.wait(timeout_s="soon")
    with pytest.raises(TypeError, match="cannot create"):
        ponte.Operation()
    with pytest.raises(TypeError):
        op.done(1)
    # Dropping many Operations while their writes are in flight is safe (their state is parked).
    ops = [eng.write(pid, reg, 0, 8, desc, 16) for _ in range(200)]
    del ops
    eng.write(pid, reg, 0, 8, desc, 16).wait(10)
    assert "ponte.Operation write" in repr(eng.write(pid, reg, 0, 8, desc, 16))


def test_every_public_name_has_a_docstring_and_a_stub():
    import ast
    import os
    stub = os.path.join(os.path.dirname(ponte.__file__), "__init__.pyi")
    tree = ast.parse(open(stub).read())
    stubbed = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    stub_methods = {(c.name, f.name) for c in tree.body if isinstance(c, ast.ClassDef)
                    for f in c.body if isinstance(f, ast.FunctionDef)}
    assert ponte.__doc__
    for name in ponte.__all__:
        obj = getattr(ponte, name)
        assert obj.__doc__, name
        assert name in stubbed, "%s is missing from __init__.pyi" % name
        if name == "Code":
            members = {a.target.id for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "Code"
                       for a in c.body if isinstance(a, ast.AnnAssign)}
            assert set(ponte.Code.__members__) == members
        elif isinstance(obj, type) and name != "Error":
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                assert getattr(member, "__doc__", None), "%s.%s has no docstring" % (name, attr)
                assert (name, attr) in stub_methods, "%s.%s is missing from __init__.pyi" % (name, attr)
