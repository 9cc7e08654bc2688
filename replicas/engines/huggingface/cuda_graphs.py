"""LlamaForward replayed from CUDA graphs, one graph per bucket of a pass's shape.

Why: an eager step of an 8 B Llama issues about a thousand kernels (per layer the seven
linears, two norms, RoPE, the cache write, the attention), each taking the CPU some
microseconds to launch. At a few rows a GPU runs a kernel faster than the next is launched,
and a step takes the launches' time rather than the time of reading the weights. A CUDA
graph records a pass's kernels once; a replay launches them all at once.

A replay runs the recorded kernels on the recorded addresses and shapes, so:

- Shapes come in buckets (`Bucket.covering`): rows R up to the next of ROW_BUCKETS, new
  positions N up to the next power of two (at most MAX_POSITIONS: decode steps and verify
  windows), attended positions L up to the next power of two (at least MIN_ATTENDED, at most
  the slot length). A call outside every bucket (a prefill) runs eager.
- Padding: padded rows and positions write their keys to the scratch slot and attend its
  position 0 (or their own slot's), as the eager forward's holes and right padding do; padded
  keys are masked. Their outputs are dropped.
- Addresses: each bucket owns its input tensors (`_BucketInputs`), into which every call is
  copied before a replay. The eager forward attends a view of adjacent slots that starts at
  another slot each call; here the window is gathered by slot index (kv_storage.GatheredWindow),
  which copies it once a layer. The KV storage's tensors are captured too: when the storage
  is reallocated (it grows; ModelRunner allocates it whole up front when graphs are on) every
  graph is dropped and captured again.
- Capture is lazy: a bucket's first call runs eager on the bucket's inputs (its result is the
  call's, and it is the warm-up a capture needs: kernels chosen, storage allocated), then the
  bucket is captured; later calls replay.

Exactness: a replay runs the kernels of that bucket's eager pass, on the same inputs. What
padding adds changes the real positions' results only as the eager forward's own padding
does: masked keys add exact zeros in the bfloat16 attention (_batch_invariant_attention), and
row blocks (RowBlockLinear) give every linear one shape whatever the rows. A float32 pass over
a padded L may round differently from one over L, as eager passes of different L do.

Checked on a CPU by tests/test_cuda_graphs.py (bucketing, padding and the gathered window, with
a 'capture' that reruns the pass: no CUDA here); on a GPU by cluster/bench/gpu_check.py
(greedy exactness with graphs, and steps timed with and without them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from replicas.engines.huggingface.kv_cache import SCRATCH_SLOT
from replicas.engines.huggingface.kv_storage import BatchWindow, GatheredWindow, SlotStorage
from replicas.engines.huggingface.llama_forward import LlamaForward

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MAX_POSITIONS = 16        # a verify window of k + 1 positions, k up to 15
MIN_ATTENDED = 64


@dataclass(frozen=True)
class Bucket:
    rows: int
    positions: int
    attended: int

    @classmethod
    def covering(cls, rows: int, positions: int, attended: int, max_seq_len: int) -> Bucket | None:
        """The smallest bucket a pass of R rows, N new positions and L attended fits; None
        where none does (more rows or positions than the largest bucket)."""
        if rows > ROW_BUCKETS[-1] or positions > MAX_POSITIONS:
            return None
        return cls(next(b for b in ROW_BUCKETS if b >= rows), _power_of_two(positions),
                   min(max(_power_of_two(attended), MIN_ATTENDED), max_seq_len))


def _power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


# A capture turns a pass over a bucket's inputs into (its first output, a replay): the replay
# computes the pass again on whatever the inputs then hold and returns its output tensor.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[torch.Tensor, Callable[[], torch.Tensor]]]


class CudaGraphCapture:
    """Captures on the current CUDA device. Every graph draws on one memory pool: passes
    replay one at a time, so a graph's temporaries may lie where another's were, and a
    graph's output is valid until the next replay of any graph (ModelRunner reads it at once)."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()
        # One side stream for every warm-up: the caching allocator keeps freed blocks for the
        # stream that allocated them, so a new stream per bucket would strand each bucket's
        # activations in a cache of its own.
        self.side = torch.cuda.Stream()

    def __call__(self, run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
        # The warm-up (the call's own pass) on a side stream, as torch's capture expects:
        # lazily created handles and workspaces then exist before capture.
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            first = run()
        torch.cuda.current_stream().wait_stream(self.side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = run()

        def replay() -> torch.Tensor:
            graph.replay()
            return output
        return first, replay


def rerun_capture(run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """A capture for a CPU, where there is no CUDA: nothing recorded; each replay runs the pass
    again on the bucket's inputs, so buckets, padding and the gathered window run as on a GPU
    (the tests; gpu_check's run on a CPU)."""
    return run(), run


def capture_for(device: torch.device) -> Capture:
    return CudaGraphCapture() if device.type == "cuda" else rerun_capture


class _BucketInputs:
    """A bucket's input tensors, kept at one address; `fill` copies a call into them, the rest
    padding: pad ids, writes to the scratch slot, attention to key 0 only."""

    def __init__(self, bucket: Bucket, device: torch.device, pad_id: int):
        rows, width, attended = bucket.rows, bucket.positions, bucket.attended
        column = torch.arange(width, device=device).expand(rows, width)
        self.defaults = {
            "input_ids": torch.full((rows, width), pad_id, dtype=torch.long, device=device),
            "positions": column.clone(),
            "write_slot": torch.full((rows, width), SCRATCH_SLOT, dtype=torch.long, device=device),
            "write_position": column.clone(),
            "read_slots": torch.full((rows,), SCRATCH_SLOT, dtype=torch.long, device=device),
            "mask": torch.arange(attended, device=device).expand(rows, 1, width, attended) == 0,
        }
        self.tensors = {name: tensor.clone() for name, tensor in self.defaults.items()}
        self.attended = attended

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, window: BatchWindow) -> None:
        layout = window.layout
        rows, width = input_ids.shape
        for name, tensor in self.tensors.items():
            tensor.copy_(self.defaults[name])
        t = self.tensors
        for name, values in (("input_ids", input_ids), ("positions", positions), ("write_slot", layout.write_slot),
                             ("write_position", layout.write_position)):
            t[name][:rows, :width].copy_(values)
        t["read_slots"][:rows].copy_(torch.arange(layout.lo, layout.lo + rows, device=input_ids.device))
        t["mask"][:rows, :, :width, :layout.attended].copy_(mask)

    def window(self, storage: SlotStorage) -> GatheredWindow:
        t = self.tensors
        return GatheredWindow(storage, t["write_slot"], t["write_position"], t["read_slots"], self.attended)


class GraphedForward:
    """LlamaForward's interface (input ids [R, N], RoPE positions [R, N], mask [R, 1, N, L],
    window -> final hidden states [R, N, hidden]) replayed from one captured graph per bucket.
    The output is a view of a graph's output tensor: read it before the next call."""

    def __init__(self, forward: LlamaForward, storage: SlotStorage, pad_id: int, capture: Capture):
        self.forward, self.storage, self.pad_id, self.capture = forward, storage, pad_id, capture
        self.logits, self.row_block = forward.logits, forward.row_block    # ModelRunner reads these
        self.graphs: dict[Bucket, tuple[_BucketInputs, Callable[[], torch.Tensor]]] = {}
        self.generation = storage.generation      # the storage the graphs were captured over
        self.counts = {"captured": 0, "replayed": 0, "eager": 0, "dropped": 0}

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                 window: BatchWindow) -> torch.Tensor:
        rows, width = input_ids.shape
        bucket = Bucket.covering(rows, width, window.layout.attended, self.storage.max_seq_len)
        if bucket is None:
            self.counts["eager"] += 1
            return self.forward(input_ids, positions, mask, window)
        if self.storage.generation != self.generation:
            self.counts["dropped"] += len(self.graphs)
            self.graphs.clear()
        if bucket in self.graphs:
            inputs, replay = self.graphs[bucket]
            inputs.fill(input_ids, positions, mask, window)
            self.counts["replayed"] += 1
            return replay()[:rows, :width]
        inputs = _BucketInputs(bucket, input_ids.device, self.pad_id)
        inputs.fill(input_ids, positions, mask, window)
        output, replay = self.capture(lambda: self._pass(inputs))
        self.graphs[bucket] = (inputs, replay)
        self.generation = self.storage.generation     # the warm-up pass may have allocated the storage's layers
        self.counts["captured"] += 1
        return output[:rows, :width]

    def _pass(self, inputs: _BucketInputs) -> torch.Tensor:
        t = inputs.tensors
        return self.forward(t["input_ids"], t["positions"], t["mask"], inputs.window(self.storage))
