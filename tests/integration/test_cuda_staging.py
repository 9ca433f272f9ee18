"""CUDA tensors through a real cluster, over TCP and shm (needs a CUDA GPU; skipped elsewhere).

The pinned staging itself is tested CPU-only in tests/client/test_staging.py; this checks the
real streams, pinned memory and device copies end to end.
"""

from __future__ import annotations

import pytest
import torch

from kvstore.client import Client
from kvstore.errors import InvalidRequestError, KeyNotFoundError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda)"),
]

SIZES = [4 << 10, 1 << 20, 64 << 20]


def random_cuda(num_bytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, device="cuda", generator=g)


@pytest.mark.parametrize("node_args", [(), ("--shm",)], ids=["tcp", "shm"])
def test_cuda_tensors_round_trip(cluster_factory, node_args: tuple[str, ...]) -> None:
    cluster = cluster_factory(dram="512MiB", node_args=node_args)
    values = [random_cuda(n, i) for i, n in enumerate(SIZES)]
    halves = [v.view(torch.float16) for v in values]  # any dtype: its bytes are stored
    keys = [f"cuda/{n}" for n in SIZES]
    with Client.connect(cluster.address) as c:
        assert c.batch_put(keys, halves) == [None] * len(keys)
        outs = [torch.zeros_like(v) for v in values]
        assert c.batch_get_into(keys, outs) == SIZES
        for v, o in zip(values, outs, strict=True):
            assert torch.equal(v, o)
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            single = random_cuda(v.numel(), 100 + i)
            c.put(f"{k}/single", single)
            out = torch.empty_like(single)
            assert c.get_into(f"{k}/single", out) == single.numel() and torch.equal(out, single)
            assert c.get(f"{k}/single") == single.cpu().numpy().tobytes()
        # Per key errors stay per key; a failed read leaves its tensor untouched.
        untouched = torch.full((16,), 7, dtype=torch.uint8, device="cuda")
        got = c.batch_get_into([keys[0], "cuda/missing"], [outs[0], untouched])
        assert got[0] == SIZES[0] and isinstance(got[1], KeyNotFoundError)
        assert bool((untouched == 7).all())
        strided = random_cuda(4096, 9).view(64, 64)[:, 0]
        put = c.batch_put(["cuda/strided", "cuda/ok"], [strided, values[0]])
        assert isinstance(put[0], InvalidRequestError) and put[1] is None
        assert not c.exists("cuda/strided")
        # Work queued on the caller's stream is seen by a put (the staging waits for it).
        src = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
        src.add_(3)
        c.put("cuda/after-kernel", src)
        assert c.get("cuda/after-kernel") == bytes([3]) * (1 << 20)
