"""
The routers of "Route Expert by Sequence, Not by Token" (SeqTopK, arXiv 2511.06494) as
the paper writes them: scores (B, T, N) (B sequences of T tokens, N experts) to a mask
(B, T, N), True where a token takes an expert; the gates and losses; a class per router.
"""
import torch
import torch.nn as nn
from torch.nn import functional as F


def topk_mask(scores, k):
    """Eq. (3), TopK: each token takes its own k highest-scoring experts."""
    idx = scores.topk(k, dim=-1).indices  # (B, T, k)
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)


def top_entries(values, n):
    """Each row's n largest entries (..., L) as a mask, equal values to the earlier entry:
    those above the n-th largest value, then those equal to it while places are left."""
    if n == 0:
        return torch.zeros_like(values, dtype=torch.bool)
    nth = values.topk(n, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # (..., 1)
    above, tied = values > nth, values == nth  # the tied ones while places are left:
    return above | (tied & (tied.cumsum(dim=-1) <= n - above.sum(dim=-1, keepdim=True)))


def seqtopk_bounds(k, n_exp, min_k=1, max_k=None):
    """The per-token bounds (min_k, max_k) checked, by default the paper's (1, k + 2):
    they contain k; a max_k of 0 or None is k + 2, one of n_exp or more no bound."""
    max_k = min(max_k or k + 2, n_exp)
    if not 1 <= k <= n_exp:
        raise ValueError(f"--top_k={k} must be between 1 and --n_exp={n_exp}")
    if min_k > k:
        raise ValueError(f"--seq_min_k={min_k} must be at most --top_k={k}")
    if max_k < k:
        raise ValueError(f"--seq_max_k={max_k} must be 0 (top_k + 2) or at least --top_k={k}")
    return min_k, max_k


def seqtopk_mask(scores, k, min_k=1, max_k=None):
    """Eq. (5), SeqTopK: of each sequence's T x N scores the top T*k entries, every token
    taking between min_k and max_k experts (seqtopk_bounds)."""
    B, T, N = scores.shape
    min_k, max_k = seqtopk_bounds(k, N, min_k, max_k)
    ranked, order = scores.topk(max_k, dim=-1)  # (B, T, max_k): each token's best first
    floor = torch.ones_like(ranked[..., :min_k], dtype=torch.bool)  # 1. its best min_k;
    # 2. the other T*(k - min_k) places to the best entries a token may still take (its
    #    ranks min_k..max_k-1; ties: earlier token, better rank). Best total: a swap up within
    #    a token never lowers it, so a token's extras are a run of its ranks (brute-forced).
    R = max_k - min_k
    extra = top_entries(ranked[..., min_k:].reshape(B, T * R), T * (k - min_k))  # (B, T*R)
    taken = torch.cat([floor, extra.view(B, T, R)], dim=-1)  # (B, T, max_k): by rank
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, taken)


def expert_cache_rows(scores, min_k, max_k):
    """Eq. (6), the Expert Cache keeps the scores of every token so far; here those that
    can still compete: each token's ranks min_k..max_k-1 (..., R = max_k - min_k)."""
    return scores.topk(max_k, dim=-1).values[..., min_k:]


def online_seqtopk_token(S, k, min_k, spent=None):
    """Eq. (7), online SeqTopK: token m's experts by rank (B, max_k), from S (B, m, R),
    the Expert Cache of tokens 1..m (Eq. 6), its row last. As Eq. (5) over them: each
    takes its best min_k, the other m*(k - min_k) places go to S's top entries (ties: the
    earlier token). spent (B,) given (strict budget): tokens 1..m take at most m*k."""
    B, m, R = S.shape
    won = top_entries(S.reshape(B, m * R), m * (k - min_k))[:, -R:]  # (B, R): token m's
    taken = torch.cat([won.new_ones(B, min_k), won], dim=-1)  # (B, max_k): by rank
    if spent is not None:  # its best ones, up to what is left of m*k
        taken &= torch.arange(min_k + R, device=S.device) < (m * k - spent)[:, None]
    return taken


def online_seqtopk(scores, k, min_k=1, max_k=None, strict=False, cached=None, spent=None):
    """Eq. (7) for T tokens (B, T, N) in turn, each against the Expert Cache before it:
    cached (B, P, R) of P earlier tokens (default none) that took spent (B,); strict: m
    tokens take at most m*k. The mask (B, T, N), and S (B, P + T, R): cached, new rows."""
    B, T, N = scores.shape
    min_k, max_k = seqtopk_bounds(k, N, min_k, max_k)
    ranked, order = scores.topk(max_k, dim=-1)  # (B, T, max_k): each token's best first
    rows = ranked[..., min_k:]  # (B, T, R): ranks min_k..max_k-1 (expert_cache_rows)
    S = rows if cached is None else torch.cat([cached, rows], dim=1)  # (B, P + T, R)
    spent = rows.new_zeros(B, dtype=torch.long) if spent is None else spent
    taken = []
    for m in range(S.shape[1] - T + 1, S.shape[1] + 1):  # token m against S's rows 1..m
        taken.append(online_seqtopk_token(S[:, :m], k, min_k, spent if strict else None))
        spent = spent + taken[-1].sum(-1)
    taken = torch.stack(taken, dim=1)  # (B, T, max_k): each token's experts by rank
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, taken), S


def online_seqtopk_mask(scores, k, min_k=1, max_k=None, strict=False, cached=None, spent=None):
    """online_seqtopk's mask and, of S, the new tokens' rows (B, T, R)."""
    mask, S = online_seqtopk(scores, k, min_k, max_k, strict, cached, spent)
    return mask, S[:, S.shape[1] - scores.shape[1]:]


def batchtopk_mask(scores, k):
    """BatchTopK (Bussmann et al.), in training: the top B*T*k entries of the batch."""
    B, T, N = scores.shape
    return top_entries(scores.reshape(-1), B * T * k).view(B, T, N)


def windowtopk_mask(scores, k, floor=1):
    """SeqTopK as the paper's pretraining code selects (ReMoE-ts): Megatron's scores (T, B, N)
    as rows t*B + b, viewed as B windows of T rows (T/B positions of all B sequences); a
    window's top T*k entries, each token's own top `floor` added."""
    B, T, N = scores.shape
    windows = scores.transpose(0, 1).reshape(B, T * N)  # (B windows, T*N): rows t*B + b
    mask = top_entries(windows, T * k).view(T, B, N).transpose(0, 1)  # (B, T, N)
    return mask.contiguous() | topk_mask(scores, floor)


def mrltopk_ks(k):
    """MRL-TopK's k's: 2, 4, ... up to k, and k itself (k=6: 2, 4, 6); k=1: just 1."""
    ks = [2 ** i for i in range(1, k.bit_length())]
    return ks + [k] if k not in ks else ks


def mrltopk_draw(k, n_layers, generator=None):
    """MRL-TopK (appendix, fine-tuning): each layer's k ~ Uniform{2^1..2^log2 K}."""
    draws = torch.randint(len(mrltopk_ks(k)), (n_layers,), generator=generator)
    return [mrltopk_ks(k)[i] for i in draws.tolist()]  # plain ints: static shapes


# -----------------------------------------------------------------------------
# gates and the balance loss

def routing_weights(scores, mask, renormalize=False, scale=1.0):
    """The gates: scale x the selected scores (renormalize: per token first; else a token
    given more experts gets more gate mass, which SeqTopK relies on)."""
    weights = scores * mask
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-9)
    return scale * weights


def switch_balance(probs, mask, k):
    """Switch balance (Fedus et al.): N sum_e mean_t(p_e) tokens_e / (tokens k)."""
    probs, mask = probs.flatten(0, -2), mask.flatten(0, -2)
    tokens_per_expert = mask.sum(0).to(probs.dtype)  # counts: no gradient flows through
    N, M = probs.shape[-1], mask.shape[0]
    return N * (probs.mean(0) * tokens_per_expert).sum() / (M * k)


# -----------------------------------------------------------------------------
# the routers in the model: what each one changes of the base

class Router(nn.Module):
    """Token features (B, T, C) -> mask, gates, scores (each (B, T, N)), aux loss, Expert
    Cache S (`decide`). It says how it selects (`select`), what it spends (`budget`)."""
    online = False  # it has an online rule (decide): a token sees only the earlier ones
    per_step_k = False  # it trains with each step's k (draw, train.py's k_schedule)
    draws_k = False  # that k drawn at random each step (a shape per draw)

    def __init__(self, config):
        super().__init__()
        self.check(config)
        self.config = config
        self.gate = nn.Linear(config.n_embd, config.n_exp, bias=False)
        # route_scale=0: each selected gate ~1 at init (near-uniform scores), so the MoE
        # output starts on a dense FFN's scale (results/README.md, "The gate scale")
        near_uniform = config.top_k if config.norm_topk_prob else dict(  # relu: ReMoE's
            softmax=config.n_exp, sigmoid=2, relu=1)[config.score_func]
        self.route_scale = config.route_scale or near_uniform
        self.k = config.top_k  # per_step_k: this training step's k (GPT.forward sets it)
        if config.balance == 'bias':  # a bias on the choice (never the gates); the load
            self.register_buffer('expert_bias', torch.zeros(config.n_exp))
            self.register_buffer('expert_load', torch.zeros(config.n_exp))

    @staticmethod
    def check(config):
        """ValueError, in the command line's words, for settings it cannot route with."""

    def forward(self, x, past=None, online=False):
        """past: decoding, the layer's Expert Cache so far (LayerCache.expert_past),
        no aux loss then; online: by the online rule, for the routers with one."""
        cfg = self.config
        with torch.autocast(x.device.type, enabled=False):  # fp32: near-ties rank alike
            logits = F.linear(x.float(), self.gate.weight.float())  # (B, T, N)
        scores = (logits.softmax(dim=-1) if cfg.score_func == 'softmax' else
                  logits.sigmoid() if cfg.score_func == 'sigmoid' else logits.relu())
        mask, gates, S = self.route(logits, scores, past, online)
        aux = 0.0 if past is not None else self.aux_loss(logits, scores, mask, gates)
        return mask, gates, scores, aux, S

    def route(self, logits, scores, past, online):
        cfg = self.config
        mask, S = self.decide(self.choice(scores), past, online)
        if cfg.balance == 'bias' and self.training:
            self.expert_load.add_(mask.sum(dim=(0, 1)))
        return mask, routing_weights(scores, mask, cfg.norm_topk_prob, self.route_scale), S

    def choice(self, scores):
        """What the router ranks: the scores plus the balancing bias (balance='bias'). A NaN
        score (a diverging run) ranks last: budgets are still spent; the NaN loss stops it."""
        choice = scores + self.expert_bias if self.config.balance == 'bias' else scores
        return choice.masked_fill(choice.isnan(), float('-inf'))

    def select(self, choice):  # choice (B, T, N) -> mask (B, T, N)
        raise NotImplementedError

    def decide(self, choice, past, online):  # the mask and the Expert Cache S (Eq. 6):
        return self.select(choice), None  # a router with an online rule's, given past

    def current_k(self):  # experts per token now: top_k, or this training step's k
        return self.k if self.training and self.per_step_k else self.config.top_k

    def budget(self):  # experts a token, on average, known before the data in this mode
        return None  # (training or evaluation); None: the data decides

    most_k = budget  # the most experts one token takes in this mode (None: no bound)

    def spend(self):  # experts a token takes in training on average: (least, most)
        return self.config.top_k, self.config.top_k

    @staticmethod
    def draw(k, n_layers, generator=None):  # each MoE layer's k for one training step
        return [k] * n_layers

    def needs_calibration(self):  # evaluation must first set its state on training data
        return False

    def aux_loss(self, logits, scores, mask, gates):
        """The router z-loss, plus with balance='aux' the Switch balance loss over what a
        token spends (scores normalised per token, for sigmoid and relu scores)."""
        cfg = self.config
        loss = cfg.z_loss_weight * logits.logsumexp(dim=-1).square().mean()
        if cfg.balance == 'aux':
            probs = scores if cfg.score_func == 'softmax' else (  # relu: a row may be 0
                scores / scores.sum(-1, keepdim=True).clamp_min(1e-9))
            spent = self.budget() or mask.sum(-1).float().mean()  # experts a token took
            balance = switch_balance(probs, mask, spent)
            loss = cfg.aux_loss_weight * balance + loss
        return loss

    @classmethod
    @torch.no_grad()
    def after_step(cls, routers):
        """Per optimizer step, loss-free balancing (DeepSeek-V3): to an even load."""
        for router in routers if routers[0].config.balance == 'bias' else ():
            load = router.expert_load
            router.expert_bias.add_(router.config.balance_rate * torch.sign(load.mean() - load))
            load.zero_()


class TopK(Router):
    """TopK: each token its own k best experts (Eq. 3)."""
    per_step_k = True

    def select(self, choice):
        return topk_mask(choice, self.current_k())

    def budget(self):
        return self.current_k()

    most_k = budget


class MRLTopK(TopK):
    """MRL-TopK, the paper's fine-tuning baseline: topk, each layer's k drawn a step."""
    draw, draws_k = staticmethod(mrltopk_draw), True

    def spend(self):  # the mean of its draws
        return (sum(ks := mrltopk_ks(self.config.top_k)) / len(ks),) * 2


class SeqTopK(Router):
    """SeqTopK (Eq. 5) in training; online (causal evaluation, decoding) Eq. 7, token by
    token against the Expert Cache (the MoE layer reads it and appends to it)."""
    online = True

    def __init__(self, config):
        super().__init__(config)
        self.min_k, self.max_k = self.check(config)  # per-token bounds, resolved once
        self.online_rule = online_seqtopk  # fast.paths: by counting, the same masks

    @staticmethod
    def check(cfg):  # its per-token bounds, checked
        return seqtopk_bounds(cfg.top_k, cfg.n_exp, cfg.seq_min_k, cfg.seq_max_k)

    def select(self, choice):  # Eq. 5: the whole sequence at once
        return seqtopk_mask(choice, self.config.top_k, self.min_k, self.max_k)

    def budget(self):  # T*k a sequence, unless it trains by the online rule
        return self.config.top_k if self.training and not self.config.seq_causal else None

    def most_k(self):
        return self.max_k

    def decide(self, choice, past, online):
        strict, k = self.config.seq_budget == 'strict', self.config.top_k
        if online:  # Eq. 7, after the Expert Cache past
            return self.online_rule(choice, k, self.min_k, self.max_k, strict, *(past or ()))
        # Eq. 5 at once; with an Expert Cache (a prompt routed jointly) it keeps the rows
        S = None if past is None else expert_cache_rows(choice, self.min_k, self.max_k)
        return self.select(choice), S


class BatchTopK(Router):
    """Training: the batch's top B*T*k, a threshold following the smallest selected score
    (an EMA a step); evaluation and decoding: the scores above it (never the batch's)."""

    def __init__(self, config):
        super().__init__(config)
        # calibrated: 1 once a step set threshold; smallest_*: since the last step
        for name in ('threshold', 'calibrated', 'smallest_sum', 'smallest_count'):
            self.register_buffer(name, torch.zeros(()))

    def select(self, choice):
        if not self.training:
            return choice > self.threshold
        mask = batchtopk_mask(choice, self.config.top_k)
        self.smallest_sum.add_(choice.detach().masked_fill(~mask, float('inf')).min())
        self.smallest_count.add_(1)
        return mask

    def budget(self):  # B*T*k a batch in training; evaluation: the threshold's
        return self.config.top_k if self.training else None

    def needs_calibration(self):
        return not self.calibrated

    @classmethod
    @torch.no_grad()
    def after_step(cls, routers):
        # any value is a threshold (balance='bias' or relu scores: <= 0 too): a flag says
        # one was set. Under DDP the sums are the ranks' means: N processes step as one
        for router in routers:
            if router.smallest_count > 0:
                decay = router.config.threshold_decay * router.calibrated
                router.threshold.lerp_(router.smallest_sum / router.smallest_count, 1 - decay)
                router.calibrated.fill_(1.0)
            router.smallest_sum.zero_()
            router.smallest_count.zero_()
        super().after_step(routers)


class WindowTopK(SeqTopK):
    """The paper's pretraining code's SeqTopK (windowtopk_mask) in training and offline. Its
    windows see later tokens and other sequences: causal evaluation and decoding route by
    the online rule (Eq. 7), with its floor and no upper bound."""

    @staticmethod
    def check(c):  # the floor above K: online routing could not keep it
        if not c.window_floor <= c.top_k:
            raise ValueError(f"--window_floor={c.window_floor} must be at most --top_k={c.top_k}")
        return seqtopk_bounds(c.top_k, c.n_exp, c.window_floor, c.n_exp)

    def select(self, choice):
        return windowtopk_mask(choice, self.config.top_k, self.config.window_floor)

    budget = most_k = Router.budget  # no budget known; online, no bound

    def spend(self):  # the windows' T*k, each token's floor added on top (at most)
        return self.config.top_k, self.config.top_k + self.config.window_floor


class ReLU(Router):
    """ReMoE: gates = ReLU(logits), steered to top_k experts a token on average by an L1
    penalty with an adaptive lambda."""

    def __init__(self, config):
        super().__init__(config)
        for name in ('threshold', 'active_sum', 'active_count'):
            self.register_buffer(name, torch.zeros(()))
        self.register_buffer('l1_coef', torch.tensor(float(config.relu_l1_init)))

    @staticmethod
    def check(config):
        if config.balance == 'bias':
            raise ValueError("--balance=bias needs a router that ranks scores; relu "
                             "balances through its own regulariser (use --balance=aux)")

    def route(self, logits, scores, past, online):
        gates = F.relu(logits - self.threshold)  # a layer's threshold <= 0 (ReMoE's: 0)
        mask = gates > 0
        if self.training:
            self.active_sum.add_(mask.float().mean())  # a mask: no gradient
            self.active_count.add_(1)
        return mask, gates, None

    def aux_loss(self, logits, scores, mask, gates):
        # ReMoE's one regulariser and balancer: lambda x the Switch formula on the gates
        return self.l1_coef.clone() * switch_balance(gates, mask, self.config.top_k)

    @classmethod
    @torch.no_grad()
    def after_step(cls, routers):
        """Each layer's lambda (relu_l1_per_layer=False: one, as ReMoE) and threshold,
        from the active fractions since the last step."""
        cfg = routers[0].config
        target = cfg.top_k / cfg.n_exp
        for group in [[r] for r in routers] if cfg.relu_l1_per_layer else [routers]:
            count = sum(r.active_count for r in group)
            active = sum(r.active_sum for r in group) / count.clamp_min(1)
            # ReMoE's controller (thu-ml/ReMoE, training.py): lambda x factor when the
            # active fraction is above K/N (too dense), / factor else; in [1e-12, 1e3]
            factor = torch.where(active > target, cfg.relu_l1_step, 1 / cfg.relu_l1_step)
            coef = (group[0].l1_coef * factor).clamp(1e-12, 1e3)
            for router in group:
                router.l1_coef.copy_(torch.where(count > 0, coef, router.l1_coef))
        for router in routers:
            # not in ReMoE, whose lambda only shuts gates: a too-sparse layer reopens,
            # its threshold falling by relu_threshold_step x (active - K/N) / (K/N)
            active = router.active_sum / router.active_count.clamp_min(1)
            step = cfg.relu_threshold_step * (active - target) / target
            threshold = (router.threshold + step).clamp(max=0.0)
            router.threshold.copy_(threshold.where(router.active_count > 0, router.threshold))
            router.active_sum.zero_()
            router.active_count.zero_()


# A new router: its selection as a function above, a class for what differs, a row here
ROUTERS = dict(topk=TopK, mrltopk=MRLTopK, seqtopk=SeqTopK, batchtopk=BatchTopK,
               relu=ReLU, windowtopk=WindowTopK)


def step_ks(cfg, n_layers, generator=None):
    """Each MoE layer's k for one training step, plain ints (the scripts draw them)."""
    return ROUTERS[cfg.router].draw(cfg.top_k, n_layers, generator)
