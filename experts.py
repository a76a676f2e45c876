"""
The experts of a MoE layer, for every router: from a mask and gates (M, N) over M tokens and N
experts to y = sum_i gates[:, i] * expert_i(x), expert_i(x) = gelu(x @ w_fc[i]) @ w_proj[i].
First the textbook loop, then the sorted dispatch that training runs (equal, tested): the (token,
expert) pairs sorted by expert, each expert's tokens one block of rows for a grouped matmul.
"""
import torch
from torch.nn import functional as F


def moe_loop(x, mask, gates, w_fc, w_proj):
    """The textbook MoE: for each expert, gather the tokens that take it, run its MLP, add the
    outputs back to those tokens scaled by their gates. x (M, C) -> (M, C)."""
    y = torch.zeros_like(x)
    for i in mask.any(0).nonzero().flatten().tolist():  # the experts some token takes
        token = mask[:, i].nonzero().flatten()  # (M_i,): the tokens that take expert i
        h = F.gelu(x[token] @ w_fc[i].to(x.dtype))  # (M_i, H)
        y.index_add_(0, token, (h * gates[token, i, None]) @ w_proj[i].to(x.dtype))
    return y


def expert_loop(x, w, offs):
    """The grouped matmul: each expert's block of rows of x (P, C) times its matrix of w
    (N, C, H) -> (P, H); offs (N,): where each expert's rows end. A matmul per expert here;
    fast.grouped_mm runs it as one kernel."""
    rows = offs.diff(prepend=offs.new_zeros(1)).tolist()  # each expert's row count: a host sync
    return torch.cat([x_e @ w_e for x_e, w_e in zip(x.split(rows), w)])


def moe_sorted(x, mask, gates, w_fc, w_proj, grouped_mm=expert_loop, n_pairs=None):
    """moe_loop with the pairs sorted by expert: x (M, C) -> (M, C). n_pairs: the pairs the mask
    selects, when the router knows it in advance (else counted: a host sync)."""
    M, N = mask.shape
    selected = mask.t().reshape(-1)  # (N * M,): expert 0's tokens first, then expert 1's, ...
    pair = (selected.nonzero() if n_pairs is None  # (P,)
            else torch.nonzero_static(selected, size=n_pairs)).squeeze(1)
    token = pair % M  # (P,)
    gate = gates.t().reshape(-1).index_select(0, pair)  # (P,)
    offs = mask.sum(0).cumsum(0).to(torch.int32)  # (N,): where each expert's rows end
    h = F.gelu(grouped_mm(x.index_select(0, token), w_fc.to(x.dtype), offs))  # (P, H)
    y = grouped_mm(h * gate.unsqueeze(-1), w_proj.to(x.dtype), offs)  # (P, C)
    return torch.zeros_like(x).index_add_(0, token, y)
