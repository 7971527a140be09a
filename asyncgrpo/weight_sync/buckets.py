"""vLLM's packed weight-transfer format: tensors cut into byte buckets, one broadcast per bucket.

Both sides cut the stream from the same metadata (names, dtypes, shapes, in order) with the same
rule, so no sizes travel with the data: tensors join the current bucket until its size *exceeds*
`bucket_bytes`; the tensor that crosses the line closes it. A different rule on either side would
split the stream differently and hang or load garbage, so this is the one place it lives (and a
test checks it against vLLM's own consumer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# vLLM's default packed buffer (1 GiB) and buffer count; sent explicitly at init so both sides agree.
DEFAULT_BUCKET_BYTES = 1 << 30
DEFAULT_NUM_BUFFERS = 2


def tensor_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count * dtype.itemsize


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[range]:
    """Indices of the tensors in each bucket, for tensors of `sizes` bytes, in order."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets, start, filled = [], 0, 0
    for index, size in enumerate(sizes):
        filled += size
        if filled > bucket_bytes:
            buckets.append(range(start, index + 1))
            start, filled = index + 1, 0
    if start < len(sizes):
        buckets.append(range(start, len(sizes)))
    return buckets


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat uint8 tensor holding the tensors' bytes back to back (on their device)."""
    return torch.cat([tensor.contiguous().view(-1).view(torch.uint8) for tensor in tensors])
