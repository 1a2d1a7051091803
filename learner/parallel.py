"""Process group, device and device mesh of the learner, and the few collectives its loop uses.

Under ``torchrun`` (RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR set) every rank joins the job's process
group; without torchrun the learner is one process and forms a group of one over an in-memory store, so the
same FSDP2 and DCP code runs either way.

One default group, with a backend per device type: gloo for CPU tensors, NCCL for CUDA tensors
(``"cpu:gloo,cuda:nccl"`` on GPUs). FSDP2's all-gathers and reduce-scatters run on the device; the loop's own
messages (stop / batch-ready flags, the bytes of the batch rank 0 received) are small CPU tensors and go
through gloo whatever the device.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

#: how long a collective may wait for the slowest rank (a checkpoint save is the longest wait in the loop)
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


@dataclass(slots=True, kw_only=True)
class Parallel:
    """This process's place in the learner job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def agree(self, stop: bool, ready: bool) -> tuple[bool, bool]:
        """(any rank wants to stop, rank 0 has a batch): the loop's decision point, identical on every rank."""
        flags = torch.tensor([int(stop), int(ready and self.is_main)], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1])

    def broadcast_frames(self, frames: list[Any] | None) -> list[memoryview]:
        """The frames of a message rank 0 holds, on every rank (views into one received buffer)."""
        if self.is_main:
            assert frames is not None
            views = [memoryview(f).cast("B") for f in frames]
            sizes = torch.tensor([v.nbytes for v in views], dtype=torch.int64)
            count = torch.tensor([len(views)], dtype=torch.int64)
        else:
            count = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(count, src=0)
        if not self.is_main:
            sizes = torch.zeros(int(count), dtype=torch.int64)
        dist.broadcast(sizes, src=0)
        payload = torch.empty(int(sizes.sum()), dtype=torch.uint8)
        if self.is_main:
            buffer = payload.numpy()
            offset = 0
            for view in views:
                buffer[offset:offset + view.nbytes] = view
                offset += view.nbytes
        dist.broadcast(payload, src=0)
        whole = memoryview(payload.numpy())
        out, offset = [], 0
        for size in sizes.tolist():
            out.append(whole[offset:offset + size])
            offset += size
        return out

    def broadcast_int(self, value: int) -> int:
        """Rank 0's value of an int, on every rank."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(tensor, src=0)
        return int(tensor)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over ranks of a CPU tensor (in place; returned for chaining)."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def resolve_device(setting: str, local_rank: int, world_size: int = 1) -> torch.device:
    """learner.device: auto (CUDA if present), cpu, cuda or cuda:N. Under torchrun each rank takes the GPU of its
    LOCAL_RANK (``cuda`` / ``auto``); ``cuda:N`` names one GPU, so it is refused for several ranks (they would
    all land on it, which NCCL refuses)."""
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cpu":
        return torch.device("cpu")
    if setting.startswith("cuda"):
        explicit = setting.partition(":")[2]
        if explicit and world_size > 1:
            raise ValueError(f"learner.device = {setting!r} puts all {world_size} learner ranks on one GPU: use "
                             '"cuda" (or "auto"), and each rank takes the GPU of its LOCAL_RANK (restrict which GPUs '
                             "with CUDA_VISIBLE_DEVICES)")
        if not torch.cuda.is_available():
            raise ValueError(f"learner.device={setting!r} but no CUDA device is visible; use auto or cpu")
        index = int(explicit or local_rank)
        if index >= torch.cuda.device_count():
            raise ValueError(f"learner.device={setting!r}: GPU {index} (LOCAL_RANK {local_rank}) does not exist, "
                             f"{torch.cuda.device_count()} are visible; run at most that many ranks per machine")
        return torch.device("cuda", index)
    raise ValueError(f"learner.device must be auto, cpu, cuda or cuda:N, got {setting!r}")


def _gloo_on_loopback_for_one_host() -> None:
    """A job whose ranks are all on this machine (torchrun's LOCAL_WORLD_SIZE = WORLD_SIZE) connects them over
    the loopback device, unless GLOO_SOCKET_IFNAME names one: gloo would bind to what the hostname resolves to,
    an address the ranks may not reach from this machine (or none)."""
    if "GLOO_SOCKET_IFNAME" in os.environ or os.environ.get("LOCAL_WORLD_SIZE") != os.environ.get("WORLD_SIZE"):
        return
    with contextlib.suppress(OSError):
        loopback = [name for _, name in socket.if_nameindex() if name == "lo"]
        if loopback:
            os.environ["GLOO_SOCKET_IFNAME"] = loopback[0]


def init_parallel(device_setting: str) -> Parallel:
    """Join the torchrun job (or form a job of one) and build the 1-D device mesh FSDP2 shards over."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = resolve_device(device_setting, local_rank, world_size)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if launched:
            _gloo_on_loopback_for_one_host()
            dist.init_process_group(backend=backend, timeout=COLLECTIVE_TIMEOUT)
        else:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=COLLECTIVE_TIMEOUT)
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("fsdp",))
    return Parallel(rank=rank, world_size=world_size, local_rank=local_rank, device=device, mesh=mesh)
