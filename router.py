"""
The routers of "Route Expert by Sequence, Not by Token" (SeqTopK), as pure functions.

Every router maps router scores of shape (B, T, N) -- B sequences, T tokens, N experts,
scores = softmax of the router logits -- to a bool mask of the same shape: mask[b, t, i] is
True when token t of sequence b is sent to expert i. The model turns any mask into expert
outputs through one dispatch path (model.py), so a new router is just a new function here.

The Router module at the bottom owns the gate (a linear layer, run in fp32) and the little state
two routers need (batchtopk's threshold; relu's regulariser coefficient and ReLU threshold), kept as
buffers so it travels in checkpoints. The selection itself is always one of the pure functions above it.
"""
import torch
import torch.nn as nn
from torch.nn import functional as F

ROUTERS = ('topk', 'mrltopk', 'seqtopk', 'batchtopk', 'relu')


def topk_mask(scores, k):
    # Eq. (3), TopK routing: each token takes its own k highest-scoring experts.
    idx = scores.topk(k, dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)


def mrltopk_budgets(k):
    """The k's an MRL-TopK layer may draw in training: 2^1, ..., 2^floor(log2 k), and k itself when it
    is not a power of two (k=6: 2, 4, 6), so the evaluation budget is always one of them; k=1: just 1."""
    budgets = [2 ** i for i in range(1, k.bit_length())]
    return budgets + [k] if k not in budgets else budgets


def mrltopk_draw(k, n_layers, generator=None):
    # MRL-TopK (appendix "LLM fine-tuning Experiment Setting"): each layer's k ~ Uniform{2^1..2^log2 K}.
    """One training step's budgets, one per MoE layer, as plain ints (static shapes); each layer then
    routes as topk_mask with its own k, and evaluation and generation use k itself."""
    budgets = mrltopk_budgets(k)
    return [budgets[i] for i in torch.randint(len(budgets), (n_layers,), generator=generator).tolist()]


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


def top_entries(values, n):
    """Mask of the n largest entries of each row of values (..., L), ties to the earlier entry: a
    stable top-n without a sort (the n-th largest value, then the ties that still fit, in order)."""
    if n == 0:
        return torch.zeros_like(values, dtype=torch.bool)
    nth = values.topk(n, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above, tied = values > nth, values == nth
    return above | (tied & (tied.cumsum(dim=-1) <= n - above.sum(dim=-1, keepdim=True)))


def seqtopk_mask(scores, k, min_k=1, max_k=None):
    # Eq. (5), SeqTopK routing: the top T*k entries of each sequence's T x N score matrix,
    # with every token taking between min_k and max_k experts (paper default: 1 and k+2).
    B, T, N = scores.shape
    min_k, max_k = seqtopk_bounds(k, N, min_k, max_k)
    # Within a token the best c experts are always its top c, so only its top max_k can be taken
    # (ranked as torch.topk ranks them, ties included, in every seqtopk path) and its first min_k are.
    ranked, order = scores.topk(max_k, dim=-1)
    # The rest of the budget goes to the best entries of rank [min_k, max_k) across the sequence,
    # ties to the earlier token. Ranked scores fall within a token, so a greedy pick is the best total.
    extra = top_entries(ranked[..., min_k:].reshape(B, -1), T * (k - min_k))
    chosen = torch.cat([torch.ones_like(order[..., :min_k], dtype=torch.bool), extra.view(B, T, -1)], dim=-1)
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, chosen)  # (token, rank) -> expert


def cached_at_least(past, candidates):
    """For each candidate (B, T, R) of the new tokens: how many of the Expert Cache's (B, P, R) score at
    least as high (int32), compared in chunks that bound the (B, chunk*R, P*R) comparison."""
    B, T, R = candidates.shape
    cached = past.reshape(B, 1, -1)
    chunk = max(1, 2 ** 24 // max(1, B * R * cached.shape[-1]))
    counts = [(cached >= candidates[:, t0:t0 + chunk].reshape(B, -1, 1)).sum(-1, dtype=torch.int32)
              for t0 in range(0, T, chunk)]
    return (counts[0] if len(counts) == 1 else torch.cat(counts, dim=1)).view(B, T, R)


def online_seqtopk_mask(scores, k, min_k=1, max_k=None, past=None, spent=None, strict=False):
    # Eq. (7), online SeqTopK: token m takes expert i when (m, i) is among the top m*k entries of the
    # m x N score matrix of tokens 1..m (the Expert Cache, Eq. 6), within the per-token bounds.
    """scores: (B, T, N), the newest T tokens. past: (B, P, max_k - min_k), the Expert Cache: each
    earlier token's scores of rank min_k..max_k-1, descending (the only ones the rule can still
    weigh: a token always takes its first min_k and never more than max_k); None = no earlier tokens.
    spent: (B,) experts those P tokens took. Every new token is routed by the rule above over itself
    and all tokens before it, so one call on a whole sequence (teacher forcing) routes each position
    exactly as decoding step by step. strict=True caps each token at m*k minus what tokens 1..m-1
    spent, so no prefix overspends. Returns the mask (B, T, N), the new tokens' cache rows and the
    new spent."""
    B, T, N = scores.shape
    min_k, max_k = seqtopk_bounds(k, N, min_k, max_k)
    R = max_k - min_k  # the candidates of a token: its entries of rank [min_k, max_k)
    P = 0 if past is None else past.shape[1]
    spent = torch.zeros(B, dtype=torch.long, device=scores.device) if spent is None else spent
    ranked, order = scores.topk(max_k, dim=-1)  # each token's top max_k, ranked as seqtopk_mask ranks them
    candidates = ranked.narrow(-1, min_k, R)                                # (B, T, R)
    # A candidate of token m is taken iff fewer than m*(k - min_k) candidates of tokens 1..m come
    # before it: earlier tokens' scoring >= it (earlier tokens win ties, as in seqtopk_mask) and the
    # token's own better-ranked ones. `before` counts them, plus the candidate itself.
    if T == 1 and not strict:  # a decoding step, m = P + 1, in as few ops as it can: it runs per layer per token
        # its first min_k ranks are always taken; its candidate of rank min_k + j is iff at most
        # m*(k - min_k) - 1 - j cached candidates score at least as high (its own j better ones come
        # before it too). Both sides move monotonically with j, so the taken ranks are a prefix.
        before = cached_at_least(past if P else scores.new_empty(B, 0, R), candidates).view(B, R)
        most = (P + 1) * (k - min_k) - 1
        taken = before <= torch.arange(most, most - R, -1, device=scores.device)  # made on the device: no copy
        mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order.narrow(-1, 0, min_k), True)
        mask.scatter_(-1, order.narrow(-1, min_k, R), taken.view(B, 1, R))
        return mask, candidates, spent + min_k + taken.sum(-1)
    # Sort the new candidates once in that order (a stable sort of the token-major flattening breaks
    # ties by token, then rank): those before a candidate of token m are then the ones placed at or
    # ahead of it that belong to tokens <= m. Counted in blocks of S tokens, ~T*T*R/S + T*S*R*R work
    # rather than every token against every place: earlier blocks' by a running count per block start,
    # the token's own block's (its start up to m) by comparing places directly.
    ordered = candidates.reshape(B, T * R).sort(dim=-1, descending=True, stable=True).indices
    token_of = ordered // R
    S = 16
    n_blocks = -(-T // S)
    place = torch.full((B, n_blocks * S * R), T * R, dtype=ordered.dtype, device=scores.device)  # padding: last
    place.narrow(1, 0, T * R).scatter_(-1, ordered, torch.arange(T * R, device=scores.device).expand(B, -1))
    place = place.view(B, n_blocks, S * R)
    token = torch.arange(S, device=scores.device).repeat_interleave(R)
    same_block_earlier = token[None, :] <= token[:, None]  # (candidate, other): the other's token <= its own
    before = torch.empty(B, n_blocks, S * R, dtype=torch.int32, device=scores.device)
    chunk = max(1, 2 ** 24 // max(1, B * (T * R + (S * R) ** 2)))  # blocks at once: bounds the tables
    for b0 in range(0, n_blocks, chunk):
        here = place[:, b0:b0 + chunk]  # (B, blocks, S*R)
        start = torch.arange(b0, b0 + here.shape[1], device=scores.device) * S
        earlier = (token_of[:, None, :] < start[None, :, None]).cumsum(dim=-1, dtype=torch.int32)
        in_block = ((here[:, :, None, :] <= here[..., None]) & same_block_earlier).sum(-1, dtype=torch.int32)
        before[:, b0:b0 + chunk] = earlier.gather(-1, here.clamp_max(T * R - 1)) + in_block
    before = before.view(B, -1).narrow(1, 0, T * R).view(B, T, R)
    if P:  # the Expert Cache's tokens are all earlier
        before += cached_at_least(past, candidates)
    # taken: candidates with fewer than m*(k - min_k) before them (`before` counts the candidate too)
    position = torch.arange(P + 1, P + T + 1, device=scores.device)  # m, 1-based
    counts = (before <= (position * (k - min_k))[:, None]).sum(dim=-1) + min_k
    if strict:  # spent_m = min(spent_{m-1} + count_m, m*k), in closed form: a cumulative min
        total = counts.cumsum(dim=1)
        slack = torch.cat([spent[:, None], position * k - total], dim=1).cummin(dim=1).values
        capped = total + slack[:, 1:]
        counts = capped - torch.cat([spent[:, None], capped[:, :-1]], dim=1)
    # a token takes its experts of rank < its count
    rank = torch.arange(max_k, device=scores.device)
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, rank < counts.unsqueeze(-1))
    return mask, candidates, spent + counts.sum(dim=1)


def batchtopk_mask(scores, k):
    # BatchTopK (Bussmann et al.), training: the top B*T*k entries of the whole batch's scores.
    B, T, N = scores.shape
    return top_entries(scores.reshape(-1), B * T * k).view(B, T, N)


def threshold_mask(scores, threshold):
    # BatchTopK, evaluation: every score above the threshold learnt in training (batch-independent).
    return scores > threshold


def relu_gates(logits, threshold=0.0):
    # ReMoE: gates = ReLU(router logits); an expert is active wherever its gate is positive. Here the
    # ReLU may open below 0, at a per-layer threshold <= 0 (0 = ReMoE; see next_relu_threshold).
    return F.relu(logits - threshold)


def switch_balance(probs, mask, k):
    # Switch load balance (Fedus et al.), Megatron's form: N * sum_e mean_t(probs_e) * tokens_e / (tokens * k).
    """ReMoE applies it to the ReLU gates as its sparsity-and-balance regulariser (thu-ml/ReMoE's
    ReLURouter.apply_l1_reg, megatron/core/transformer/moe/router.py): each expert's L1 is weighted by
    its share of the tokens."""
    probs, mask = probs.flatten(0, -2), mask.flatten(0, -2)
    tokens_per_expert = mask.sum(0).to(probs.dtype)  # counts: no gradient flows through them
    return probs.shape[-1] * (probs.mean(0) * tokens_per_expert).sum() / (mask.shape[0] * k)


def next_relu_threshold(threshold, active_frac, k, n_exp, step=0.1):
    # Not in ReMoE, which can only push gates shut (lambda >= 0): a layer left too sparse, whose closed
    # gates get no gradient, reopens as its threshold falls by step x relative error (active - K/N) / (K/N).
    """The next ReLU threshold of one layer (a tensor), never above ReMoE's 0: closing stays lambda's job.
    step = 0 keeps ReMoE's threshold of 0."""
    target = k / n_exp
    return (threshold + step * (active_frac - target) / target).clamp(max=0.0)


def next_relu_coef(l1_coef, active_frac, k, n_exp, step=1.2):
    # ReMoE's controller (thu-ml/ReMoE's megatron/training/training.py): lambda x step when the active
    # fraction (ReMoE: its mean over all MoE layers, one lambda) is above K/N (too dense), / step otherwise.
    """The next lambda (a tensor: no host sync), kept within [1e-12, 1e3] against under/overflow."""
    return (l1_coef * torch.where(active_frac > k / n_exp, step, 1 / step)).clamp(1e-12, 1e3)


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
    norm_topk_prob, aux_loss_weight, z_loss_weight, threshold_decay, relu_l1_init (the step rules are
    applied by GPT.adapt_relu).
    """

    def __init__(self, config):
        super().__init__()
        check_router(config.router, config.top_k, config.n_exp, config.seq_min_k, config.seq_max_k or None)
        self.config = config
        self.gate = nn.Linear(config.n_embd, config.n_exp, bias=False)
        # mrltopk: the k this layer routes with in the current training step (GPT.forward sets it)
        self.k = config.top_k
        # batchtopk: EMA of the smallest selected score in training (0 = not yet seen a batch);
        # relu: the logit at which this layer's ReLU gates open (0 = ReMoE's ReLU)
        self.register_buffer('threshold', torch.zeros(()))
        # relu: ReMoE's regulariser coefficient lambda (this layer's, or one value for the whole model,
        # each layer a copy), and the sum and count of this layer's active fractions over the training
        # forwards since GPT.adapt_relu last stepped lambda and the threshold
        self.register_buffer('l1_coef', torch.tensor(float(config.relu_l1_init)))
        self.register_buffer('active_sum', torch.zeros(()))
        self.register_buffer('active_count', torch.zeros(()))

    def budget(self):
        """Experts per token this layer routes with now: mrltopk's draw in training, else top_k."""
        return self.k if self.config.router == 'mrltopk' and self.training else self.config.top_k

    def fixed_pairs(self, n_tokens, causal=False):
        """How many (token, expert) pairs the selection of n_tokens makes, when that is known before it
        runs (the exact budgets), else None. The dispatch then runs with static shapes and no sync."""
        cfg = self.config
        exact = (cfg.router in ('topk', 'mrltopk') or (cfg.router == 'seqtopk' and not causal)
                 or (cfg.router == 'batchtopk' and self.training))
        return n_tokens * self.budget() if exact else None

    def select(self, scores, cache=None, causal=False):
        cfg = self.config
        if cfg.router == 'topk':
            return topk_mask(scores, cfg.top_k)
        if cfg.router == 'mrltopk':  # training: this step's draw; evaluation and generation: top_k
            return topk_mask(scores, self.budget())
        if cfg.router == 'seqtopk':
            bounds = (cfg.top_k, cfg.seq_min_k, cfg.seq_max_k or None)
            if cache is None and not causal:
                return seqtopk_mask(scores, *bounds)
            past, spent = (None, None) if cache is None else (cache.get('candidates'), cache.get('spent'))
            if causal:  # online SeqTopK: each token against the tokens before it
                mask, candidates, spent = online_seqtopk_mask(scores, *bounds, past, spent,
                                                              strict=cfg.seq_budget == 'strict')
            else:  # a prompt routed jointly (offline SeqTopK), then cached for decoding
                mask = seqtopk_mask(scores, *bounds)
                min_k, max_k = seqtopk_bounds(cfg.top_k, cfg.n_exp, cfg.seq_min_k, cfg.seq_max_k or None)
                candidates = scores.topk(max_k, dim=-1).values[..., min_k:]
                spent = mask.sum(dim=(1, 2)) + (0 if spent is None else spent)
            if cache is not None:  # the Expert Cache: every token's candidate scores, and experts spent
                cache.append('candidates', candidates)
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
        """cache: this layer's dict in a generation's Cache (decoding: no auxiliary loss, nothing to
        train); causal: route seqtopk by the online rule (each token against the tokens before it)
        rather than the whole sequence."""
        cfg = self.config
        # fp32 even under autocast: ranking near-tied scores must not depend on bf16 rounding
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.softmax(dim=-1)
        aux_loss = 0.0
        if cfg.router == 'relu':
            weights = relu_gates(logits, self.threshold)
            mask = weights > 0
            # ReMoE's one regulariser, also its load balancer: lambda * Switch formula on the gates
            # (no z-loss: pulling logits down would close every ReLU gate; no softmax balance loss)
            if cache is None:
                aux_loss = self.l1_coef.clone() * switch_balance(weights, mask, cfg.top_k)
            if self.training:
                with torch.no_grad():
                    self.active_sum.add_(mask.float().mean())
                    self.active_count.add_(1)
        else:
            mask = self.select(scores, cache, causal)
            weights = routing_weights(scores, mask, cfg.norm_topk_prob)
            if cache is None:
                aux_loss = (cfg.aux_loss_weight * switch_balance(scores, mask, self.budget())
                            + cfg.z_loss_weight * logits.logsumexp(dim=-1).square().mean())  # router z-loss
        return mask, weights, scores, aux_loss


# -----------------------------------------------------------------------------
# the routing statistics the paper plots (Fig. 4, 5), from counts accumulated over evaluation batches

def routing_counts(masks, entropy, k, bins=10):
    """One batch's counts, to be summed over batches. masks: (layers, B, T, N), each MoE layer's
    selection; entropy: (B, T), each token's predictive entropy / log V, in [0, 1]. Per layer the
    experts-per-token histogram (N + 1) and the expert load (N); the mean over sequences of experts per
    token (mean over layers) at each position; per entropy bin the tokens and their experts; and the worst
    prefix overspend, experts taken by tokens 1..m beyond m * k (what the online budget promises never happens)."""
    per_token = masks.sum(-1)  # (layers, B, T)
    experts = per_token.float().mean(0)  # (B, T)
    binned = (entropy * bins).long().clamp(0, bins - 1).flatten()
    return dict(hist=torch.stack([torch.bincount(c.flatten(), minlength=masks.shape[-1] + 1) for c in per_token]),
                load=masks.sum(dim=(1, 2)), by_position=experts.mean(0),
                bin_count=torch.bincount(binned, minlength=bins),
                bin_experts=torch.bincount(binned, weights=experts.flatten(), minlength=bins),
                overspend=int((per_token.cumsum(-1) - k * torch.arange(1, per_token.shape[-1] + 1)).max()))


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
