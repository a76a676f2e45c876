"""
The routers of "Route Expert by Sequence, Not by Token" (SeqTopK), as pure functions.

Every router maps router scores of shape (B, T, N) -- B sequences, T tokens, N experts,
scores = softmax of the router logits -- to a bool mask of the same shape: mask[b, t, i] is
True when token t of sequence b is sent to expert i. The model turns any mask into expert
outputs through one dispatch path (model.py), so a new router is just a new function here.
"""
import torch

ROUTERS = ('topk', 'seqtopk')


def topk_mask(scores, k):
    # Eq. (1), TopK routing: each token takes its own k highest-scoring experts.
    idx = scores.topk(k, dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)


def seqtopk_bounds(k, n_exp, min_k=1, max_k=None):
    """The per-token bounds (min_k, max_k) seqtopk uses; ValueError when T*k is infeasible."""
    max_k = k + 2 if max_k is None else max_k
    max_k = min(max_k, n_exp)  # max_k >= n_exp means "no upper bound"
    if not 1 <= k <= n_exp:
        raise ValueError(f"top_k={k} must be between 1 and n_exp={n_exp}")
    if not 0 <= min_k <= k <= max_k:
        raise ValueError(f"seqtopk bounds need 0 <= min_k <= top_k <= max_k, got min_k={min_k}, "
                         f"top_k={k}, max_k={max_k} (n_exp={n_exp}); a sequence must spend exactly T*top_k")
    return min_k, max_k


def seqtopk_mask(scores, k, min_k=1, max_k=None):
    # Eq. (3), SeqTopK routing: the top T*k entries of each sequence's T x N score matrix,
    # with every token taking between min_k and max_k experts (paper default: 1 and k+2).
    B, T, N = scores.shape
    min_k, max_k = seqtopk_bounds(k, N, min_k, max_k)
    # Within a token the best c experts are always its top c, so rank each token's experts once.
    # Stable sorts make ties deterministic: the lower expert index, then the earlier token, wins.
    ranked, order = scores.sort(dim=-1, descending=True, stable=True)
    chosen = torch.zeros_like(scores, dtype=torch.bool)  # indexed by (token, rank), not expert
    chosen[..., :min_k] = True  # every token's guaranteed experts
    # The rest of the budget goes to the best entries of rank [min_k, max_k) across the sequence.
    # Ranked scores fall within a token, so a greedy pick is the highest-total-score selection.
    extra = ranked[..., min_k:max_k].reshape(B, -1)
    pick = extra.sort(dim=-1, descending=True, stable=True).indices[:, :T * (k - min_k)]
    extra_chosen = torch.zeros_like(extra, dtype=torch.bool).scatter_(-1, pick, True)
    chosen[..., min_k:max_k] = extra_chosen.view(B, T, max_k - min_k)
    return torch.zeros_like(chosen).scatter_(-1, order, chosen)  # (token, rank) -> (token, expert)


def route(scores, router, k, min_k=1, max_k=None):
    """Dispatch by router name: the one place the model asks for a mask."""
    if router == 'topk':
        return topk_mask(scores, k)
    if router == 'seqtopk':
        return seqtopk_mask(scores, k, min_k, max_k)
    raise ValueError(f"unknown router '{router}': choose one of {', '.join(ROUTERS)}")


def routing_weights(scores, mask, renormalize=False):
    """Gate values: the selected softmax scores, optionally renormalised to sum to 1 per token."""
    weights = scores * mask
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-9)
    return weights
