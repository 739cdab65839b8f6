"""Our own collective calls use torch's current names: no FutureWarning (torch 2.13 prints one per rank and call site
for ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and DDP's ``broadcast_buffers``).

Each call runs in a one-rank gloo process group with FutureWarning raised as an error around it; the results are
checked too (a one-rank gather or reduce-scatter is the identity). The old names still warn on this torch, so the
test would see them if they came back."""

import warnings

import pytest
import torch
import torch.distributed as dist

from kforcing_kernels.app.training.parallel import data_parallel, setup_parallel
from kforcing_kernels.parallel import context_parallel

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)


@pytest.fixture
def one_rank():
    dims = setup_parallel("cpu", parallel="fsdp")  # a one-rank gloo process group
    try:
        yield dims
    finally:
        dims.close()


def test_collectives_and_ddp_emit_no_future_warning(one_rank):
    local = torch.arange(12.0).view(2, 3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        gathered = torch.empty_like(local)
        context_parallel._all_gather_single(gathered, local)
        summed = torch.empty(3, 2)
        context_parallel._reduce_scatter_single(summed, local[0].clone())
        model = data_parallel(torch.nn.Linear(3, 2), one_rank)
        model(torch.ones(1, 3)).sum().backward()
    assert torch.equal(gathered, local) and torch.equal(summed, local[0])
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel) and not model.forward_sync_buffers


@pytest.mark.skipif(not hasattr(dist, "all_gather_single"), reason="torch before 2.13 has only the old names")
def test_the_old_names_warn_on_this_torch(one_rank):
    """What the test above guards against: on this torch the names we left do warn."""
    local = torch.ones(2, 2)
    with pytest.warns(FutureWarning, match="all_gather_into_tensor"):
        dist.all_gather_into_tensor(torch.empty_like(local), local)
    with pytest.warns(FutureWarning, match="reduce_scatter_tensor"):
        dist.reduce_scatter_tensor(torch.empty_like(local), local)
    with pytest.warns(FutureWarning, match="broadcast_buffers"):
        torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2), broadcast_buffers=False)
