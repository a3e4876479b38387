"""Where torch's DataLoader and CachedLoader must serve the same: the cases torch's own tests found."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from loader import CachedLoader

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_uneven_distributed_sampler_without_a_cache_serves_no_duplicate(workers):
    # 9 samples on 4 replicas: the sampler pads each rank to 3 by wrapping around; drop_last drops the
    # padding in torch, which serves 8 distinct samples (each rank's first batch of 2).
    data = torch.arange(9)
    served = []
    for rank in range(4):
        sampler = DistributedSampler(data, num_replicas=4, rank=rank)
        with CachedLoader(data, batch_size=2, drop_last=True, sampler=sampler, nb_worker=workers,
                          device="cpu") as loader:
            for epoch in range(2):
                sampler.set_epoch(epoch)
                served.append([int(x) for batch in loader for x in batch])
    for epoch in range(2):
        every_rank = [x for part in served[epoch::2] for x in part]
        assert len(every_rank) == 8 and len(set(every_rank)) == 8, every_rank
