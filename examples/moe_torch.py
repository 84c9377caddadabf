#!/usr/bin/python3
"""An MoE layer in PyTorch over ponte's EpBuffer, on W processes, checked against one process.

The layer: a gate (linear, softmax, top-k), E experts (a small MLP each), expert e on rank
e // (E / W). Each of the W ranks (torch.multiprocessing, torch.distributed with gloo on loopback
for the bootstrap: ``ponte.Communicator.from_torch()``) routes its own tokens: ``ep.dispatch`` sends
every token to its experts' ranks, each rank runs its local experts on what it received,
``ep.combine`` brings the results back weighted by the gate. Every rank then computes the same
layer on its tokens without ponte (all experts, one process) and compares.

    PYTHONPATH=build/python /usr/bin/python3 examples/moe_torch.py
    ... --world 4 --experts 16 --hidden 256 --tokens 128 --topk 4 --dtype bfloat16 --provider shm

Exit status 0 when every rank's output matches.
"""
import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

try:
    import ponte
except ImportError:  # run from the repository without PYTHONPATH
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build", "python"))
    import ponte


class MoE(torch.nn.Module):
    def __init__(self, hidden, ffn, experts, topk):
        super().__init__()
        self.topk = topk
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(hidden, ffn), torch.nn.GELU(), torch.nn.Linear(ffn, hidden))
            for _ in range(experts))

    def route(self, x):
        probs = torch.softmax(self.gate(x.float()), dim=-1)
        w, idx = torch.topk(probs, self.topk, dim=-1)
        return w / w.sum(dim=-1, keepdim=True), idx

    def forward_local(self, x):
        """The reference: every expert on this process, no communication."""
        w, idx = self.route(x)
        out = torch.zeros(x.shape, dtype=torch.float32)
        for e, expert in enumerate(self.experts):
            tok, k = torch.nonzero(idx == e, as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, w[tok, k, None] * expert(x[tok].float()))
        return out

    def forward_ep(self, x, ep, rank):
        """Expert parallel: dispatch to the experts' ranks, run the local experts, combine back."""
        w, idx = self.route(x)
        recv_x, recv_count, handle = ep.dispatch(x, idx)
        y = torch.zeros_like(recv_x)
        for l in range(ep.local_experts):
            n = int(recv_count[l])
            if n:
                y[l, :n] = self.experts[rank * ep.local_experts + l](recv_x[l, :n].float()).to(recv_x.dtype)
        return ep.combine(y, w, handle)


def rank_main(rank, args, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    os.environ.setdefault("PONTE_CTRL_ADDR", "127.0.0.1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    torch.manual_seed(0)  # the same parameters on every rank
    layer = MoE(args.hidden, 2 * args.hidden, args.experts, args.topk)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    comm = ponte.Communicator.from_torch(provider=args.provider)
    ep = ponte.EpBuffer(comm, args.experts, args.hidden, args.tokens, args.topk, dtype=args.dtype)
    worst, times = 0.0, []
    with torch.no_grad():
        for step in range(args.steps):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(args.tokens, args.hidden, generator=g).to(dtype)
            t0 = time.perf_counter()
            out = layer.forward_ep(x, ep, rank)
            times.append(time.perf_counter() - t0)
            ref = layer.forward_local(x)
            assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == x.shape
            err = (out.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
            worst = max(worst, err)
    results = [None] * args.world
    dist.all_gather_object(results, (worst, sorted(times)[len(times) // 2]))
    ep.close()
    comm.close()
    dist.destroy_process_group()
    if rank == 0:
        tol = 2e-2 if args.dtype == "bfloat16" else 1e-5
        print("moe_torch: W=%d over %s, E=%d experts (%d per rank), H=%d, %d tokens per rank, top-%d, %s, %d steps"
              % (args.world, args.provider, args.experts, args.experts // args.world, args.hidden, args.tokens,
                 args.topk, args.dtype, args.steps))
        for r, (e, t) in enumerate(results):
            print("  rank %d: max relative error vs one process %.2e, layer forward p50 %.2f ms" % (r, e, t * 1e3))
        if all(e <= tol for e, _ in results):
            print("moe_torch: every rank matches the single-process layer (tolerance %.0e)" % tol)
        else:
            print("moe_torch: MISMATCH against the single-process layer")
            sys.exit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per rank and step")
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--provider", default="tcp;ofi_rxm")
    args = ap.parse_args()
    with socket.socket() as s:  # a free port for torch.distributed's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp.spawn(rank_main, args=(args, port), nprocs=args.world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
