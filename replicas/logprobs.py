"""Log probabilities of the tokens a verify emits, and of a prompt's tokens, from the rows of
the forward pass that computed them (no extra pass).

They are the target's raw distribution, log_softmax of its logits before bias, penalties,
temperature, top-k and top-p: vLLM's default (`logprobs_mode: raw_logprobs`), so a client
compares them with any forward pass of the model on the same tokens.
"""

from __future__ import annotations

import torch

from replicas.protocol import TokenLogprobs


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprobs]:
    """logits [n, V], row j the distribution of tokens[j]; the logprob of each token and the
    `top` most likely ids of its row with theirs, most likely first. One transfer."""
    if not tokens:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)                        # [n, V]
    chosen = logprobs.gather(-1, torch.tensor(tokens, dtype=torch.long, device=logits.device)[:, None])[:, 0]
    best = logprobs.topk(top, dim=-1) if top else None
    chosen_list = chosen.tolist()
    if best is None:
        return [TokenLogprobs(token, lp, ()) for token, lp in zip(tokens, chosen_list)]
    values, ids = best.values.tolist(), best.indices.tolist()
    return [TokenLogprobs(token, lp, tuple(zip(row_ids, row_values)))
            for token, lp, row_ids, row_values in zip(tokens, chosen_list, ids, values)]
