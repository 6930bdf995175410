"""Collectives between the learner's ranks: rank 0's bytes to all, sums and maxima of floats.

Everything travels as tensors on the engine's device (NCCL takes only CUDA tensors, gloo CPU
ones); nothing is pickled.
"""

from __future__ import annotations

import os

import torch

from common.transport import free_port


def init_distributed() -> tuple[int, int]:
    """Rank and world size; a single process outside a launcher gets the env DeepSpeed needs.

    On CPU, DeepSpeed's comm backend builds its shared-memory *inference* all-reduce, a C++ op
    JIT-compiled at the first start (40 s alone, minutes on a busy machine, once per install
    path) that training never calls (``inference_all_reduce`` only). Marked incompatible, it is
    not built: a fresh machine's first learner compiles nothing.
    """
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def broadcast_bytes(payload: bytes | None, rank: int, device: torch.device | None = None) -> bytes:
    """Rank 0's bytes to every rank, as a uint8 tensor (never pickled objects).

    ``device`` is the engine's: collectives run there (NCCL takes only CUDA tensors, gloo CPU ones).
    """
    import torch.distributed as dist

    size = torch.tensor([len(payload) if rank == 0 else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    buf = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        if rank == 0
        else torch.empty(int(size), dtype=torch.uint8, device=device)
    )
    dist.broadcast(buf, 0)
    return buf.cpu().numpy().tobytes()


def all_reduce(
    values: list[float], op: str = "sum", device: torch.device | None = None
) -> list[float]:
    """Sum (or max) of ``values`` over all ranks, as float64 on ``device`` (the engine's)."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def any_rank(flag: bool, device: torch.device | None = None) -> bool:
    """True on every rank if ``flag`` is true on any rank (an all-reduce max)."""
    return all_reduce([float(flag)], "max", device)[0] > 0
