"""
The routers of "Route Expert by Sequence, Not by Token" (SeqTopK), as pure functions.

Every router maps router scores of shape (B, T, N) -- B sequences, T tokens, N experts,
scores = softmax of the router logits -- to a bool mask of the same shape: mask[b, t, i] is
True when token t of sequence b is sent to expert i. The model turns any mask into expert
outputs through one dispatch path (model.py), so a new router is just a new function here.

The Router module at the bottom owns the gate (a linear layer, run in fp32) and the little state
two routers need (batchtopk's threshold, relu's L1 coefficient), kept as buffers so it travels in
checkpoints. The selection itself is always one of the pure functions above it.
"""
import torch
import torch.nn as nn
from torch.nn import functional as F

ROUTERS = ('topk', 'seqtopk', 'batchtopk', 'relu')


def topk_mask(scores, k):
    # Eq. (3), TopK routing: each token takes its own k highest-scoring experts.
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
    # Eq. (5), SeqTopK routing: the top T*k entries of each sequence's T x N score matrix,
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


def online_seqtopk_mask(scores, k, min_k=1, max_k=None, past=None, spent=None, strict=False):
    # Eq. (7), online SeqTopK: token m takes expert i when (m, i) is among the top m*k entries of the
    # m x N score matrix of tokens 1..m (the Expert Cache, Eq. 6), within the per-token bounds.
    """scores: (B, T, N), the newest T tokens; past: (B, P, N) earlier tokens' scores, each row sorted
    descending (the Expert Cache; None = no earlier tokens); spent: (B,) experts those P tokens took.
    Every new token is routed by the rule above over itself and all tokens before it, so one call
    on a whole sequence (teacher forcing) routes each position exactly as decoding step by step.
    strict=True caps each token at m*k minus what tokens 1..m-1 spent, so no prefix overspends.
    Returns the mask (B, T, N), the new rows sorted (to append to the cache) and the new spent."""
    B, T, N = scores.shape
    min_k, max_k = seqtopk_bounds(k, N, min_k, max_k)
    R = max_k - min_k  # the candidates of a token: its entries of rank [min_k, max_k)
    P = 0 if past is None else past.shape[1]
    spent = torch.zeros(B, dtype=torch.long, device=scores.device) if spent is None else spent
    ranked, order = scores.sort(dim=-1, descending=True, stable=True)
    candidates = ranked[..., min_k:max_k]                                   # (B, T, R)
    position = torch.arange(P + 1, P + T + 1, device=scores.device)         # m, 1-based
    # A candidate of token m is taken iff fewer than m*(k - min_k) candidates of tokens 1..m come
    # before it: earlier tokens' scoring >= it (earlier tokens win ties, as in seqtopk_mask) and the
    # token's own better-ranked ones. `before` counts them, plus the candidate itself.
    if T == 1:  # a decoding step: of the new candidates, its own better-ranked ones and itself
        before = torch.arange(1, R + 1, device=scores.device)
    else:  # sort the new candidates once in that order (a stable sort of the token-major flattening
        # breaks ties by token, then rank): those before a candidate of token m are then a running
        # count of the ones of tokens <= m, linear in T per token instead of comparing every pair
        ordered = candidates.reshape(B, T * R).sort(dim=-1, descending=True, stable=True).indices
        token_of = ordered // R
        place = torch.empty_like(ordered).scatter_(-1, ordered, torch.arange(T * R, device=scores.device).expand(B, -1))
        place = place.view(B, T, R)
        before = torch.empty(B, T, R, dtype=torch.long, device=scores.device)
        chunk = max(1, 2 ** 24 // max(1, B * T * R))  # bounds the (B, chunk, T*R) running counts
        for t0 in range(0, T, chunk):
            t = torch.arange(t0, min(T, t0 + chunk), device=scores.device)
            running = (token_of[:, None, :] <= t[None, :, None]).cumsum(dim=-1)
            before[:, t0:t0 + chunk] = running.gather(-1, place[:, t0:t0 + chunk])
    if P:  # the Expert Cache's tokens are all earlier: count their candidates scoring >= each one
        cached = past[..., min_k:max_k].reshape(B, 1, 1, P * R)
        chunk = max(1, 2 ** 24 // max(1, B * P * R * R))  # bounds the (B, chunk, R, P*R) comparison
        cached_ge = [torch.count_nonzero(cached >= candidates[:, t0:t0 + chunk, :, None], dim=-1)
                     for t0 in range(0, T, chunk)]
        before = before + (cached_ge[0] if len(cached_ge) == 1 else torch.cat(cached_ge, dim=1))
    budget = (P + 1) * (k - min_k) if T == 1 else (position * (k - min_k))[:, None]
    counts = (before <= budget).sum(dim=-1) + min_k
    if strict:  # spent_m = min(spent_{m-1} + count_m, m*k), in closed form: a cumulative min
        total = counts.cumsum(dim=1)
        slack = torch.cat([spent[:, None], position * k - total], dim=1).cummin(dim=1).values
        capped = total + slack[:, 1:]
        counts = capped - torch.cat([spent[:, None], capped[:, :-1]], dim=1)
    chosen = torch.arange(N, device=scores.device) < counts[..., None]    # (token, rank)
    mask = torch.zeros_like(chosen).scatter_(-1, order, chosen)
    return mask, ranked, spent + counts.sum(dim=1)


def batchtopk_mask(scores, k):
    # BatchTopK (Bussmann et al.), training: the top B*T*k entries of the whole batch's scores.
    B, T, N = scores.shape
    flat = scores.reshape(-1)
    pick = flat.sort(descending=True, stable=True).indices[:B * T * k]
    return torch.zeros_like(flat, dtype=torch.bool).scatter_(0, pick, True).view(B, T, N)


def threshold_mask(scores, threshold):
    # BatchTopK, evaluation: every score above the threshold learnt in training (batch-independent).
    return scores > threshold


def relu_gates(logits):
    # ReMoE: gates = ReLU(router logits); an expert is active wherever its gate is positive.
    return F.relu(logits)


def routing_weights(scores, mask, renormalize=False):
    """Gate values: the selected softmax scores, optionally renormalised to sum to 1 per token."""
    weights = scores * mask
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-9)
    return weights


def check_router(router, k, n_exp, min_k=1, max_k=None):
    """ValueError with a one-line, actionable message for a router setting that cannot work."""
    if router not in ROUTERS:
        raise ValueError(f"unknown router '{router}': choose one of {', '.join(ROUTERS)}")
    if router == 'seqtopk':
        seqtopk_bounds(k, n_exp, min_k, max_k)
    elif not 1 <= k <= n_exp:
        raise ValueError(f"top_k={k} must be between 1 and n_exp={n_exp}")


class Router(nn.Module):
    """Token features (B, T, C) -> mask (B, T, N), gate weights (B, T, N), scores, auxiliary loss.

    config fields used: n_embd, n_exp, router, top_k, seq_min_k, seq_max_k (0 = top_k + 2), seq_budget,
    norm_topk_prob, aux_loss_weight, z_loss_weight, threshold_decay, relu_l1_init, relu_l1_step.
    """

    def __init__(self, config):
        super().__init__()
        check_router(config.router, config.top_k, config.n_exp, config.seq_min_k, config.seq_max_k or None)
        self.config = config
        self.gate = nn.Linear(config.n_embd, config.n_exp, bias=False)
        # batchtopk: EMA of the smallest selected score in training; 0 = not yet seen a batch
        self.register_buffer('threshold', torch.zeros(()))
        # relu: L1 coefficient lambda, adapted every training step toward sparsity 1 - k/N
        self.register_buffer('l1_coef', torch.tensor(float(config.relu_l1_init)))
        self.register_buffer('active_frac', torch.tensor(config.top_k / config.n_exp))

    def fixed_pairs(self, n_tokens, causal=False):
        """How many (token, expert) pairs the selection of n_tokens makes, when that is known before it
        runs (the exact budgets), else None. The dispatch then runs with static shapes and no sync."""
        cfg = self.config
        exact = (cfg.router == 'topk' or (cfg.router == 'seqtopk' and not causal)
                 or (cfg.router == 'batchtopk' and self.training))
        return n_tokens * cfg.top_k if exact else None

    def select(self, scores, cache=None, causal=False):
        cfg = self.config
        if cfg.router == 'topk':
            return topk_mask(scores, cfg.top_k)
        if cfg.router == 'seqtopk':
            bounds = (cfg.top_k, cfg.seq_min_k, cfg.seq_max_k or None)
            if cache is None and not causal:
                return seqtopk_mask(scores, *bounds)
            past, spent = (None, None) if cache is None else (cache.get('ranked'), cache.get('spent'))
            if causal:  # online SeqTopK: each token against the tokens before it
                mask, ranked, spent = online_seqtopk_mask(scores, *bounds, past, spent,
                                                          strict=cfg.seq_budget == 'strict')
            else:  # a prompt routed jointly (offline SeqTopK), then cached for decoding
                mask = seqtopk_mask(scores, *bounds)
                ranked = scores.sort(dim=-1, descending=True, stable=True).values
                spent = mask.sum(dim=(1, 2)) + (0 if spent is None else spent)
            if cache is not None:  # the Expert Cache: every token's ranked scores, and experts spent
                cache.append('ranked', ranked)
                cache['spent'] = spent
            return mask
        # batchtopk
        if not self.training:  # batchtopk at evaluation and generation
            return threshold_mask(scores, self.threshold)
        mask = batchtopk_mask(scores, cfg.top_k)
        with torch.no_grad():
            smallest = scores.masked_fill(~mask, float('inf')).min()
            decay = torch.where(self.threshold > 0, cfg.threshold_decay, 0.0)
            self.threshold.copy_(decay * self.threshold + (1 - decay) * smallest)
        return mask

    def forward(self, x, cache=None, causal=False):
        """cache: this layer's dict in a generation's Cache (decoding); causal: route seqtopk by the
        online rule (each token against the tokens before it) rather than the whole sequence."""
        cfg = self.config
        # fp32 even under autocast: ranking near-tied scores must not depend on bf16 rounding
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.softmax(dim=-1)
        if cfg.router == 'relu':
            weights = relu_gates(logits)
            mask = weights > 0
            # ReMoE's L1 penalty (no z-loss: pulling logits down would close every ReLU gate)
            aux_loss = self.l1_coef.clone() * weights.sum(dim=-1).mean()
            if self.training:
                with torch.no_grad():  # lambda *= alpha when too dense, /= alpha when too sparse
                    self.active_frac.copy_(mask.float().mean())
                    too_dense = self.active_frac > cfg.top_k / cfg.n_exp
                    step = torch.where(too_dense, cfg.relu_l1_step, 1 / cfg.relu_l1_step)
                    self.l1_coef.mul_(step).clamp_(1e-12, 1e3)
        else:
            mask = self.select(scores, cache, causal)
            weights = routing_weights(scores, mask, cfg.norm_topk_prob)
            aux_loss = cfg.z_loss_weight * logits.logsumexp(dim=-1).square().mean()  # router z-loss
        # Switch load balance: N * sum_e (share of assignments to e) * (mean score of e)
        load = mask.flatten(0, 1).sum(0).float()
        mean_score = scores.flatten(0, 1).mean(0)
        aux_loss = aux_loss + cfg.aux_loss_weight * cfg.n_exp * (load / load.sum().clamp_min(1) * mean_score).sum()
        return mask, weights, scores, aux_loss


# -----------------------------------------------------------------------------
# the routing statistics the paper plots (Fig. 4), from accumulated counts

def routing_stats(hist, load):
    """hist[c] = tokens that took c experts (c = 0..N); load[e] = tokens sent to expert e."""
    hist, load = hist.double(), load.double()
    counts = torch.arange(len(hist), dtype=torch.float64)
    used = counts[hist > 0]
    share = load / load.sum().clamp_min(1)  # the probability that an assignment goes to expert e
    entropy = -(share * share.clamp_min(1e-12).log()).sum() / torch.log(torch.tensor(float(len(load))))
    return dict(
        experts_mean=float((hist * counts).sum() / hist.sum()), experts_min=int(used.min()),
        experts_max=int(used.max()), experts_hist=[int(h) for h in hist],
        load=[int(n) for n in load], load_var=float(load.var(unbiased=False)),
        load_cv=float(load.std(unbiased=False) / load.mean().clamp_min(1e-12)),
        dead_experts=int((load == 0).sum()), entropy=float(entropy),
    )
