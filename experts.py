"""
The experts of a MoE layer, for every router: from a mask and gates (M, N) over M tokens and N
experts to sum_i gates[:, i] * expert_i(x), expert_i(x) = gelu(x @ w_fc[i]) @ w_proj[i]:
- moe_experts (training, evaluation, a prompt): the (token, expert) pairs sorted by expert, each
  pair's token gathered, two grouped matmuls, scaled by the gates, added back to their tokens;
- decode_experts (a decoding step): each pair's expert weights gathered, one batched matmul, as
  gpt-fast decodes Mixtral.
"""
import torch
from torch.nn import functional as F

import fast


def expert_loop(x, w, offs):
    """Each expert's rows of x (P, C) times its matrix of w (N, C, H) -> (P, H); offs (N,): where
    each expert's rows end. A matmul per expert; fast.grouped_mm does the same in one kernel."""
    rows = offs.diff(prepend=offs.new_zeros(1)).tolist()  # each expert's row count: a host sync
    return torch.cat([x_e @ w_e for x_e, w_e in zip(x.split(rows), w)])


def moe_experts(x, mask, gates, w_fc, w_proj, n_pairs=None, kernel=True):
    """x (M, C), mask and gates (M, N), any number of experts per token -> (M, C). n_pairs: the
    pairs the mask selects, when the router knows it in advance (else counted: a host sync);
    kernel: fast.grouped_mm (torch._grouped_mm where it runs), else expert_loop."""
    M, N = mask.shape
    selected = mask.t().reshape(-1)  # (N * M,): expert 0's tokens first, then expert 1's, ...
    pair = (selected.nonzero() if n_pairs is None  # (P,)
            else torch.nonzero_static(selected, size=n_pairs)).squeeze(1)
    token = pair % M  # (P,)
    gate = gates.t().reshape(-1).index_select(0, pair)  # (P,)
    offs = mask.sum(0).cumsum(0).to(torch.int32)  # (N,): where each expert's rows end
    grouped_mm = fast.grouped_mm if kernel else expert_loop
    h = F.gelu(grouped_mm(x.index_select(0, token), w_fc.to(x.dtype), offs))  # (P, H)
    y = grouped_mm(h * gate.unsqueeze(-1), w_proj.to(x.dtype), offs)  # (P, C)
    return torch.zeros_like(x).index_add_(0, token, y)


def slot_pairs(mask, gates, slots):
    """Each token's experts in `slots` slots (M, slots), those it takes first, and their gates; a
    slot it does not take holds its first expert again with gate 0 (no other weights are read)."""
    taken, expert = mask.to(gates.dtype).topk(slots, dim=-1)
    expert = torch.where(taken > 0, expert, expert[:, :1])
    return expert, gates.gather(-1, expert) * taken


def decode_experts(x, mask, gates, w_fc, w_proj, slots):
    """x (M, C), mask and gates (M, N) -> (M, C), each token running `slots` pairs (the router's
    bound): no shape depends on the data (one compiled graph, no GPU sync). The matrices are cast
    after the gather: a bf16 step reads only the experts it uses."""
    expert, gate = slot_pairs(mask, gates, slots)  # (M, slots) each
    token = torch.arange(x.shape[0], device=x.device).repeat_interleave(slots)  # (P,)
    expert, gate = expert.flatten(), gate.flatten()  # (P,)
    w_fc, w_proj = w_fc.index_select(0, expert), w_proj.index_select(0, expert)  # P, C, H / P, H, C
    h = F.gelu(torch.bmm(x.index_select(0, token).unsqueeze(1), w_fc.to(x.dtype)))  # (P, 1, H)
    y = torch.bmm(h * gate.view(-1, 1, 1), w_proj.to(x.dtype)).squeeze(1)  # (P, C)
    return torch.zeros_like(x).index_add_(0, token, y)
