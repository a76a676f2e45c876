"""
The routers of "Route Expert by Sequence, Not by Token" (SeqTopK), as the paper writes them: each
maps scores (B, T, N) (B sequences of T tokens, N experts; softmax of the router logits) to a
mask (B, T, N), True where a token takes an expert. Then the gates and losses, then a small
class per router: what the model asks of it. fast.py computes the online rule faster.
"""
import torch
import torch.nn as nn
from torch.nn import functional as F

import fast


def topk_mask(scores, k):
    # Eq. (3), TopK routing: each token takes its own k highest-scoring experts.
    idx = scores.topk(k, dim=-1).indices  # (B, T, k)
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)


def top_entries(values, n):
    """Each row's n largest entries (..., L), ties to the earlier (fast.top_entries: no sort)."""
    order = values.sort(dim=-1, descending=True, stable=True).indices[..., :n]
    return torch.zeros_like(values, dtype=torch.bool).scatter_(-1, order, True)


def seqtopk_bounds(k, n_exp, min_k=1, max_k=None):
    """The per-token bounds (min_k, max_k), by default the paper's (1, k + 2), containing k."""
    max_k = min(k + 2 if max_k is None else max_k, n_exp)  # max_k >= n_exp: no upper bound
    if not 1 <= k <= n_exp:
        raise ValueError(f"--top_k={k} must be between 1 and --n_exp={n_exp}")
    if min_k > k:
        raise ValueError(f"--seq_min_k={min_k} must be at most --top_k={k} (bounds contain top_k)")
    if max_k < k:
        raise ValueError(f"--seq_max_k={max_k} must be 0 (= top_k + 2) or at least --top_k={k}")
    return min_k, max_k


def seqtopk_mask(scores, k, min_k=1, max_k=None):
    # Eq. (5), SeqTopK routing: the top T*k entries of each sequence's T x N score matrix,
    # with every token taking between min_k and max_k experts.
    B, T, N = scores.shape
    min_k, max_k = seqtopk_bounds(k, N, min_k, max_k)
    # A token can only take its best max_k (ranked as torch.topk ranks them) and always takes its
    # first min_k; the rest of the budget goes to the best of the other ranks across the sequence,
    # ties to the earlier token. Scores fall with rank, so this greedy pick is the best total.
    ranked, order = scores.topk(max_k, dim=-1)  # (B, T, max_k)
    extra = fast.top_entries(ranked[..., min_k:].reshape(B, -1), T * (k - min_k))
    taken = torch.cat([torch.ones_like(ranked[..., :min_k], dtype=torch.bool),
                       extra.view(B, T, -1)], dim=-1)  # (B, T, max_k): by rank
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, taken)


def online_seqtopk_mask(scores, k, min_k=1, max_k=None, strict=False):
    # Eq. (7), online SeqTopK: token m takes (m, i) when it is among the top m*k entries of the
    # m x N scores of tokens 1..m, i.e. its row of SeqTopK (Eq. 5) over the prefix.
    """strict=True also caps token m at m*k minus what tokens 1..m-1 took: no prefix overspends."""
    B, T, N = scores.shape
    min_k, max_k = seqtopk_bounds(k, N, min_k, max_k)
    order = scores.topk(max_k, dim=-1).indices  # (B, T, max_k): each token's experts by rank
    mask, spent = torch.zeros_like(scores, dtype=torch.bool), torch.zeros(B, dtype=torch.long)
    for m in range(1, T + 1):
        count = seqtopk_mask(scores[:, :m], k, min_k, max_k)[:, -1].sum(-1)  # (B,)
        if strict:
            count = torch.minimum(count, m * k - spent)
        spent = spent + count
        mask[:, m - 1].scatter_(-1, order[:, m - 1], torch.arange(max_k) < count[:, None])
    return mask


def expert_cache_rows(scores, min_k, max_k):
    """What the Expert Cache keeps of each token (B, T, max_k - min_k): its scores of rank min_k..
    max_k-1 (its best min_k are always taken, those past max_k never: only these can compete)."""
    return scores.topk(max_k, dim=-1).values[..., min_k:]


def mrltopk_budgets(k):
    """MRL-TopK's k's: 2, 4, ... up to k, and k itself (k=6: 2, 4, 6); k=1: just 1."""
    budgets = [2 ** i for i in range(1, k.bit_length())]
    return budgets + [k] if k not in budgets else budgets


@torch.compiler.disable  # eagerly: compiled, the layer count may be symbolic, which randint refuses
def mrltopk_draw(k, n_layers, generator=None):
    # MRL-TopK (appendix, fine-tuning setting): each layer's k ~ Uniform{2^1 .. 2^log2 K} per step.
    draws = torch.randint(len(mrltopk_budgets(k)), (n_layers,), generator=generator)
    return [mrltopk_budgets(k)[i] for i in draws.tolist()]  # plain ints: static shapes


def windowtopk_mask(scores, k, floor=1):
    # SeqTopK as the paper's pretraining code selects (ReMoE-ts, moe_utils.py,
    # sp_topk_softmax_with_capacity): Megatron's sequence-first scores (T, B, N), flattened to rows
    # t*B + b and viewed as B "sequences" of T rows, so each window holds T/B consecutive positions
    # of all B sequences; the window's top T*k entries, then each token's own top `floor` added,
    # no upper bound (a layer can spend more than T*k).
    B, T, N = scores.shape
    windows = scores.transpose(0, 1).reshape(B, T * N)  # (B windows, T*N), sequence-first rows
    mask = fast.top_entries(windows, T * k).view(T, B, N).transpose(0, 1).contiguous()  # (B, T, N)
    return mask | topk_mask(scores, floor)


def batchtopk_mask(scores, k):
    # BatchTopK (Bussmann et al.), training: the top B*T*k entries of the whole batch's scores.
    B, T, N = scores.shape
    return fast.top_entries(scores.reshape(-1), B * T * k).view(B, T, N)


# -----------------------------------------------------------------------------
# gates and the balance loss

def routing_weights(scores, mask, renormalize=False, scale=1.0):
    """The gates: scale x the selected scores, optionally renormalised per token first (not: a
    token given more experts gets more gate mass, which SeqTopK relies on)."""
    weights = scores * mask
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-9)
    return scale * weights


def switch_balance(probs, mask, k):
    # Switch load balance (Fedus et al.), as Megatron: N sum_e mean_t(p_e) tokens_e / (tokens * k);
    # ReMoE's L1 regulariser is this on the ReLU gates (thu-ml/ReMoE, ReLURouter).
    probs, mask = probs.flatten(0, -2), mask.flatten(0, -2)
    tokens_per_expert = mask.sum(0).to(probs.dtype)  # counts: no gradient flows through them
    return probs.shape[-1] * (probs.mean(0) * tokens_per_expert).sum() / (mask.shape[0] * k)


# -----------------------------------------------------------------------------
# the routers in the model: TopK, and each other router as what it changes

class Router(nn.Module):
    """TopK routing. Token features (B, T, C) -> mask, gates, scores (each (B, T, N)) and the
    auxiliary loss. config: n_embd, n_exp, top_k, score_func, route_scale, norm_topk_prob,
    balance (aux: Switch loss; bias: DeepSeek-V3's loss-free bias), and the router's own."""
    online = False  # it has an online rule, for a token that may see only the tokens before it
    per_step_k = True  # in training it routes with the k train.py gives each step (draw, k_schedule)

    def __init__(self, config):
        super().__init__()
        self.check(config)
        self.config = config
        self.gate = nn.Linear(config.n_embd, config.n_exp, bias=False)
        # route_scale=0: each selected gate ~1 at init, when the scores are near uniform, so the
        # MoE output starts on a dense FFN's scale (results/README.md, "The gate scale")
        near_uniform = config.top_k if config.norm_topk_prob else dict(
            softmax=config.n_exp, sigmoid=2, relu=1)[config.score_func]  # relu: ReMoE's gates
        self.route_scale = config.route_scale or near_uniform
        self.k = config.top_k  # experts per token in this training step (mrltopk draws it)
        if config.balance == 'bias':  # a bias on the choice (never the gates), and its load
            self.register_buffer('expert_bias', torch.zeros(config.n_exp))
            self.register_buffer('expert_load', torch.zeros(config.n_exp))

    @classmethod
    def check(cls, config):
        """ValueError, in the command line's words, for settings this router cannot route with."""
        if not config.top_k <= config.n_exp:
            raise ValueError(f"--top_k={config.top_k} must be at most --n_exp={config.n_exp}")

    @staticmethod
    def draw(k, n_layers, generator=None):  # each MoE layer's k for one training step
        return [k] * n_layers

    def budget(self):
        """Experts per token now: this step's k in training, else top_k."""
        return self.k if self.training else self.config.top_k

    def select(self, scores, cache, online):
        return topk_mask(scores, self.budget())

    def pairs(self, n_tokens, online):
        """(token, expert) pairs of n_tokens when known in advance (None: counted, a host sync)."""
        return n_tokens * self.budget()

    def slots(self):  # the most experts one token takes in a decoding step (None: no bound)
        return self.config.top_k

    def needs_calibration(self):  # an evaluation-only run must first set its state in training
        return False

    def forward(self, x, cache=None, online=False):
        """cache: this layer's part of a generation's Cache (no auxiliary loss then); online: by
        the online rule, for the routers that have one, rather than the whole sequence."""
        cfg = self.config
        with torch.autocast(device_type=x.device.type, enabled=False):  # fp32: near-ties rank alike
            logits = F.linear(x.float(), self.gate.weight.float())  # (B, T, N)
        scores = (logits.softmax(dim=-1) if cfg.score_func == 'softmax' else
                  logits.sigmoid() if cfg.score_func == 'sigmoid' else logits.relu())
        mask, gates = self.route(logits, scores, cache, online)
        aux_loss = 0.0 if cache is not None else self.aux_loss(logits, scores, mask, gates)
        return mask, gates, scores, aux_loss

    def route(self, logits, scores, cache, online):
        cfg = self.config
        choice = scores + self.expert_bias if cfg.balance == 'bias' else scores
        mask = self.select(choice, cache, online)
        if cfg.balance == 'bias' and self.training:
            self.expert_load.add_(mask.sum(dim=(0, 1)))
        return mask, routing_weights(scores, mask, cfg.norm_topk_prob, self.route_scale)

    def aux_loss(self, logits, scores, mask, gates):
        """The router z-loss, plus with balance='aux' the Switch balance loss (on the scores
        normalised per token, for sigmoid and relu scores)."""
        cfg = self.config
        loss = cfg.z_loss_weight * logits.logsumexp(dim=-1).square().mean()
        if cfg.balance == 'aux':
            probs = scores if cfg.score_func == 'softmax' else (
                scores / scores.sum(-1, keepdim=True).clamp_min(1e-9))  # relu: a row may be all 0
            loss = cfg.aux_loss_weight * switch_balance(probs, mask, self.budget()) + loss
        return loss

    @classmethod
    @torch.no_grad()
    def step(cls, routers):
        # Auxiliary-loss-free balancing (DeepSeek-V3): after each step every expert's bias moves by
        # balance_rate toward an even load, up if it took fewer tokens than the mean expert.
        for router in routers if routers[0].config.balance == 'bias' else ():
            load = router.expert_load
            router.expert_bias.add_(router.config.balance_rate * torch.sign(load.mean() - load))
            load.zero_()


class MRLTopK(Router):
    """MRL-TopK, the paper's fine-tuning baseline: topk with each layer's k drawn every step."""
    draw = staticmethod(mrltopk_draw)


class SeqTopK(Router):
    """Offline SeqTopK in training; online (causal evaluation, decoding), the online rule, each
    token against the ones before it, kept in the Expert Cache while decoding."""
    online = True
    per_step_k = False

    @classmethod
    def check(cls, config):
        super().check(config)
        cls.bounds(config)

    @staticmethod
    def bounds(cfg):
        return seqtopk_bounds(cfg.top_k, cfg.n_exp, cfg.seq_min_k, cfg.seq_max_k or None)

    def select(self, scores, cache, online):
        cfg, (min_k, max_k) = self.config, self.bounds(self.config)
        if online:  # online_seqtopk_mask, computed fast against the Expert Cache
            past = (cache.expert_cache, cache.n_past(), cache.spent) if cache else (None,) * 3
            mask = fast.online_seqtopk_mask(scores, cfg.top_k, min_k, max_k, *past,
                                            strict=cfg.seq_budget == 'strict')
        else:
            mask = seqtopk_mask(scores, cfg.top_k, min_k, max_k)
        if cache is not None:
            cache.write_expert_cache(expert_cache_rows(scores, min_k, max_k), mask.sum(dim=(1, 2)))
        return mask

    def pairs(self, n_tokens, online):
        return None if online else n_tokens * self.budget()

    def slots(self):
        return self.bounds(self.config)[1]


class WindowTopK(Router):
    """The paper's pretraining code's SeqTopK (windowtopk_mask): windows across the batch's
    sequences, each token's top window_floor added to the window's T*k, no cap; the same in
    evaluation and decoding (no online rule)."""
    per_step_k = False

    @classmethod
    def check(cls, config):
        super().check(config)
        if not config.window_floor <= config.n_exp:
            raise ValueError(f"--window_floor={config.window_floor} must be at most "
                             f"--n_exp={config.n_exp}")

    def select(self, scores, cache, online):
        return windowtopk_mask(scores, self.config.top_k, self.config.window_floor)

    def pairs(self, n_tokens, online):
        return None

    def slots(self):
        return None


class BatchTopK(Router):
    """Training: the batch's top B*T*k, the threshold following the smallest selected score (an
    EMA); evaluation and decoding: that threshold, so a sequence never depends on the batch."""
    per_step_k = False

    def __init__(self, config):
        super().__init__(config)
        self.register_buffer('threshold', torch.zeros(()))  # 0: no training batch seen yet

    def select(self, scores, cache, online):
        if not self.training:  # every score above the threshold learnt in training
            return scores > self.threshold
        mask = batchtopk_mask(scores, self.config.top_k)
        with torch.no_grad():
            smallest = scores.masked_fill(~mask, float('inf')).min()
            decay = torch.where(self.threshold > 0, self.config.threshold_decay, 0.0)
            self.threshold.copy_(decay * self.threshold + (1 - decay) * smallest)
        return mask

    def pairs(self, n_tokens, online):
        return n_tokens * self.budget() if self.training else None

    def slots(self):
        return None

    def needs_calibration(self):
        return bool(self.threshold <= 0)


class ReLU(Router):
    """ReMoE: gates = ReLU(logits), steered to top_k experts per token on average by an L1 penalty
    with adaptive lambda. Buffers: the opening logit (0 = ReMoE), lambda, the active fractions."""
    per_step_k = False

    def __init__(self, config):
        super().__init__(config)
        self.register_buffer('threshold', torch.zeros(()))
        self.register_buffer('l1_coef', torch.tensor(float(config.relu_l1_init)))
        self.register_buffer('active_sum', torch.zeros(()))
        self.register_buffer('active_count', torch.zeros(()))

    @classmethod
    def check(cls, config):
        super().check(config)
        if config.balance == 'bias':
            raise ValueError("--balance=bias needs a router that ranks scores; relu balances "
                             "through its own regulariser (use --balance=aux)")

    def route(self, logits, scores, cache, online):
        # ReMoE: gates = ReLU(logits), an expert active where its gate is positive; here the ReLU
        # may open below 0, at a per-layer threshold <= 0 (0 = ReMoE)
        gates = F.relu(logits - self.threshold)
        mask = gates > 0
        if self.training:
            with torch.no_grad():
                self.active_sum.add_(mask.float().mean())
                self.active_count.add_(1)
        return mask, gates

    def pairs(self, n_tokens, online):
        return None

    def slots(self):
        return None

    def aux_loss(self, logits, scores, mask, gates):
        # ReMoE's one regulariser, also its balancer: lambda * the Switch formula on the gates (no
        # z-loss: pulling logits down would shut every ReLU gate)
        return self.l1_coef.clone() * switch_balance(gates, mask, self.config.top_k)

    @classmethod
    @torch.no_grad()
    def step(cls, routers):
        """Once per step, from the active fractions since the last (then cleared): each layer's
        lambda (relu_l1_per_layer=False: one, from their mean, as ReMoE) and threshold."""
        cfg = routers[0].config
        target = cfg.top_k / cfg.n_exp
        for group in [[r] for r in routers] if cfg.relu_l1_per_layer else [routers]:
            count = sum(r.active_count for r in group)
            active = sum(r.active_sum for r in group) / count.clamp_min(1)
            # ReMoE's controller (thu-ml/ReMoE, training.py): lambda x step when the active
            # fraction is above K/N (too dense), / step otherwise; kept within [1e-12, 1e3]
            step = torch.where(active > target, cfg.relu_l1_step, 1 / cfg.relu_l1_step)
            coef = (group[0].l1_coef * step).clamp(1e-12, 1e3)
            for router in group:
                router.l1_coef.copy_(torch.where(count > 0, coef, router.l1_coef))
        for router in routers:
            # not in ReMoE, whose lambda only shuts gates: a too-sparse layer reopens as its
            # threshold falls by step x the relative error (active - K/N) / (K/N); never above 0
            active = router.active_sum / router.active_count.clamp_min(1)
            threshold = router.threshold + cfg.relu_threshold_step * (active - target) / target
            router.threshold.copy_(torch.where(router.active_count > 0, threshold.clamp(max=0.0),
                                               router.threshold))
            router.active_sum.zero_()
            router.active_count.zero_()


# Adding a router: its selection as a function above, a class changing what differs, a row here.
ROUTERS = dict(topk=Router, mrltopk=MRLTopK, seqtopk=SeqTopK, batchtopk=BatchTopK, relu=ReLU,
               windowtopk=WindowTopK)


def step_budgets(cfg, n_layers, generator=None):
    """Each MoE layer's k for one training step, as plain ints (a seeded generator: a function
    of the step)."""
    return ROUTERS[cfg.router].draw(cfg.top_k, n_layers, generator)
