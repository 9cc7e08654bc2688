"""A float32 Llama decoder on a CPU core as one C call a step (fused_cpu.c).

Why: on this project's CPUs the eager lean forward (llama_forward.py) of the bundled target
spends 2.4-2.8 ms a one-token step, of which its linears are about 0.9 ms: the rest is some
1,500 small ATen calls (a torch profile). torch.compile's code measured no faster here (docs/BENCHMARKS.md).
fused_cpu.c runs a step as a few loops a layer and reads each weight once whatever the
number of tokens; its sums run in an order fixed by the model's shapes alone, so it is
batch-invariant (a verify gives bitwise the target alone's logits), which the eager float32
forward is not.

The library is built at replica start with the system's C compiler (`cc`, about a second),
for this CPU (-march=native), into a cache folder keyed by the source, the flags and the
CPU; where no compiler is found or the build fails, the eager forward runs, with a warning.
It computes the same function as transformers' modules but rounds differently (another
summation order): tests/test_fused_cpu.py compares it with them and checks greedy exactness.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import nn

from replicas.engines.huggingface.kv_cache import SCRATCH_SLOT
from replicas.engines.huggingface.kv_storage import BatchWindow
from replicas.engines.huggingface.llama_forward import LlamaForward

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("fused_cpu.c")
_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11"]
_LANES = 16     # the most floats a vector of fused_cpu.c holds (its LANES: 16 on AVX-512, 8 elsewhere)
assert SCRATCH_SLOT == 0, "fused_cpu.c skips the tokens written to slot 0, the scratch slot"


class _Model(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_int), ("H", ctypes.c_int), ("I", ctypes.c_int), ("NH", ctypes.c_int),
                ("KVH", ctypes.c_int), ("D", ctypes.c_int), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("max_len", ctypes.c_int64), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("weights", ctypes.POINTER(ctypes.c_void_p)), ("final_norm", ctypes.c_void_p)]


class FusedCpuForward:
    """LlamaForward's interface (input ids [R, N], RoPE positions [R, N], mask, window ->
    final hidden states [R, N, hidden]) computed by fused_cpu.c. Hidden states of padding and
    holes (positions written to the scratch slot) are zeros: nobody reads them."""

    def __init__(self, model: nn.Module, library: ctypes.CDLL, max_seq_len: int):
        if not self.supports(model):
            raise ValueError("the fused CPU forward runs a plain float32 Llama on a CPU only")
        self.library = library
        self.decoder = model.get_decoder()
        config = model.config
        attention = self.decoder.layers[0].self_attn
        self.kv_heads = config.num_key_value_heads
        self.head_dim = attention.head_dim
        self.max_seq_len = max_seq_len
        self._keep = []     # every buffer the C struct points into
        weights = []
        for layer in self.decoder.layers:
            attention, mlp = layer.self_attn, layer.mlp
            weights += [self._tensor(layer.input_layernorm.weight),
                        self._packed(attention.q_proj, attention.k_proj, attention.v_proj),
                        self._packed(attention.o_proj),
                        self._tensor(layer.post_attention_layernorm.weight),
                        self._packed(mlp.gate_proj, mlp.up_proj),
                        self._packed(mlp.down_proj)]
        self._weights = (ctypes.c_void_p * len(weights))(*weights)
        positions = torch.arange(max_seq_len)[None]
        cos, sin = self.decoder.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)   # [1, L, D]
        self.model = _Model(
            layers=len(self.decoder.layers), H=config.hidden_size, I=config.intermediate_size,
            NH=config.num_attention_heads, KVH=self.kv_heads, D=self.head_dim,
            eps=self.decoder.norm.variance_epsilon, scale=attention.scaling, max_len=max_seq_len,
            cos=self._tensor(cos[0]), sin=self._tensor(sin[0]), weights=self._weights,
            final_norm=self._tensor(self.decoder.norm.weight))
        output = model.get_output_embeddings()
        self.vocab_size = output.weight.shape[0]
        self._output = self._packed(output)
        self.work_per_token = ((config.num_attention_heads + 2 * self.kv_heads) * self.head_dim
                               + config.num_attention_heads * self.head_dim + 2 * config.intermediate_size
                               + 2 * config.hidden_size)

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """A plain Llama (LlamaForward's check) in float32 on a CPU, without linear biases or
        hooks (a tensor-parallel shard all-reduces in hooks), head_dim a multiple of 16, and
        RoPE whose angles depend on the position alone (a table; not the dynamic kinds)."""
        if not LlamaForward.supports(model):
            return False
        config = model.config
        head_dim = model.get_decoder().layers[0].self_attn.head_dim     # what the constructor reads
        linears = [m for m in model.get_decoder().modules() if isinstance(m, nn.Linear)]
        linears.append(model.get_output_embeddings())
        rope_type = getattr(model.get_decoder().rotary_emb, "rope_type", "default")
        return (model.dtype == torch.float32 and model.device.type == "cpu" and head_dim % _LANES == 0
                and "dynamic" not in rope_type and rope_type != "longrope"
                and config.num_attention_heads % config.num_key_value_heads == 0
                and all(isinstance(m, nn.Linear) and m.bias is None and not m._forward_hooks
                        and not m._forward_pre_hooks for m in linears))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                 window: BatchWindow) -> torch.Tensor:
        hidden = self.decoder.embed_tokens(input_ids).contiguous()                    # [R, N, H]
        layout = window.layout
        slot = layout.write_slot.reshape(-1).contiguous()
        position = layout.write_position.reshape(-1).contiguous()
        tokens = slot.numel()
        like = hidden.new_empty((1, self.kv_heads, 1, self.head_dim))
        caches = [window.storage.layer(index, like) for index in range(self.model.layers)]
        keys = (ctypes.c_void_p * len(caches))(*[k.data_ptr() for k, _ in caches])
        values = (ctypes.c_void_p * len(caches))(*[v.data_ptr() for _, v in caches])
        work = torch.empty(tokens * self.work_per_token + self.max_seq_len + _LANES, dtype=torch.float32)
        if self.library.llama_forward(ctypes.byref(self.model), tokens, hidden.data_ptr(), slot.data_ptr(),
                                      position.data_ptr(), keys, values, work.data_ptr()) != 0:
            raise MemoryError(f"the fused forward could not allocate its index of {tokens} tokens")
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer on final hidden states [P, H] -> [P, V], each row alone."""
        hidden = hidden.contiguous()
        logits = hidden.new_empty((hidden.shape[0], self.vocab_size))
        self.library.project(hidden.shape[0], hidden.shape[1], self.vocab_size, hidden.data_ptr(), self._output,
                             logits.data_ptr())
        return logits

    def _tensor(self, tensor: torch.Tensor) -> int:
        kept = tensor.detach().to(torch.float32).contiguous()
        self._keep.append(kept)
        return kept.data_ptr()

    def _packed(self, *linears: nn.Linear) -> int:
        """The linears' weights side by side ([K, N], N their outputs together), packed in
        panels of the library's panel width P (fused_cpu.c's PANEL: 64 columns on AVX-512, 16
        elsewhere), [N / P][K][P], the last zero-padded."""
        weight = torch.cat([linear.weight.detach() for linear in linears]).t()           # [K, N]
        inputs, outputs = weight.shape
        width = self.library.fused_panel_columns()
        panels = -(-outputs // width)
        padded = weight.new_zeros((inputs, panels * width))
        padded[:, :outputs] = weight
        return self._tensor(padded.reshape(inputs, panels, width).transpose(0, 1))


def load_library(cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """fused_cpu.c built for this CPU (cached), or None with a warning where it cannot be."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.warning("fused CPU forward: no C compiler (cc) found; the eager forward runs")
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(_FLAGS).encode() + _cpu_identity().encode()).hexdigest()[:16]
    folder = Path(cache_dir or Path(tempfile.gettempdir()) / f"specserve_fused_{os.getuid()}")
    target = folder / f"fused_cpu_{key}.so"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".{target.name}.{os.getpid()}"
        built = subprocess.run([compiler, *_FLAGS, "-o", str(partial), str(_SOURCE), "-lm"],
                               capture_output=True, text=True)
        if built.returncode != 0:
            logger.warning("fused CPU forward: building %s failed; the eager forward runs:\n%s",
                           _SOURCE.name, built.stderr[-2000:])
            return None
        partial.replace(target)           # atomic: replicas starting together share the file
    library = ctypes.CDLL(str(target))
    library.llama_forward.restype = ctypes.c_int
    library.llama_forward.argtypes = [ctypes.POINTER(_Model), ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                      ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    library.fused_panel_columns.restype = ctypes.c_int
    library.fused_panel_columns.argtypes = []
    library.project.restype = None
    library.project.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_void_p]
    return library


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() + platform.machine()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))
