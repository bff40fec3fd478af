"""Which samples each rank reads: a pure function of the sample index.

A training run's data position is just the number of samples consumed so far.
Sample ``i`` has the same content whatever the number of processes, so a run
can be resumed on a different world size and still see exactly the same data.

Layout of one optimizer step (``global_batch`` samples starting at
``step_start_sample``), with ``per_rank = global_batch // world_size`` and
``grad_accum = per_rank // micro_batch``::

    rank 0: [micro 0][micro 1]...[micro grad_accum-1]  rank 1: [micro 0]...  ...
            |<------------------ per_rank ------------------>|

Rank ``r`` owns the contiguous block starting at ``start + r * per_rank`` and
micro-step ``k`` takes ``micro_batch`` consecutive samples of that block, so
the union over ranks and micro-steps is exactly ``[start, start + global_batch)``.
"""

from functools import lru_cache

import numpy as np


def grad_accum_steps(global_batch: int, world_size: int, micro_batch: int) -> int:
    """Micro-steps per optimizer step; the batch sizes must divide exactly."""
    if min(global_batch, world_size, micro_batch) < 1:
        raise ValueError(
            f"global_batch={global_batch}, world_size={world_size}, micro_batch={micro_batch}: must all be >= 1"
        )
    if global_batch % (world_size * micro_batch):
        raise ValueError(
            f"global_batch={global_batch} is not divisible by world_size*micro_batch="
            f"{world_size}*{micro_batch}={world_size * micro_batch}"
        )
    return global_batch // (world_size * micro_batch)


def rank_indices(
    step_start_sample: int, global_batch: int, world_size: int, rank: int, micro_batch: int, micro_step: int
) -> list[int]:
    """Global sample indices read by ``rank`` at ``micro_step`` of one optimizer step."""
    grad_accum = grad_accum_steps(global_batch, world_size, micro_batch)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}: must be in [0, {world_size})")
    if not 0 <= micro_step < grad_accum:
        raise ValueError(f"micro_step={micro_step}: must be in [0, {grad_accum})")
    start = step_start_sample + rank * (global_batch // world_size) + micro_step * micro_batch
    return list(range(start, start + micro_batch))


# Enough for the train and validation splits of every source of a mixture, across an epoch boundary.
@lru_cache(maxsize=32)
def window_permutation(num_windows: int, seed: int, epoch: int) -> np.ndarray:
    """A random order of ``num_windows`` windows, fixed by ``(seed, epoch)``.

    Built by sorting raw PCG64 output rather than with ``Generator.permutation``:
    numpy guarantees the bit generator's stream across versions, but not the
    algorithms of ``Generator`` methods. The result is cached and read-only.
    """
    keys = np.random.PCG64(np.random.SeedSequence([seed, epoch])).random_raw(num_windows)
    order = np.argsort(keys, kind="stable")
    order.setflags(write=False)
    return order
