"""A Llama decoder's forward pass, without transformers' per-call machinery.

Why: on the bundled models nearly all of a forward pass is Python, not arithmetic. Measured
here (2-core CPU, float32, one new token): the draft's decoder call (3 layers, hidden 128)
takes 1.45 ms, of which its linears take about 0.1 ms; the target's (7 layers, hidden 256)
5.0 ms. The rest is per-call work of the modules (keyword plumbing, decorators, mask and
output bookkeeping), and a speculative round pays it k times for drafts and once to verify.
On a GPU, CUDA graphs remove that cost; on a CPU only fewer Python steps do.

What runs is transformers' own Llama arithmetic, the same operations in the same order on the
same weights, so the hidden states are bitwise those of the modules (tests/test_llama_forward.py
compares them):

    h = embed(ids)
    per layer:  a = rms_norm(h) (in float32, then back to the dtype, times the weight)
                q, k, v = a Wq, a Wk, a Wv               viewed [R, heads, N, head_dim]
                q, k = q cos + rotate_half(q) sin, likewise k    (RoPE at each row's positions)
                K, V = the cache window after writing k, v       [R, kv_heads, L, head_dim]
                h = h + softmax(q K^T / sqrt(head_dim) | mask) V Wo
                h = h + (silu(m Wgate) * (m Wup)) Wdown,  m = rms_norm(h)
    final rms_norm(h)

A linear with forward hooks (the all-reduce of a tensor-parallel shard,
replicas/engines/huggingface/tensor_parallel.py) is called as a module so that its hook runs; the others as
plain functions.

Row blocks (`row_block`, a reduced-precision target on a GPU): every linear, norm and the
output layer run over a fixed number of rows at a time (RowBlockLinear), so that a GPU's
matrix library, which picks its kernel and its split of the sum by the matrix's shape, sums
every position the same way in any call; the attention below is invariant by construction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from replicas.engines.huggingface.kv_storage import BatchWindow


class LlamaForward:
    """Runs `model`'s decoder: input ids [R, N], RoPE positions [R, N] and a bool attention mask
    [R, 1, N, L] over the cache window -> final hidden states [R, N, hidden].

    compiled: each layer's arithmetic before and after its cache write runs as two
    torch.compile'd functions of tensors (inductor, dynamic shapes), shared by every layer,
    since the weights are arguments; the cache write and the window stay eager, in place in
    the preallocated slots. Not bitwise eager's: fused kernels round differently."""

    def __init__(self, model: nn.Module, compiled: bool = False, row_block: int | None = None):
        """row_block: rows per GEMM and norm (RowBlockLinear); eager only, and not with a
        tensor-parallel shard's hooked linears, whose all-reduce sums shards in an order of its own."""
        if not self.supports(model):
            raise ValueError(f"{type(model).__name__} is not a plain Llama decoder")
        self.decoder = model.get_decoder()
        if row_block and compiled:
            raise ValueError("row blocks are an eager forward's: compiled kernels fuse the rows as they like")
        self.layers = [_Layer(layer, compiled, row_block) for layer in self.decoder.layers]
        if compiled and any(layer.hooked for layer in self.layers):
            raise ValueError("a tensor-parallel shard's linears all-reduce in hooks: it runs eager")
        if row_block and any(layer.hooked for layer in self.layers):
            raise ValueError("row blocks do not apply to a tensor-parallel shard: its all-reduce is not blocked")
        self.steps = _compiled_steps() if compiled else (_inputs, None)
        self.row_block = row_block
        self.final_norm = _norm(self.decoder.norm, row_block)
        # ModelRunner takes the output layer from here where it is set (the fused forward's way)
        self.logits = RowBlockLinear(_linear(model.get_output_embeddings()), row_block) if row_block else None

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """Exactly Llama's layers with SDPA attention and SiLU: anything else (subclasses
        included) may compute differently and runs through its own modules."""
        config = model.config
        layers = getattr(model.get_decoder(), "layers", None)
        return (layers is not None and all(type(layer) is LlamaDecoderLayer for layer in layers)
                and config._attn_implementation == "sdpa" and config.hidden_act == "silu"
                and not getattr(config, "attention_dropout", 0.0))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                 window: BatchWindow) -> torch.Tensor:
        hidden = self.decoder.embed_tokens(input_ids)                              # [R, N, hidden]
        cos, sin = self.decoder.rotary_emb(hidden, positions)                      # [R, N, head_dim]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, mask, window, index, *self.steps)
        return _rms_norm(hidden, *self.final_norm)


class _Layer:
    def __init__(self, layer: LlamaDecoderLayer, compiled: bool, row_block: int | None = None):
        attention, mlp = layer.self_attn, layer.mlp
        self.input_norm = _norm(layer.input_layernorm, row_block)
        self.post_attention_norm = _norm(layer.post_attention_layernorm, row_block)
        # compiled: the weights as tensors, arguments of graphs every layer shares; eager:
        # callables, the module itself where a tensor-parallel shard all-reduces its output in a hook
        if compiled:
            linear = _weights
        elif row_block:
            def linear(module):
                inner = _linear(module)
                return inner if inner is module else RowBlockLinear(inner, row_block)
        else:
            linear = _linear
        self.q, self.k, self.v = linear(attention.q_proj), linear(attention.k_proj), linear(attention.v_proj)
        self.gate, self.up = linear(mlp.gate_proj), linear(mlp.up_proj)
        self.o, self.down = linear(attention.o_proj), linear(mlp.down_proj)
        self.hooked = attention.o_proj._forward_hooks or mlp.down_proj._forward_hooks
        self.head_dim, self.scaling, self.groups = attention.head_dim, attention.scaling, attention.num_key_value_groups

    def __call__(self, hidden, cos, sin, mask, window: BatchWindow, index: int, inputs, fused_rest) -> torch.Tensor:
        query, key, value = inputs(hidden, cos, sin, self.input_norm, self.q, self.k, self.v, self.head_dim)
        key, value = window.update(key, value, index)                              # [R, KVH, L, D]
        if fused_rest is not None:
            return fused_rest(hidden, query, key, value, mask, self.o, self.post_attention_norm, self.gate,
                              self.up, self.down, self.scaling, self.groups, self.head_dim)
        attended = _attention(query, key, value, mask, self.scaling, self.groups, self.head_dim)  # [R, N, H * D]
        hidden = hidden + self.o(attended)
        hidden, activation = _mlp_input(hidden, self.post_attention_norm, self.gate, self.up)
        return hidden + self.down(activation)


# Each a function of tensors (weights as (weight, bias) pairs, norms as (weight, eps)), so one
# compiled graph serves every layer.

def _inputs(hidden, cos, sin, norm, q, k, v, head_dim: int):
    """-> query [R, H, N, D], key and value [R, KVH, N, D], RoPE applied to query and key."""
    rows, width = hidden.shape[:2]
    shape = (rows, width, -1, head_dim)
    normed = _rms_norm(hidden, *norm)
    query = _project(normed, q).view(shape).transpose(1, 2)
    key = _project(normed, k).view(shape).transpose(1, 2)
    value = _project(normed, v).view(shape).transpose(1, 2)
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin, value


def _inputs_for_compiled(hidden, cos, sin, norm, q, k, v, head_dim: int):
    """_inputs with the query contiguous: one layout for any shape, so the compiled rest of the
    layer is not recompiled for each stride pattern of a transposed view (eager skips the copy)."""
    query, key, value = _inputs(hidden, cos, sin, norm, q, k, v, head_dim)
    return query.contiguous(), key, value


def _attention(query, key, value, mask, scaling: float, groups: int, head_dim: int) -> torch.Tensor:
    """transformers' SDPA path with an explicit mask: one query position folds its grouped
    heads into the query axis; more positions repeat the key/value heads. -> [R, N, H * D]
    In bfloat16, _batch_invariant_attention instead."""
    rows, width = query.shape[0], query.shape[2]
    if query.dtype == torch.bfloat16:
        output = _batch_invariant_attention(query, key, value, mask, scaling, groups)
        return output.transpose(1, 2).reshape(rows, width, -1).contiguous()
    if groups > 1 and width == 1:
        query = query.reshape(rows, query.shape[1] // groups, groups, head_dim)
    elif groups > 1:
        key, value = _repeat_heads(key, groups), _repeat_heads(value, groups)
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=0.0, scale=scaling)
    output = output.reshape(rows, -1, width, head_dim).transpose(1, 2).contiguous()
    return output.reshape(rows, width, -1).contiguous()


def _batch_invariant_attention(query, key, value, mask, scaling: float, groups: int) -> torch.Tensor:
    """softmax(q K^T * scaling | mask) V as two bfloat16 matmuls around a float32 softmax.
    [R, H, N, D] x [R, KVH, L, D] -> [R, H, N, D], H = KVH * groups

    Why not SDPA: in bfloat16 one ulp is 0.4 %, so a different summation order flips greedy
    tokens, and SDPA's blocked kernel sums a query position's keys in an order that depends on
    how many positions and keys the call has: a verify of k + 1 positions then disagrees with
    the single steps of the target alone (measured: 1-2 of 16 sequences differed within 128
    tokens). The matmuls here reduce each (row, position) over its own keys only, and masked
    keys add exact zeros, so its result is bitwise the same alone, in a verify, or beside other
    rows and longer windows; ModelRunner checks that on the machine it runs on.

    Memory: the query heads that share a key/value head are folded into the query axis (keys
    and values are not copied per head), and the float32 scores are made _QUERY_BLOCK folded
    rows at a time: [R, KVH, _QUERY_BLOCK, L] at most, where all at once a prefill of 16 x
    2,048 tokens of an 8 B model's 32 heads took 8.6 GB a layer. A row's result depends on its
    own query and the keys alone, so blocks change no bit of it."""
    rows, heads, width, dim = query.shape
    folded = query.reshape(rows, key.shape[1], groups * width, dim)        # head j * groups + g -> kv head j
    masks = mask.repeat(1, 1, groups, 1) if groups > 1 else mask           # [R, 1, groups * N, L]
    blocks = []
    for start in range(0, groups * width, _QUERY_BLOCK):
        block = folded[:, :, start:start + _QUERY_BLOCK]
        scores = torch.matmul(block, key.transpose(-1, -2)).float() * scaling              # [R, KVH, B, L]
        scores = scores.masked_fill_(~masks[:, :, start:start + _QUERY_BLOCK], float("-inf"))
        blocks.append(_weighted_values(torch.softmax(scores, dim=-1).to(query.dtype), value))
    output = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)
    return output.reshape(rows, heads, width, dim)


_QUERY_BLOCK = 64
_KEY_CHUNK = 64


def _weighted_values(weights: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """weights @ value, [R, H, N, L] x [R, H, L, D] -> [R, H, N, D], summed over the keys in
    chunks of _KEY_CHUNK: the whole chunks in one bfloat16 matmul side by side (views, no
    copy), the last partial one zero-padded to a whole one, and the chunks' partial sums
    added in float32 in key order.

    Why: a bfloat16 matmul's sum over L is blocked by oneDNN in an order that depends on L and
    on N; measured on this CPU, a 128-position prefill's outputs changed with two more masked
    keys (L 130), and 1 of 16 held-out sequences then differed from the target alone. With the
    contraction always _KEY_CHUNK long, every chunk is summed the same way in any call, and
    masked keys (zero weights, zero padding) only add exact zeros after the real ones."""
    whole, rest = divmod(weights.shape[-1], _KEY_CHUNK)
    end = whole * _KEY_CHUNK
    total = None
    if whole:
        partial = torch.matmul(weights[..., :end].unflatten(-1, (whole, _KEY_CHUNK)).transpose(2, 3),
                               value[:, :, :end].unflatten(2, (whole, _KEY_CHUNK)))      # [R, H, C, N, D]
        total = partial.float().sum(2)
    if rest:
        last = torch.matmul(F.pad(weights[..., end:], (0, _KEY_CHUNK - rest)),
                            F.pad(value[:, :, end:], (0, 0, 0, _KEY_CHUNK - rest))).float()
        total = last if total is None else total + last
    return total.to(weights.dtype)


def _mlp_input(hidden, norm, gate, up):
    """-> (hidden, silu(m Wgate) * (m Wup)) with m = rms_norm(hidden)."""
    normed = _rms_norm(hidden, *norm)
    return hidden, F.silu(_project(normed, gate)) * _project(normed, up)


def _fused_rest(hidden, query, key, value, mask, o, norm, gate, up, down, scaling: float, groups: int,
                head_dim: int) -> torch.Tensor:
    """The layer after its cache write, without hooks: attention, Wo, residual, the MLP."""
    hidden = hidden + _project(_attention(query, key, value, mask, scaling, groups, head_dim), o)
    hidden, activation = _mlp_input(hidden, norm, gate, up)
    return hidden + _project(activation, down)


def _compiled_steps():
    """(inputs, fused_rest) compiled once per process: every LlamaForward shares them, and
    inductor's caches (in memory, and on disk across restarts) hold each shape class's code."""
    if not _COMPILED:
        # Beyond its recompile limit dynamo runs a function eager, silently: the warm-up's six
        # shape classes, the rarer ones (a window reaching the slot's end) and several models
        # in one process (tests) must stay within it.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
        _COMPILED.extend([torch.compile(_inputs_for_compiled, dynamic=True), torch.compile(_fused_rest, dynamic=True)])
    return tuple(_COMPILED)


_COMPILED: list = []   # the two compiled functions, once made


# Plain tensors, not Parameters: the compiler takes a Parameter's shape as fixed, so every model
# (a draft and its target in one process, the tests' several) would compile its own graphs,
# up to dynamo's recompile limit, beyond which it runs eager without saying so.

def _weights(module: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    return module.weight.detach(), None if module.bias is None else module.bias.detach()


def _norm(norm: nn.Module, row_block: int | None = None) -> tuple:
    """(weight, eps) for _rms_norm, and the row block where there is one."""
    weight = norm.weight.detach()
    return (weight, norm.variance_epsilon) if not row_block else (weight, norm.variance_epsilon, row_block)


def _linear(module: nn.Linear):
    """x -> x W^T + b for the eager forward: the module itself where it has hooks (a
    tensor-parallel shard's all-reduce); a weight prepacked for oneDNN where it is bfloat16 on
    a CPU that has oneDNN's bfloat16 kernels (measured here 1.3-2x faster a call than
    F.linear for 1 to 40 rows, and bitwise the same: docs/BENCHMARKS.md); else F.linear."""
    if module._forward_hooks or module._forward_pre_hooks:
        return module
    weight, bias = _weights(module)
    if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and _onednn_bfloat16():
        return PrepackedLinear(weight, bias)
    return lambda x: _gemm(x, weight, bias)


_gemm = F.linear      # the plain linear's kernel: a module global, so a test can give it a GPU library's habits


class RowBlockLinear:
    """A linear computed `block` rows at a time (all dimensions but the last are rows), the last
    block zero-padded: every matrix product it makes has the same shape [block, in].

    Why: a GPU's matrix library chooses its kernel by the matrix's shape, and for few rows it
    splits the sum over the input features into partial sums (split-K) to fill the device; in
    bfloat16 a different split moves a result by an ulp (0.4 %), so a position's logits would
    depend on how many rows the call has, a verify would disagree with the target alone's single
    steps, and greedy speculation would change the output. With one shape, one kernel sums
    every row the same way in any call (Thinking Machines' batch-invariant kernels, 2025, fix
    the reduction order inside the kernel instead; that needs Triton). Padding is the cost: a
    step of 8 rows computes `block` rows, which on a GPU up to a few hundred rows takes the time
    of reading the weights, the same as 8; a prefill of 2,048 positions reads the weights
    2,048 / block times instead of once. Expected, not measured: no GPU has run this yet."""

    def __init__(self, linear, block: int):
        self.linear, self.block = linear, block

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _in_row_blocks(self.linear, x, self.block)


def _in_row_blocks(fn, x: torch.Tensor, block: int) -> torch.Tensor:
    """fn over x's rows, `block` rows a call (the last zero-padded), the outputs in x's order."""
    flat = x.reshape(-1, x.shape[-1])
    count = flat.shape[0]
    if count % block:
        flat = F.pad(flat, (0, 0, 0, block - count % block))
    out = torch.cat([fn(part) for part in flat.split(block)]) if flat.shape[0] > block else fn(flat)
    return out[:count].reshape(*x.shape[:-1], out.shape[-1])


class PrepackedLinear:
    """x W^T + b with W reordered once into oneDNN's blocked layout: F.linear on a CPU reorders
    a bfloat16 weight at every call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.packed, self.bias = torch.ops.mkldnn._reorder_linear_weight(weight, 1), bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _onednn_bfloat16() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _project(x: torch.Tensor, linear) -> torch.Tensor:
    """x through a linear: an eager callable (_linear) or, in compiled code, (weight, bias)."""
    return linear(x) if callable(linear) else F.linear(x, *linear)


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float, row_block: int | None = None) -> torch.Tensor:
    """transformers' RMSNorm; in row blocks where given (a GPU's reduction kernel, like its
    GEMM, splits a row's sum by how many rows there are)."""
    if row_block:
        return _in_row_blocks(lambda part: _rms_norm(part, weight, eps), hidden, row_block)
    as_float = hidden.to(torch.float32)
    variance = as_float.pow(2).mean(-1, keepdim=True)
    return weight * (as_float * torch.rsqrt(variance + eps)).to(hidden.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[R, KVH, L, D] -> [R, KVH * groups, L, D], each key/value head repeated for its group."""
    if groups == 1:
        return x
    rows, heads, length, dim = x.shape
    return x[:, :, None].expand(rows, heads, groups, length, dim).reshape(rows, heads * groups, length, dim)
