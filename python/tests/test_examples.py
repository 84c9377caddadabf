"""The examples, run as written (small sizes): each must verify its data and exit 0."""
import os
import subprocess
import sys

import pytest

REPO = os.environ.get("PONTE_REPO", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
EXAMPLES = os.path.join(REPO, "examples")


def run(script, *args, timeout=120):
    p = subprocess.run([sys.executable, os.path.join(EXAMPLES, script)] + list(args), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=timeout)
    print(p.stdout)
    assert p.returncode == 0, p.stdout[-3000:]
    return p.stdout


@pytest.mark.parametrize("provider", ["tcp;ofi_rxm", "shm"])
def test_kv_cache_transfer(provider):
    out = run("kv_cache_transfer.py", "--provider", provider, "--layers", "4", "--blocks", "32", "--page-kib", "16",
              "--requests", "4")
    assert "all 128 pages verified" in out
    assert "plain write" in out


@pytest.mark.parametrize("op", ["scatter", "write"])
def test_weight_transfer(op):
    out = run("weight_transfer.py", "--op", op, "--trainers", "2", "--replicas", "2", "--hidden", "256",
              "--layers", "2", "--vocab", "1024", "--updates", "2")
    assert "every tensor's checksum verified on every replica after every update" in out
    assert out.count(" yes") == 2
    assert "after the first update" in out  # the steady-state line, beside the average over all


@pytest.mark.parametrize("provider,dtype,topk", [("tcp;ofi_rxm", "float32", "2"), ("shm", "bfloat16", "3")])
def test_moe_torch(provider, dtype, topk):
    pytest.importorskip("torch")
    out = run("moe_torch.py", "--world", "2", "--provider", provider, "--dtype", dtype, "--topk", topk,
              "--steps", "3", timeout=240)
    assert "every rank matches the single-process layer" in out
