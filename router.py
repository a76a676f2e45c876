"""
The routers of "Route Expert by Sequence, Not by Token" (SeqTopK), as pure functions, and the one
table that says everything else each router is.

Every router maps router scores of shape (B, T, N) -- B sequences, T tokens, N experts,
scores = softmax (or sigmoid) of the router logits -- to a bool mask of the same shape: mask[b, t, i] is
True when token t of sequence b is sent to expert i. The model turns any mask into expert
outputs through one dispatch path (experts.py).

Adding a router: its selection as a pure function below, its row in ROUTERS (the table near the
bottom: how many pairs it takes, any per-step draw, state or step rule), and a test. The Router
module at the bottom is the same for every router: it runs the gate (in fp32) and then the row.
"""
from collections import namedtuple

import torch
import torch.nn as nn
from torch.nn import functional as F


def topk_mask(scores, k):
    # Eq. (3), TopK routing: each token takes its own k highest-scoring experts.
    idx = scores.topk(k, dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)


def mrltopk_budgets(k):
    """The k's an MRL-TopK layer may draw in training: 2^1, ..., 2^floor(log2 k), and k itself when it
    is not a power of two (k=6: 2, 4, 6), so the evaluation budget is always one of them; k=1: just 1."""
    budgets = [2 ** i for i in range(1, k.bit_length())]
    return budgets + [k] if k not in budgets else budgets


@torch.compiler.disable  # drawn eagerly: in a compiled forward the layer count can turn symbolic, and randint fails
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


def online_seqtopk_mask(scores, k, min_k=1, max_k=None, past=None, spent=None, strict=False, n_past=None):
    # Eq. (7), online SeqTopK: token m takes expert i when (m, i) is among the top m*k entries of the
    # m x N score matrix of tokens 1..m (the Expert Cache, Eq. 6), within the per-token bounds.
    """scores: (B, T, N), the newest T tokens. past: (B, P, max_k - min_k), the Expert Cache: each
    earlier token's scores of rank min_k..max_k-1, descending (the only ones the rule can still
    weigh: a token always takes its first min_k and never more than max_k), -inf in slots not yet
    written (they never score as high); None = no earlier tokens. n_past: how many earlier tokens
    there are (default P; a tensor in a compiled step, whose static cache is longer). spent: (B,)
    experts those tokens took. Every new token is routed by the rule above over itself and all tokens
    before it, so one call on a whole sequence (teacher forcing) routes each position exactly as
    decoding step by step. strict=True caps each token at m*k minus what tokens 1..m-1 spent, so no
    prefix overspends. Returns the mask (B, T, N), the new tokens' cache rows and the new spent."""
    B, T, N = scores.shape
    min_k, max_k = seqtopk_bounds(k, N, min_k, max_k)
    R = max_k - min_k  # the candidates of a token: its entries of rank [min_k, max_k)
    P = 0 if past is None else past.shape[1]
    n_past = P if n_past is None else n_past
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
        most = (n_past + 1) * (k - min_k) - 1
        taken = before <= most - torch.arange(R, device=scores.device)  # made on the device: no copy
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
    position = n_past + torch.arange(1, T + 1, device=scores.device)  # m, 1-based
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


# -----------------------------------------------------------------------------
# gates, losses and step rules

def routing_weights(scores, mask, renormalize=False, scale=1.0):
    """Gate values: scale x the selected scores, optionally renormalised to sum to 1 per token first. Not
    renormalised, a token given more experts gets more gate mass, which sequence-level routing relies on."""
    weights = scores * mask
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-9)
    return scale * weights


def auto_route_scale(cfg):
    """The gate scale of route_scale=0: each selected gate about 1 at initialisation, when the scores are
    near uniform (softmax: 1/n_exp each; sigmoid: 1/2; renormalised: 1/top_k), so the MoE layer's output
    starts on the scale of a dense FFN with its active parameters, not top_k/n_exp of it (measured: 0.04-0.06
    nats better than gates summing to 1, 0.14-0.16 better than the paper's unscaled ones; results/README.md)."""
    return cfg.top_k if cfg.norm_topk_prob else cfg.n_exp if cfg.score_func == 'softmax' else 2


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


# -----------------------------------------------------------------------------
# each router's selection in the model (training, causal evaluation, decoding with a cache), and its state

def seqtopk_select(router, scores, cache, causal):
    """Offline SeqTopK in training; the online rule when causal (each token against the ones before it,
    the Expert Cache holding those in decoding); a prompt routed jointly (cache, not causal) is offline."""
    cfg = router.config
    bounds = (cfg.top_k, cfg.seq_min_k, cfg.seq_max_k or None)
    if cache is None and not causal:
        return seqtopk_mask(scores, *bounds)
    past, spent, n_past = (None, None, None) if cache is None else (cache.past_scores(scores.shape[1]), cache.spent,
                                                                    cache.count)
    if causal:
        mask, candidates, spent = online_seqtopk_mask(scores, *bounds, past, spent, strict=cfg.seq_budget == 'strict',
                                                      n_past=n_past)
    else:
        mask = seqtopk_mask(scores, *bounds)
        min_k, max_k = seqtopk_bounds(cfg.top_k, cfg.n_exp, cfg.seq_min_k, cfg.seq_max_k or None)
        candidates = scores.topk(max_k, dim=-1).values[..., min_k:]
        spent = mask.sum(dim=(1, 2)) + (0 if spent is None else spent)
    if cache is not None:  # the Expert Cache: every token's candidate scores, and the experts spent
        cache.write_scores(candidates, spent)
    return mask


def batchtopk_select(router, scores, cache, causal):
    """Training: the batch's top B*T*k, and the threshold follows the smallest selected score (an EMA);
    evaluation and generation: that threshold, so a sequence never depends on the rest of the batch."""
    if not router.training:
        return threshold_mask(scores, router.threshold)
    mask = batchtopk_mask(scores, router.config.top_k)
    with torch.no_grad():
        smallest = scores.masked_fill(~mask, float('inf')).min()
        decay = torch.where(router.threshold > 0, router.config.threshold_decay, 0.0)
        router.threshold.copy_(decay * router.threshold + (1 - decay) * smallest)
    return mask


def relu_route(router, logits):
    """ReMoE's gates straight from the logits; in training, record the active fraction for relu_step."""
    weights = relu_gates(logits, router.threshold)
    mask = weights > 0
    if router.training:
        with torch.no_grad():
            router.active_sum.add_(mask.float().mean())
            router.active_count.add_(1)
    return mask, weights


def balance_loss(router, logits, scores, mask, weights):
    """The auxiliary loss of the routers that rank scores: the router z-loss, plus with balance='aux' the
    Switch load-balance loss (on the scores normalised per token, for sigmoid scores)."""
    cfg = router.config
    loss = 0.0
    if cfg.balance == 'aux':
        probs = scores if cfg.score_func == 'softmax' else scores / scores.sum(dim=-1, keepdim=True)
        loss = cfg.aux_loss_weight * switch_balance(probs, mask, router.budget())
    return loss + cfg.z_loss_weight * logits.logsumexp(dim=-1).square().mean()


@torch.no_grad()
def bias_step(routers):
    # Auxiliary-loss-free balancing (DeepSeek-V3): after every step each expert's bias moves by balance_rate
    # toward an even load, up if it took fewer tokens than the mean expert, down if more.
    """From the tokens each expert took in the step's training forwards (then cleared); none: no change."""
    for router in routers:
        load = router.expert_load
        router.expert_bias.add_(router.config.balance_rate * torch.sign(load.mean() - load))
        load.zero_()


def relu_loss(router, logits, scores, mask, weights):
    # ReMoE's one regulariser, also its load balancer: lambda * the Switch formula on the gates (no
    # z-loss: pulling logits down would close every ReLU gate; no softmax balance loss)
    return router.l1_coef.clone() * switch_balance(weights, mask, router.config.top_k)


@torch.no_grad()
def relu_step(routers):
    """Once per optimizer step (after the ranks' router state is averaged), from the active fractions
    the layers measured in the training forwards since the last step (then cleared): lambda from each
    layer's own (ReMoE: from their mean over every MoE layer, one lambda), and each layer's ReLU
    threshold from its own. Nothing measured (no training forward): nothing changes."""
    cfg = routers[0].config
    for group in ([[r] for r in routers] if cfg.relu_l1_per_layer else [routers]):
        count = sum(r.active_count for r in group)
        active = sum(r.active_sum for r in group) / count.clamp_min(1)
        l1_coef = torch.where(count > 0, next_relu_coef(group[0].l1_coef, active, cfg.top_k, cfg.n_exp,
                                                        cfg.relu_l1_step), group[0].l1_coef)  # no host sync
        for router in group:
            router.l1_coef.copy_(l1_coef)
    for router in routers:
        active = router.active_sum / router.active_count.clamp_min(1)
        router.threshold.copy_(torch.where(router.active_count > 0, next_relu_threshold(
            router.threshold, active, cfg.top_k, cfg.n_exp, cfg.relu_threshold_step), router.threshold))
        router.active_sum.zero_()
        router.active_count.zero_()


def relu_check(cfg):
    if cfg.balance == 'bias':
        raise ValueError("--balance=bias needs a router that ranks scores; relu balances through its own "
                         "regulariser (use --balance=aux)")


def seqtopk_check(cfg):
    """The per-token bounds must contain top_k, so that a sequence can spend exactly T*top_k."""
    max_k = cfg.seq_max_k or cfg.top_k + 2
    if cfg.seq_min_k > cfg.top_k:
        raise ValueError(f"--seq_min_k={cfg.seq_min_k} must be at most --top_k={cfg.top_k} "
                         f"(the per-token bounds must contain top_k)")
    if max_k < cfg.top_k:
        raise ValueError(f"--seq_max_k={cfg.seq_max_k} must be 0 (= top_k + 2) or at least --top_k={cfg.top_k} "
                         f"(the per-token bounds must contain top_k)")


# One row per router: everything the model and train.py need to know of it.
#   select(router, scores, cache, causal) -> mask, from the softmax scores; or
#   route(router, logits) -> (mask, gates), for a router whose gates are not the selected scores (relu)
#   exact(router, causal): the selection takes exactly top_k pairs per token (the current k in training),
#     known before it runs, so the dispatch has static shapes and never waits on the device
#   slots(router): the most experts one token takes in a decoding step (None: no bound worth using), so
#     that a decoding step runs with static shapes too
#   draw(k, n_layers, generator): each MoE layer's k for one training step (default: top_k)
#   loss(router, logits, scores, mask, gates): the auxiliary loss (default: balance_loss)
#   step(routers): a step rule, once per optimizer step, over every MoE layer's router
#   state: the buffers it keeps (saved in checkpoints, averaged over DDP ranks after every step)
#   calibrate(router): whether an evaluation-only run must first set its state from training batches
#   online: it routes a token differently when it may see only the tokens before it (causal evaluation)
#   check(config): ValueError for settings it cannot route with (besides 1 <= top_k <= n_exp)
Spec = namedtuple('Spec', 'select route exact slots draw loss step state calibrate online check',
                  defaults=(None, None, lambda router, causal: False, lambda router: None, None, None, None, (), None,
                            False, None))
ROUTERS = {
    'topk': Spec(select=lambda router, scores, cache, causal: topk_mask(scores, router.budget()),
                 exact=lambda router, causal: True, slots=lambda router: router.config.top_k),
    # training: this step's draw (router.k); evaluation and generation: top_k
    'mrltopk': Spec(select=lambda router, scores, cache, causal: topk_mask(scores, router.budget()),
                    exact=lambda router, causal: True, slots=lambda router: router.config.top_k, draw=mrltopk_draw),
    'seqtopk': Spec(select=seqtopk_select, exact=lambda router, causal: not causal, online=True, check=seqtopk_check,
                    slots=lambda router: seqtopk_bounds(router.config.top_k, router.config.n_exp, router.config.seq_min_k,
                                                        router.config.seq_max_k or None)[1]),
    'batchtopk': Spec(select=batchtopk_select, exact=lambda router, causal: router.training, state=('threshold',),
                      calibrate=lambda router: bool(router.threshold <= 0)),
    'relu': Spec(route=relu_route, loss=relu_loss, step=relu_step, check=relu_check,
                 state=('threshold', 'l1_coef', 'active_sum', 'active_count')),
}


def check_router(cfg):
    """ValueError with a one-line, actionable message for router settings that cannot work."""
    if cfg.router not in ROUTERS:
        raise ValueError(f"unknown router '{cfg.router}': choose one of {', '.join(ROUTERS)}")
    if not cfg.top_k <= cfg.n_exp:
        raise ValueError(f"--top_k={cfg.top_k} must be at most --n_exp={cfg.n_exp}")
    if ROUTERS[cfg.router].check:
        ROUTERS[cfg.router].check(cfg)


def step_budgets(cfg, n_layers, generator=None):
    """Each MoE layer's k for one training step, as plain ints: the router's draw (a seeded generator
    makes it a function of the step), else top_k for every layer."""
    draw = ROUTERS[cfg.router].draw
    return draw(cfg.top_k, n_layers, generator) if draw else [cfg.top_k] * n_layers


def step_rules(routers):
    """Once per optimizer step: the routers' step rule, if theirs has one, and the balance bias's."""
    if routers and ROUTERS[routers[0].config.router].step:
        ROUTERS[routers[0].config.router].step(routers)
    if routers and routers[0].config.balance == 'bias':
        bias_step(routers)


class Router(nn.Module):
    """Token features (B, T, C) -> mask (B, T, N), gate weights (B, T, N), scores, auxiliary loss.

    config fields used: n_embd, n_exp, router, top_k, score_func, route_scale, norm_topk_prob, balance,
    balance_rate, aux_loss_weight, z_loss_weight, and the router's own (seq_*, threshold_decay, relu_*).
    """

    def __init__(self, config):
        super().__init__()
        check_router(config)
        self.config = config
        self.spec = ROUTERS[config.router]
        self.gate = nn.Linear(config.n_embd, config.n_exp, bias=False)
        self.k = config.top_k  # experts per token in this training step (a draw can change it per step)
        # the state a router may keep (its row's `state`); every router has the buffers, so that every
        # checkpoint has the same keys. batchtopk: EMA of the smallest selected score in training (0 = not
        # yet seen a batch); relu: the logit at which this layer's ReLU gates open (0 = ReMoE's ReLU),
        # ReMoE's regulariser coefficient lambda (this layer's, or one value for the whole model, each layer
        # a copy), and the sum and count of the active fractions since relu_step last ran
        self.register_buffer('threshold', torch.zeros(()))
        self.register_buffer('l1_coef', torch.tensor(float(config.relu_l1_init)))
        self.register_buffer('active_sum', torch.zeros(()))
        self.register_buffer('active_count', torch.zeros(()))
        # balance='bias': each expert's bias, added to the scores to choose experts (never to the gates), and
        # the tokens each expert took in training since bias_step last ran
        self.register_buffer('expert_bias', torch.zeros(config.n_exp))
        self.register_buffer('expert_load', torch.zeros(config.n_exp))
        self.route_scale = config.route_scale or auto_route_scale(config)

    def budget(self):
        """Experts per token this layer routes with now: this step's k in training, else top_k."""
        return self.k if self.training else self.config.top_k

    def fixed_pairs(self, n_tokens, causal=False):
        """How many (token, expert) pairs the selection of n_tokens makes, when that is known before it
        runs (the exact budgets), else None. The dispatch then runs with static shapes and no sync."""
        return n_tokens * self.budget() if self.spec.exact(self, causal) else None

    def slots(self):
        """The most experts one token takes in a decoding step, if the router bounds it (else None)."""
        return self.spec.slots(self)

    def state(self):
        """The buffers this router keeps up to date (its row's state, and the balance bias with the load it
        is stepped from): averaged over DDP ranks, logged."""
        names = self.spec.state + (('expert_bias', 'expert_load') if self.config.balance == 'bias' else ())
        return {name: getattr(self, name) for name in names}

    def needs_calibration(self):
        return bool(self.spec.calibrate and self.spec.calibrate(self))

    def forward(self, x, cache=None, causal=False):
        """cache: this layer's dict in a generation's Cache (decoding: no auxiliary loss, nothing to
        train); causal: route by the online rule (each token against the tokens before it), for the
        routers that have one, rather than the whole sequence."""
        cfg = self.config
        # fp32 even under autocast: ranking near-tied scores must not depend on bf16 rounding
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.softmax(dim=-1) if cfg.score_func == 'softmax' else logits.sigmoid()
        if self.spec.route:
            mask, weights = self.spec.route(self, logits)
        else:  # balance='bias': the bias decides which experts a token takes, never how much they weigh
            choice = scores + self.expert_bias if cfg.balance == 'bias' else scores
            mask = self.spec.select(self, choice, cache, causal)
            weights = routing_weights(scores, mask, cfg.norm_topk_prob, self.route_scale)
            if cfg.balance == 'bias' and self.training:
                with torch.no_grad():
                    self.expert_load.add_(mask.sum(dim=(0, 1)))
        aux_loss = 0.0
        if cache is None:
            aux_loss = (self.spec.loss or balance_loss)(self, logits, scores, mask, weights)
        return mask, weights, scores, aux_loss
