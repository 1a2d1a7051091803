"""learner.device under several ranks: ranks take the GPU of their LOCAL_RANK; an explicit cuda:N for several
ranks is a config error, at config load (launch.learner_ranks) and in each rank (WORLD_SIZE; exit 2 through
loraflow.learner.start.SetupError)."""

from __future__ import annotations

import pytest
import torch

from loraflow.common.config import ConfigError, load_config
from loraflow.learner.parallel import init_parallel, resolve_device


def test_explicit_gpu_for_several_ranks_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"learner.device = 'cuda:1' puts all 2 learner ranks on one GPU.*LOCAL_RANK"):
        resolve_device("cuda:1", local_rank=1, world_size=2)
    assert resolve_device("cpu", local_rank=1, world_size=2) == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device is visible"):
            resolve_device("cuda", local_rank=1, world_size=2)
        with pytest.raises(ValueError, match="no CUDA device is visible"):
            resolve_device("cuda:0", local_rank=0, world_size=1)  # one rank may name its GPU
    else:
        assert resolve_device("cuda", local_rank=0, world_size=2) == torch.device("cuda", 0)


def test_config_refuses_cuda_n_for_several_launched_ranks() -> None:
    with pytest.raises(ConfigError, match=r"learner.device = 'cuda:0' with launch.learner_ranks = 2"):
        load_config(None, ["launch.learner_ranks=2", 'learner.device="cuda:0"'])
    load_config(None, ["launch.learner_ranks=2", 'learner.device="cuda"'])
    load_config(None, ["launch.learner_ranks=1", 'learner.device="cuda:3"'])


def test_a_rank_of_a_two_rank_job_refuses_cuda_n_before_joining(monkeypatch: pytest.MonkeyPatch) -> None:
    """What each rank under torchrun sees (RANK / WORLD_SIZE / LOCAL_RANK): refused before any process group."""
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="puts all 2 learner ranks on one GPU"):
        init_parallel("cuda:0")
