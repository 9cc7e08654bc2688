"""Integers a pass decides on the device, read to the host together.

On a GPU every read of a device value (`.tolist()`, `.item()`, `int(t)`, `bool(t)`) waits for
all the work queued before it and costs a transfer: a read per row, per step, is a stall per
row. A call's decisions (greedy argmaxes, sampled tokens, accepted counts, whether a
distribution was finite) are therefore gathered as device tensors and read in one transfer
per pass. On a CPU a read is cheap, and this changes nothing but the count.

Usage: `handle = reads.add(tensor)` for each value, then `values = reads.read()`, and
`values[handle]` is that tensor's entries as a list of ints (flattened).
"""

from __future__ import annotations

import torch


class DeviceReads:
    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []

    def add(self, values: torch.Tensor) -> int:
        """Integer or bool values on the device, to be read with the rest; returns their handle."""
        self._parts.append(values.reshape(-1).long())
        return len(self._parts) - 1

    def read(self) -> list[list[int]]:
        """Every added tensor's values, in one transfer."""
        if not self._parts:
            return []
        flat = torch.cat([part.to(self._parts[0].device) for part in self._parts]).tolist()
        out, start = [], 0
        for part in self._parts:
            out.append(flat[start:start + part.numel()])
            start += part.numel()
        return out
