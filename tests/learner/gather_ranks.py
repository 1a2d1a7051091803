"""Run under torchrun by tests/learner/test_gather.py: the one-collective LoRA gather against torch's own.

Every rank shards a module whose trainable parameters have row counts that do not divide by the rank count
(and one with fewer rows than ranks), then rank 0 checks that :func:`loraflow.learner.publish.gather_trainable` returns
exactly what ``get_model_state_dict(full_state_dict=True)`` does, names and values, and prints ``gather ok``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from loraflow.learner.publish import gather_trainable

SHAPES = {"lora_A": (3, 5), "lora_B": (7, 3), "tiny": (1, 4), "vector": (5,)}


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Module()
        for name, shape in SHAPES.items():
            generator = torch.Generator().manual_seed(len(name))
            self.inner.register_parameter(name, nn.Parameter(torch.randn(*shape, generator=generator)))
        self.frozen = nn.Parameter(torch.ones(6, 2), requires_grad=False)


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Toy()
    fully_shard(model.inner, mesh=mesh)
    fully_shard(model, mesh=mesh)
    is_main = dist.get_rank() == 0
    mine = gather_trainable(model, is_main=is_main)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    theirs = get_model_state_dict(model, options=options)
    if is_main:
        assert mine is not None and list(mine) == list(theirs), (list(mine), list(theirs))
        for name, tensor in theirs.items():
            assert mine[name].shape == tensor.shape and mine[name].device.type == "cpu", name
            assert torch.equal(mine[name], tensor), name
        assert sorted(mine) == sorted(f"inner.{n}" for n in SHAPES)
        print(f"gather ok on {dist.get_world_size()} ranks", flush=True)
    else:
        assert mine == {}
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    # every rank is past the barrier: leave without tearing gloo down, whose threads are sometimes still
    # joinable at interpreter exit ("terminate called without an active exception", 1 run in ~20 on 3 ranks)
    sys.stdout.flush()
    os._exit(0)
