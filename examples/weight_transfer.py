#!/usr/bin/python3
"""Weight transfer, trainers -> inference replicas, as in RL post-training.

N trainer processes each own a shard of a model's weights (whole tensors, balanced by size); M
inference processes each hold the full model in one registered buffer. An update: every trainer
"trains" (changes its tensors), then pushes each of its tensors to every inference process with
one ``scatter`` (or one ``write`` with immediate per tensor and replica, ``--op write``), every write
carrying the update's number as immediate. An inference process learns that the update is complete
from one immediate count, then checks a CRC-32 per tensor against the trainers' own. Prints the time
of each whole update (from "go" to the last replica complete) and the aggregate GB/s, over all
updates and over those after the first (which writes the replicas' memory for the first time).

    PYTHONPATH=build/python /usr/bin/python3 examples/weight_transfer.py
    ... --trainers 4 --replicas 2 --hidden 2048 --layers 8 --provider shm

Exit status 0 when every tensor of every update verified on every replica.
"""
import argparse
import multiprocessing as mp
import os
import sys
import time
import zlib

import numpy as np

try:
    import ponte
except ImportError:  # run from the repository without PYTHONPATH
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build", "python"))
    import ponte

os.environ.setdefault("FI_TCP_IFACE", "lo")  # the demo stays on loopback
os.environ.setdefault("PONTE_CTRL_ADDR", "127.0.0.1")

ALIGN = 4096


def model_layout(hidden, layers, vocab):
    """[(name, shape)] of a small decoder's weights (float16), with byte offsets in the full model."""
    h = hidden
    shapes = [("embed", (vocab, h))]
    for i in range(layers):
        shapes += [("layer%d.attn.wqkv" % i, (h, 3 * h)), ("layer%d.attn.wo" % i, (h, h)),
                   ("layer%d.mlp.w1" % i, (h, 4 * h)), ("layer%d.mlp.w2" % i, (4 * h, h)),
                   ("layer%d.norm" % i, (h,))]
    out, off = [], 0
    for name, shape in shapes:
        nbytes = int(np.prod(shape)) * 2
        out.append({"name": name, "shape": shape, "nbytes": nbytes, "offset": off})
        off += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return out, off


def assign(tensors, trainers):
    """Tensors to trainers, largest first to the least loaded."""
    load = [0] * trainers
    owner = {}
    for t in sorted(tensors, key=lambda t: -t["nbytes"]):
        k = load.index(min(load))
        owner[t["name"]] = k
        load[k] += t["nbytes"]
    return owner


def replica(conn, args, total):
    eng = ponte.Engine(provider=args.provider)
    model = np.zeros(total, dtype=np.uint8)
    reg = eng.register(model)
    conn.send((eng.address(), reg.descriptor()))
    while True:
        msg = conn.recv()
        if msg[0] == "exit":
            break
        _, version, count, expected = msg  # expected: {name: (offset, nbytes, crc)}
        eng.expect_imm(version, count).wait(120)  # the whole update landed
        t_done = time.monotonic()
        bad = [n for n, (off, nb, crc) in expected.items() if zlib.crc32(model[off:off + nb]) != crc]
        conn.send((t_done, bad))
    reg.close()
    eng.close()


def trainer(conn, args, rank, mine):
    eng = ponte.Engine(provider=args.provider)
    # The shard: this trainer's tensors back to back (its own offsets).
    local, off = {}, 0
    for t in mine:
        local[t["name"]] = off
        off += (t["nbytes"] + ALIGN - 1) // ALIGN * ALIGN
    shard = np.zeros(max(off, ALIGN), dtype=np.uint8)
    rng = np.random.default_rng(rank)
    views = {t["name"]: shard[local[t["name"]]:local[t["name"]] + t["nbytes"]].view(np.float16).reshape(t["shape"])
             for t in mine}
    for v in views.values():
        v[...] = rng.standard_normal(v.shape, dtype=np.float32).astype(np.float16)
    reg = eng.register(shard)
    replicas = conn.recv()  # [(address, descriptor)]
    peers = [eng.connect(a) for a, _ in replicas]
    for p in peers:
        eng.imm(p, 0).wait(60)  # handshake done: imms_per_write knows each peer's NICs
    targets = [(p, local[t["name"]], t["nbytes"], replicas[m][1], t["offset"])
               for t in mine for m, p in enumerate(peers)]
    counts = [sum(eng.imms_per_write(p, t["nbytes"]) for t in mine) for p in peers]
    conn.send(counts)
    while True:
        msg = conn.recv()
        if msg[0] == "exit":
            break
        if msg[0] == "train":  # a step changes every weight; the new values' checksums go to the replicas
            step = msg[1]
            for v in views.values():
                v *= np.float16(0.5)
                v += np.float16(step)
            conn.send({t["name"]: (t["offset"], t["nbytes"], zlib.crc32(shard[local[t["name"]]:local[t["name"]] + t["nbytes"]]))
                       for t in mine})
        elif msg[0] == "push":
            version = msg[1]
            if args.op == "scatter":
                eng.scatter(reg, targets, imm=version).wait(120)
            else:
                ponte.wait_all([eng.write(p, reg, so, nb, remote, ro, imm=version) for p, so, nb, remote, ro in targets], 120)
            conn.send("pushed")
    reg.close()
    eng.close()



def recv_from(conn, proc, what, timeout_s=300):
    """The next message from a child process, or a clear exit if it died or went silent."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.2):
        if not proc.is_alive():
            sys.exit(f"{os.path.basename(sys.argv[0])}: the {what} process died (exit code {proc.exitcode})")
        if time.monotonic() > deadline:
            sys.exit(f"{os.path.basename(sys.argv[0])}: no word from the {what} process within {timeout_s} s")
    return conn.recv()

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--provider", default="tcp;ofi_rxm")
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=10, help="decoder layers (24 MiB each at hidden 1024)")
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--op", choices=["scatter", "write"], default="scatter")
    args = ap.parse_args()
    tensors, total = model_layout(args.hidden, args.layers, args.vocab)
    owner = assign(tensors, args.trainers)

    ctx = mp.get_context("spawn")
    reps, trs = [], []
    for _ in range(args.replicas):
        a, b = ctx.Pipe()
        p = ctx.Process(target=replica, args=(b, args, total), daemon=True)
        p.start()
        reps.append((a, p))
    for k in range(args.trainers):
        a, b = ctx.Pipe()
        mine = [t for t in tensors if owner[t["name"]] == k]
        p = ctx.Process(target=trainer, args=(b, args, k, mine), daemon=True)
        p.start()
        trs.append((a, p))
    descs = [recv_from(c, p, "replica") for c, p in reps]
    for c, _ in trs:
        c.send(descs)
    counts = [recv_from(c, p, "trainer") for c, p in trs]
    per_replica = [sum(cs[m] for cs in counts) for m in range(args.replicas)]

    model_bytes = sum(t["nbytes"] for t in tensors)
    print("weight_transfer: %s, %d tensors, %.1f MiB model, %d trainers -> %d replicas, %s + immediate counts"
          % (args.provider, len(tensors), model_bytes / 2**20, args.trainers, args.replicas, args.op))
    print("%-8s %12s %12s %10s" % ("update", "time[ms]", "GB/s", "verified"))
    failures = 0
    t_all = 0.0
    dts = []
    for version in range(1, args.updates + 1):
        for c, _ in trs:
            c.send(("train", version))
        expected = {}
        for c, p in trs:
            expected.update(recv_from(c, p, "trainer"))
        for m, (c, _) in enumerate(reps):
            c.send(("update", version, per_replica[m], expected))
        t_go = time.monotonic()
        for c, _ in trs:
            c.send(("push", version))
        for c, p in trs:
            recv_from(c, p, "trainer")
        results = [recv_from(c, p, "replica") for c, p in reps]
        dt = max(t for t, _ in results) - t_go
        t_all += dt
        dts.append(dt)
        bad = sum(len(b) for _, b in results)
        failures += bad
        print("%-8d %12.1f %12.3f %10s" % (version, dt * 1e3, model_bytes * args.replicas / dt / 1e9,
                                           "yes" if not bad else "NO (%d)" % bad))
        for m, (_, b) in enumerate(results):
            if b:
                print("  replica %d: checksum mismatch in %s" % (m, ", ".join(b[:8])))
    for c, p in reps + trs:
        c.send(("exit",))
    for c, p in reps + trs:
        p.join(60)
    print("weight_transfer: %d updates, %.1f ms per whole update on average, %.3f GB/s delivered"
          % (args.updates, t_all / args.updates * 1e3, model_bytes * args.replicas * args.updates / t_all / 1e9))
    if len(dts) > 1:
        # The first update is the first write into the replicas' memory (their handshakes are
        # done before it): here it took several times as long as the later ones, as first writes
        # into fresh pages do (examples/kv_cache_transfer.py). A long-running replica sees the
        # later kind.
        rest = sum(dts[1:])
        print("weight_transfer: after the first update, %.1f ms per whole update, %.3f GB/s delivered"
              % (rest / (len(dts) - 1) * 1e3, model_bytes * args.replicas * (len(dts) - 1) / rest / 1e9))
    if failures or any(p.exitcode != 0 for _, p in reps + trs):
        print("weight_transfer: VERIFY FAILED (%d tensor checksums wrong)" % failures)
        return 1
    print("weight_transfer: every tensor's checksum verified on every replica after every update")
    return 0


if __name__ == "__main__":
    sys.exit(main())
