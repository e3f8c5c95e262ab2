"""DDP's default all-reduce as a comm hook that the communication ledger counts.

The baseline must be measured the same way as the compressed schemes, so plain
DDP runs register this hook: it divides by the world size and all-reduces the
bucket through :func:`leantrain.runtime.collectives.all_reduce` (which records the
bytes), exactly what DDP's built-in all-reduce does.
"""

# no `from __future__ import annotations`: DDP checks the hook's annotations at registration
import torch
import torch.distributed as dist

from leantrain.runtime import collectives


def counted_allreduce_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    group = state if isinstance(state, dist.ProcessGroup) else None
    buf = bucket.buffer().div_(collectives.world_size(group))
    work = collectives.all_reduce(buf, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])
