"""
The statistics, in one place: the routing statistics the paper plots (Fig. 4, 5), counted over
evaluation batches (train.py logs and prints them, plot.py draws them), and the paired differences between runs
trained with the same seeds, with their Student-t intervals (sweep.py's tables and figure).
"""
import math
from functools import lru_cache

import numpy as np
import torch


# -----------------------------------------------------------------------------
# routing statistics, from counts accumulated over evaluation batches

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


def add_counts(total, batch):
    """Counts summed over batches (the worst overspend is the largest); total None: the first batch."""
    return batch if total is None else {name: max(total[name], c) if name == 'overspend' else total[name] + c
                                        for name, c in batch.items()}


def predictive_entropy(logits):
    """Each token's predictive entropy / log V, in [0, 1] (the paper's Fig. 5a axis)."""
    logp = logits.float().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1) / math.log(logits.shape[-1])


def routing_summary(counts, batches):
    """What the routing figures plot, from counts summed over `batches` batches."""
    return dict(experts_by_position=(counts['by_position'] / batches).tolist(),
                experts_by_entropy=(counts['bin_experts'] / counts['bin_count'].clamp_min(1)).tolist(),
                tokens_by_entropy=counts['bin_count'].tolist(), prefix_overspend=counts['overspend'])


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


def layer_mean(layers, key):
    """The mean over MoE layers of one routing statistic (e.g. 'load_cv'), or None for a dense model."""
    return float(np.mean([layer[key] for layer in layers])) if layers else None


def summed_histogram(layers):
    """Tokens that took c experts (c = 0..N), summed over the MoE layers."""
    return [sum(column) for column in zip(*(layer['experts_hist'] for layer in layers))]


class ExpertSpend:
    """The compute training really spent: the (token, expert) pairs its forwards ran per
    token-layer routed, over the whole run (a resumed run carries them on; rank 0's share under
    DDP) and since the last log line; counted on the device, read only when reported."""

    def __init__(self, saved, device):
        self.pairs = torch.tensor(saved.get('pairs_trained', 0), device=device)
        self.tokens = saved.get('tokens_trained', 0)
        self.logged = (int(self.pairs), self.tokens)

    def add(self, routing, n_tokens):  # one training forward's routing, n_tokens per layer
        if routing:
            self.pairs += sum(mask.sum() for mask, _ in routing)
            self.tokens += n_tokens * len(routing)

    def per_token(self):
        return self.pairs.item() / self.tokens if self.tokens else None

    def since_last_log(self):
        (pairs, tokens), self.logged = self.logged, (int(self.pairs), self.tokens)
        return (self.logged[0] - pairs) / (self.tokens - tokens) if self.tokens > tokens else None

    def state(self):  # for the checkpoint
        return dict(pairs_trained=int(self.pairs), tokens_trained=self.tokens)


def start_line(model, device, dtype, batch_size, accumulation, world_size):
    """What a run trains: its routing or dense FFN, parameters, device and global batch."""
    cfg, routers = model.config, model.routers()
    return ((f"{cfg.router} routing, {cfg.top_k} of {cfg.n_exp} experts per token: " if routers else
             f"dense GPT (no MoE layers), FFN width {cfg.mlp_dim or 4 * cfg.n_embd}: ") +
            f"{model.num_params() / 1e6:.2f}M parameters, {model.num_params(active=True) / 1e6:.2f}M active; "
            f"device {device}, {dtype}{' with loss scaling' * (dtype == 'float16')}; global batch {batch_size * accumulation * world_size} "
            f"sequences = {batch_size} x {accumulation} micro-steps" +
            (f" x {world_size} processes" if world_size > 1 else ''))


def done_summary(cfg, model, routers, losses, layers, experts_trained, **run):
    """A finished run's summary: the last line of its log.jsonl, which sweep.py reads."""
    return dict(event='done', **run, router=cfg.router if routers else 'dense', top_k=cfg.top_k,
                n_exp=cfg.n_exp, mlp_dim=cfg.mlp_dim or 4 * cfg.n_embd, moe_layers=len(routers),
                params=model.num_params(), active_params=model.num_params(active=True),
                val_ce=losses['val']['ce'], val_ce_offline=losses.get('val_offline', losses['val'])['ce'],
                val_ce_causal=losses['val_causal']['ce'] if 'val_causal' in losses else None,
                experts_trained=experts_trained,
                **{k: layer_mean(layers, k) for k in ('experts_mean', 'load_cv', 'entropy')})


def eval_line(step, losses, layers, experts_trained):
    """train.py's line at an evaluation: the losses (for an online router, offline and causal), and per MoE
    layer experts per token [fewest-most], then the layers' mean load cv and entropy."""
    causal = losses.get('val_causal')
    causal = (f" (offline {losses['val_offline']['ce']:.4f}, causal {causal['ce']:.4f}, worst causal prefix "
              f"overspend {causal['prefix_overspend']:+d} experts)" if causal else '')
    routing = (" | experts/token " + ' '.join(f"{l['experts_mean']:.2f}[{l['experts_min']}-{l['experts_max']}]"
                                              for l in layers) +
               f" | load cv {layer_mean(layers, 'load_cv'):.3f}, entropy {layer_mean(layers, 'entropy'):.3f}" +
               (f" | {experts_trained:.2f} experts/token in training so far" if experts_trained else '')
               if layers else '')
    return (f"step {step}: train ce {losses['train']['ce']:.4f}, val ce {losses['val']['ce']:.4f}{causal}, "
            f"val aux {losses['val']['aux']:.4f}{routing}")


def done_line(summary):
    """train.py's last line, from the run's summary (its last line of log.jsonl)."""
    causal = (f", causal routing {summary['val_ce_causal']:.4f}" if summary['val_ce_causal'] is not None else '')
    trained = f" (in training {summary['experts_trained']:.2f})" if summary['experts_trained'] else ''
    routing = (f", experts/token {summary['experts_mean']:.2f}{trained}, load cv {summary['load_cv']:.3f}, "
               f"entropy {summary['entropy']:.3f} (means over MoE layers)" if summary['moe_layers'] else
               " (a dense GPT, no routing)")
    return (f"done: {summary['iter']} iterations, {summary['time']:.0f}s; final val ce {summary['val_ce']:.4f}"
            f"{causal}{routing}")


# -----------------------------------------------------------------------------
# paired statistics: runs trained with the same seed share the initialisation and the batches

@lru_cache(maxsize=None)
def t_quantile(p, df):
    """Student's t quantile for p > 0.5 (no scipy): bisection on the CDF, whose density is integrated
    by Simpson's rule. t_quantile(0.975, 1) = 12.706, (0.975, 2) = 4.303, (0.975, 30) = 2.042."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x, n=2000):  # P(T <= x), x >= 0
        f = [math.exp(log_c - (df + 1) / 2 * math.log1p((x * i / n) ** 2 / df)) for i in range(n + 1)]
        return 0.5 + x / n / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))
    lo, hi = 0.0, 100.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def paired_difference(a, b, level=0.95):
    """a, b: {seed: value}. The mean over the seeds both have of a[seed] - b[seed], with its t-interval
    (mean +- t * sd / sqrt(n)); low and high are None with a single seed."""
    diffs = [a[s] - b[s] for s in sorted(a) if s in b and a[s] is not None and b[s] is not None]
    if not diffs:
        return dict(mean=None, low=None, high=None, n=0)
    mean, n = float(np.mean(diffs)), len(diffs)
    if n == 1:
        return dict(mean=mean, low=None, high=None, n=1)
    half = t_quantile(0.5 + level / 2, n - 1) * float(np.std(diffs, ddof=1)) / math.sqrt(n)
    return dict(mean=mean, low=mean - half, high=mean + half, n=n)


def format_difference(d):
    if d['mean'] is None:
        return ''
    if d['low'] is None:
        return f"{d['mean']:+.4f} (1 seed: no interval)"
    return f"{d['mean']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]"


def mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return '', None
    return (f"{np.mean(values):.4f} ± {np.std(values, ddof=1):.4f}" if len(values) > 1 else f"{values[0]:.4f}"), \
        float(np.mean(values))
