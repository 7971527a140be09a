"""Timing the device's work without making the host wait for it.

Reading a clock around GPU work means synchronizing first, and every synchronization drains the
GPU's queue: the host's next work (packing the next row, uploading it, launching its first kernels)
then runs while the GPU idles. On CUDA, `DeviceClock` records events in the stream instead, and their
times are read once the step's work is queued; elsewhere the device is the host and a mark is the
host's clock.
"""

from __future__ import annotations

import time

import torch


class DeviceClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> torch.cuda.Event | float:
        """A point in the device's work, in the order it was queued."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event | float, end: torch.cuda.Event | float) -> float:
        """Device time between two marks; on CUDA, waits until the device has reached `end`."""
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3
