"""W rank processes for the collectives tests: spawned, bootstrapped through a hub AllGather (the
test process relays every rank's bytes), each running a scenario and reporting "ok" or what failed.

Every rank regenerates every rank's inputs from seeds, so each checks its own outputs against the
single-process computation of the same MoE step.
"""
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback

import numpy as np

SPAWN = mp.get_context("spawn")


# ---------------------------------------------------------------- reference MoE step

def to_bf16(f):
    """float32 -> bf16 bits (round to nearest even), as uint16."""
    u = np.ascontiguousarray(f, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(b):
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def inputs(rank, it, cfg):
    """x [T, H], topk_idx [T, K] (with -1 and duplicates), topk_weights [T, K] of one rank, one step."""
    rng = np.random.default_rng(7919 * it + rank)
    t = int(rng.integers(0, cfg["max_tokens"] + 1)) if it % 3 else cfg["max_tokens"]
    x = rng.standard_normal((t, cfg["hidden"]), dtype=np.float32)
    idx = rng.integers(-1, cfg["experts"], (t, cfg["topk"]), dtype=np.int64)
    if t:
        idx[0, :] = idx[0, 0]  # duplicates: the same expert twice
    w = rng.random((t, cfg["topk"]), dtype=np.float32)
    if cfg["dtype"] == "bfloat16":
        x = to_bf16(x)
    return x, idx, w


def unaligned(a):
    """The same values in a C-contiguous view at an odd byte offset (not aligned for its dtype)."""
    if a.size == 0:
        return a
    buf = np.zeros(a.nbytes + 1, dtype=np.uint8)
    buf[1:] = np.ascontiguousarray(a).view(np.uint8).ravel()
    return np.frombuffer(buf, dtype=a.dtype, offset=1).reshape(a.shape)


def expert_fn(rows, e, dtype):
    """What expert e computes on its rows (float32 or bf16 bits in and out)."""
    if dtype == "bfloat16":
        return to_bf16(from_bf16(rows) * np.float32(e + 1))
    return rows * np.float32(e + 1)


def check_dispatch(me, W, it, cfg, recv_x, recv_count, handle):
    L = cfg["experts"] // W
    src_info = np.asarray(handle.src_info)
    layout = np.asarray(handle.layout_range)
    recv_x, recv_count = np.asarray(recv_x), np.asarray(recv_count)
    all_in = [inputs(r, it, cfg) for r in range(W)]
    for l in range(L):
        e = me * L + l
        want = sorted((s, t) for s in range(W) for t in range(all_in[s][1].shape[0])
                      for k in range(cfg["topk"]) if all_in[s][1][t, k] == e)
        n = int(recv_count[l])
        got = sorted(map(tuple, src_info[l, :n].tolist()))
        if got != want:
            return "expert %d: received %s, expected %s" % (e, got[:6], want[:6])
        if (src_info[l, n:] != -1).any():
            return "expert %d: src_info past recv_count is not -1" % e
        for i in range(n):
            s, t = src_info[l, i]
            if not np.array_equal(recv_x[l, i], all_in[s][0][t]):
                return "expert %d row %d: not x[%d] of rank %d" % (e, i, t, s)
        for s in range(W):
            b, c = layout[l, s]
            if c != sum(1 for p in want if p[0] == s) or (c and (src_info[l, b:b + c, 0] != s).any()):
                return "expert %d: layout_range of rank %d is (%d, %d)" % (e, s, b, c)
    return None


def expected_out(me, it, cfg):
    x, idx, w = inputs(me, it, cfg)
    out = np.zeros((x.shape[0], cfg["hidden"]), dtype=np.float32)
    for t in range(x.shape[0]):
        for k in range(cfg["topk"]):
            e = idx[t, k]
            if e >= 0:
                y = expert_fn(x[t], e, cfg["dtype"])
                out[t] += w[t, k] * (from_bf16(y) if cfg["dtype"] == "bfloat16" else y)
    return out


def check_combine(me, it, cfg, out):
    want = expected_out(me, it, cfg)
    got = from_bf16(np.asarray(out)) if cfg["dtype"] == "bfloat16" else np.asarray(out)
    tol = dict(rtol=2e-2, atol=5e-2) if cfg["dtype"] == "bfloat16" else dict(rtol=1e-5, atol=1e-5)
    if got.shape != want.shape or not np.allclose(got, want, **tol):
        return "combine: out differs from the single-process result (max err %g)" % (
            float(np.max(np.abs(got - want))) if got.shape == want.shape else float("nan"))
    return None


def experts_compute(me, W, cfg, recv_x, recv_count):
    L = cfg["experts"] // W
    y = np.zeros_like(np.asarray(recv_x))
    for l in range(L):
        n = int(recv_count[l])
        y[l, :n] = expert_fn(np.asarray(recv_x)[l, :n], me * L + l, cfg["dtype"])
    return y


# ---------------------------------------------------------------- scenarios (run in a rank process)

def scenario_moe(ponte, comm, me, W, cfg):
    """Iterations of dispatch + combine (both forms), then the split phases with two live handles,
    all_to_all_v and barrier."""
    ep = ponte.EpBuffer(comm, cfg["experts"], cfg["hidden"], cfg["max_tokens"], cfg["topk"], dtype=cfg["dtype"])
    if ep.local_experts != cfg["experts"] // W or ep.recv_rows_per_expert != W * cfg["max_tokens"]:
        return "EpBuffer geometry"
    for it in range(4):
        x, idx, w = inputs(me, it, cfg)
        if it == 1:  # the other accepted types, which the binding converts
            idx, w = idx.astype(np.int32), w.astype(np.float64)
        elif it == 3:  # the caller's memory at an odd byte offset, which the binding copies
            idx, w = unaligned(idx), unaligned(w)
        if it < 2:
            recv_x, recv_count, h = ep.dispatch(x, idx)
        else:  # into the previous step's arrays
            rx, rc = recv_x, recv_count
            recv_x, recv_count, h = ep.dispatch(x, idx, recv_x=rx, recv_count=rc)
            if recv_x is not rx or recv_count is not rc:
                return "dispatch did not fill the given recv_x/recv_count"
        err = check_dispatch(me, W, it, cfg, recv_x, recv_count, h)
        if err:
            return "iteration %d: %s" % (it, err)
        y = experts_compute(me, W, cfg, recv_x, recv_count)
        if it % 2:
            out = ep.combine(y, w, h)
        else:  # accumulate into a prefilled out
            out = np.zeros((x.shape[0], cfg["hidden"]), dtype=x.dtype)
            ep.combine(y, w, h, out=out, accumulate=True)
        err = check_combine(me, it, cfg, out)
        if err:
            return "iteration %d: %s" % (it, err)
    # Split phases, two handles live at once (the two micro-batches of an overlapped step).
    hs = [ep.dispatch_send(inputs(me, it, cfg)[0], inputs(me, it, cfg)[1]) for it in (10, 11)]
    if ep.live_handles() != 2:
        return "live_handles: %d" % ep.live_handles()
    outs = []
    for it, h in zip((10, 11), hs):
        recv_x, recv_count = ep.dispatch_recv(h)
        err = check_dispatch(me, W, it, cfg, recv_x, recv_count, h)
        if err:
            return "split %d: %s" % (it, err)
        ep.combine_send(experts_compute(me, W, cfg, recv_x, recv_count), h)
    for it, h in zip((10, 11), hs):
        outs.append(ep.combine_recv(h, inputs(me, it, cfg)[2]))
        err = check_combine(me, it, cfg, outs[-1])
        if err:
            return "split %d: %s" % (it, err)
    if ep.live_handles() != 0 or hs[0].valid():
        return "handles not released after combine_recv"
    # all_to_all_v: (me + 1) * (r + 1) int32 elements to rank r, each naming (me, r, i).
    send = np.concatenate([me * 1000000 + r * 1000 + np.arange((me + 1) * (r + 1), dtype=np.int32)
                           for r in range(W)])
    rc = [(s + 1) * (me + 1) for s in range(W)]
    recv = np.zeros(sum(rc), dtype=np.int32)
    comm.all_to_all_v(send, [(me + 1) * (r + 1) for r in range(W)], recv, rc)
    want = np.concatenate([s * 1000000 + me * 1000 + np.arange(rc[s], dtype=np.int32) for s in range(W)])
    if not np.array_equal(recv, want):
        return "all_to_all_v: wrong bytes"
    comm.barrier()
    ep.close()
    return "ok"


def scenario_bad_input(ponte, comm, me, W, cfg):
    """Bad input raises before anything is sent and leaves the buffer usable."""
    ep = ponte.EpBuffer(comm, cfg["experts"], cfg["hidden"], cfg["max_tokens"], cfg["topk"])
    x, idx, w = inputs(me, 1, cfg)
    checks = [
        (lambda: ep.dispatch(x.astype(np.float64), idx), TypeError, "x"),
        (lambda: ep.dispatch(x[:, :-1].copy(), idx), ValueError, "x"),
        (lambda: ep.dispatch(x, idx[:, :1].copy()), ValueError, "topk_idx"),
        (lambda: ep.dispatch(x, np.full_like(idx, cfg["experts"])), ValueError, "dispatch"),
        (lambda: ep.dispatch(np.zeros((cfg["max_tokens"] + 1, cfg["hidden"]), np.float32),
                             np.zeros((cfg["max_tokens"] + 1, cfg["topk"]), np.int64)), ValueError, "dispatch"),
        (lambda: ep.combine(x, w, "not a handle"), TypeError, "handle"),
    ]
    for fn, exc, word in checks:
        try:
            fn()
            return "no %s for bad %s" % (exc.__name__, word)
        except exc as e:
            if word not in str(e):
                return "%s does not name %s: %s" % (exc.__name__, word, e)
    return scenario_moe(ponte, comm, me, W, cfg)


def scenario_dead(ponte, comm, me, W, cfg):
    """Rank W-1 dies (no goodbye) after the EpBuffer exists; the others' dispatch raises ponte.Error
    naming it, within the timeout."""
    ep = ponte.EpBuffer(comm, cfg["experts"], cfg["hidden"], cfg["max_tokens"], cfg["topk"])
    comm.barrier()
    if me == W - 1:
        os._exit(0)
    time.sleep(0.2)
    x, idx, w = inputs(me, 0, cfg)
    t0 = time.time()
    try:
        ep.dispatch(x, idx)
        return "dispatch succeeded with a dead rank"
    except ponte.Error as e:
        if e.code not in (ponte.Code.PEER_DEAD, ponte.Code.TIMEOUT):
            return "dead rank: code %s (%s)" % (e.code, e)
        if str(W - 1) not in str(e):
            return "dead rank not named: %s" % e
    if time.time() - t0 > cfg["timeout_ms"] / 1000 + 10:
        return "dead rank noticed after %.1f s" % (time.time() - t0)
    return "ok"


def scenario_interrupt(ponte, comm, me, W, cfg):
    """Ctrl-C while rank 0's dispatch waits for rank 1, which stays away (alive, not calling):
    KeyboardInterrupt comes within a few tenths of a second, not at the timeout; the communicator
    then refuses every call with ponte.Error(CANCELLED) at once, and closes cleanly."""
    ep = ponte.EpBuffer(comm, cfg["experts"], cfg["hidden"], cfg["max_tokens"], cfg["topk"])
    comm.barrier()
    if me != 0:
        time.sleep(3.0)  # past rank 0's interrupted call, well within its 30 s timeout
        return "ok"
    x, idx, w = inputs(me, 0, cfg)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.time()
    try:
        ep.dispatch(x, idx)
        return "dispatch ended without rank 1"
    except KeyboardInterrupt:
        took = time.time() - t0
    if took > cfg["timeout_ms"] / 1000 / 8:
        return "Ctrl-C noticed after %.1f s (timeout %.0f s)" % (took, cfg["timeout_ms"] / 1000)
    t0 = time.time()
    for call in (comm.barrier, lambda: ep.dispatch(x, idx)):
        try:
            call()
            return "a call after the interrupt succeeded"
        except ponte.Error as e:
            if e.code != ponte.Code.CANCELLED:
                return "after the interrupt: code %s (%s)" % (e.code, e)
    if time.time() - t0 > 1.0:
        return "the interrupted communicator still waited (%.1f s)" % (time.time() - t0)
    return "ok"


SCENARIOS = {"moe": scenario_moe, "bad_input": scenario_bad_input, "dead": scenario_dead,
             "interrupt": scenario_interrupt}


def rank_main(me, W, conn, scenario, cfg):
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    os.environ.setdefault("PONTE_CTRL_ADDR", "127.0.0.1")
    import ponte

    def allgather(data):
        conn.send(("ag", bytes(data)))
        return conn.recv()

    try:
        comm = ponte.Communicator(me, W, allgather, provider=cfg["provider"], timeout_ms=cfg["timeout_ms"])
        result = SCENARIOS[scenario](ponte, comm, me, W, cfg)
        comm.close()
    except Exception:
        result = traceback.format_exc()
    conn.send(("result", result))


def run_world(W, scenario, provider, timeout_s=150, **cfg):
    """Runs scenario on W spawned ranks; returns {rank: result} (ranks that died without one absent)."""
    cfg = dict(dict(provider=provider, experts=4 * W, hidden=48, max_tokens=24, topk=3, dtype="float32",
                    timeout_ms=3000), **cfg)
    pipes, procs = [], []
    for r in range(W):
        a, b = SPAWN.Pipe()
        p = SPAWN.Process(target=rank_main, args=(r, W, b, scenario, cfg), daemon=True)
        p.start()
        b.close()
        pipes.append(a)
        procs.append(p)
    results, gathered, gone = {}, {}, set()
    deadline = time.time() + timeout_s
    try:
        while True:
            pending = [r for r in range(W) if r not in results and r not in gone]
            if not pending:
                break
            if time.time() > deadline:
                raise TimeoutError("ranks did not finish within %d s: %s" % (timeout_s, results))
            for r in pending:
                c = pipes[r]
                if not c.poll(0.01):
                    continue
                try:
                    kind, payload = c.recv()
                except EOFError:  # the rank exited without a result
                    gone.add(r)
                    continue
                if kind == "ag":
                    gathered[r] = payload
                    if len(gathered) == W:
                        for k in range(W):
                            pipes[k].send([gathered[i] for i in range(W)])
                        gathered = {}
                else:
                    results[r] = payload
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return results
