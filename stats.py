"""
What a training run measures and says: the routing statistics the paper plots (Fig. 4, 5), the
experts per token training really spent, and train.py's lines.
"""
import math

import numpy as np
import torch


def routing_counts(masks, entropy, k, bins=10):
    """One batch's counts from masks (layers, B, T, N) and entropy (B, T): per layer the histogram
    of experts per token and the load; experts per token by position and per entropy bin; the
    worst prefix overspend (experts tokens 1..m took beyond m * k)."""
    per_token = masks.sum(-1)  # (layers, B, T)
    experts = per_token.float().mean(0)  # (B, T)
    binned = (entropy * bins).long().clamp(0, bins - 1).flatten()
    overspend = per_token.cumsum(-1) - k * torch.arange(1, per_token.shape[-1] + 1)
    return dict(hist=torch.stack([torch.bincount(c.flatten(), minlength=masks.shape[-1] + 1)
                                  for c in per_token]),
                load=masks.sum(dim=(1, 2)), by_position=experts.mean(0),
                bin_count=torch.bincount(binned, minlength=bins),
                bin_experts=torch.bincount(binned, weights=experts.flatten(), minlength=bins),
                overspend=int(overspend.max()))


def add_counts(total, batch):
    """Counts summed over batches (the overspend: the worst); total None: the first."""
    return batch if total is None else {
        name: max(total[name], c) if name == 'overspend' else total[name] + c
        for name, c in batch.items()}


def predictive_entropy(logits):
    """Each token's predictive entropy / log V, in [0, 1] (the paper's Fig. 5a axis)."""
    logp = logits.float().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1) / math.log(logits.shape[-1])


def routing_summary(counts, batches):
    """What the routing figures plot, from counts summed over `batches` batches."""
    return dict(experts_by_position=(counts['by_position'] / batches).tolist(),
                experts_by_entropy=(counts['bin_experts'] / counts['bin_count'].clamp_min(1))
                .tolist(), tokens_by_entropy=counts['bin_count'].tolist(),
                prefix_overspend=counts['overspend'])


def routing_stats(hist, load):
    """hist[c] = tokens that took c experts (c = 0..N); load[e] = tokens sent to expert e."""
    hist, load = hist.double(), load.double()
    counts = torch.arange(len(hist), dtype=torch.float64)
    used = counts[hist > 0]
    share = load / load.sum().clamp_min(1)  # the probability that an assignment goes to expert e
    entropy = -(share * share.clamp_min(1e-12).log()).sum() / math.log(len(load))
    return dict(
        experts_mean=float((hist * counts).sum() / hist.sum()), experts_min=int(used.min()),
        experts_max=int(used.max()), experts_hist=[int(h) for h in hist],
        load=[int(n) for n in load], load_var=float(load.var(unbiased=False)),
        load_cv=float(load.std(unbiased=False) / load.mean().clamp_min(1e-12)),
        dead_experts=int((load == 0).sum()), entropy=float(entropy))


def layer_mean(layers, key):
    """The mean over MoE layers of a routing statistic; None for a dense GPT."""
    return float(np.mean([layer[key] for layer in layers])) if layers else None


def summed_histogram(layers):
    """Tokens that took c experts (c = 0..N), summed over the MoE layers."""
    return [sum(column) for column in zip(*(layer['experts_hist'] for layer in layers))]


class ExpertSpend:
    """The (token, expert) pairs training ran per token-layer, over the run (carried on resume;
    rank 0's under DDP) and since the last log line; read from the device only when reported."""

    def __init__(self, saved, device):
        self.pairs = torch.tensor(saved.get('pairs_trained', 0), device=device)
        self.tokens = saved.get('tokens_trained', 0)
        self.logged = (int(self.pairs), self.tokens)

    def add(self, routing, n_tokens):  # one training forward's routing, n_tokens per layer
        if routing:
            self.pairs += torch.stack([mask for mask, _ in routing]).sum()  # 3 kernels, not 2L+1
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
    least, most = routers[0].spend() if routers else (0, 0)  # in training, on average
    k = f"{least:.3g}" + (f" to {most:.3g}" if most != least else '')
    what = (f"{cfg.router} routing, {k} of {cfg.n_exp} experts per token"
            if routers else f"dense GPT (no MoE layers), FFN width "
            f"{cfg.mlp_dim or 4 * cfg.n_embd}")
    return (f"{what}: {model.num_params() / 1e6:.2f}M parameters, "
            f"{model.num_params(active=True) / 1e6:.2f}M active; device {device}, {dtype}"
            f"{' with loss scaling' * (dtype == 'float16')}; global batch "
            f"{batch_size * accumulation * world_size} sequences = {batch_size} x {accumulation} "
            f"micro-steps" + (f" x {world_size} processes" if world_size > 1 else ''))


def done_summary(cfg, model, routers, losses, layers, experts_trained, **run):
    """A finished run's summary: the last line of its log.jsonl."""
    return dict(event='done', **run, router=cfg.router if routers else 'dense', top_k=cfg.top_k,
                n_exp=cfg.n_exp, mlp_dim=cfg.mlp_dim or 4 * cfg.n_embd, moe_layers=len(routers),
                params=model.num_params(), active_params=model.num_params(active=True),
                val_ce=losses['val']['ce'],
                val_ce_offline=losses.get('val_offline', losses['val'])['ce'],
                val_ce_causal=losses['val_causal']['ce'] if 'val_causal' in losses else None,
                experts_trained=experts_trained,
                **{k: layer_mean(layers, k) for k in ('experts_mean', 'load_cv', 'entropy')})


def eval_line(step, losses, layers, experts_trained):
    """train.py's line at an evaluation: losses, per layer the experts per token [fewest-most]."""
    causal = losses.get('val_causal')
    causal = (f" (offline {losses['val_offline']['ce']:.4f}, causal {causal['ce']:.4f}, worst "
              f"causal prefix overspend {causal['prefix_overspend']:+d} experts)" if causal else '')
    routing = (" | experts/token " + ' '.join(
        f"{layer['experts_mean']:.2f}[{layer['experts_min']}-{layer['experts_max']}]"
        for layer in layers) + f" | load cv {layer_mean(layers, 'load_cv'):.3f}, entropy "
        f"{layer_mean(layers, 'entropy'):.3f}" + (
            f" | {experts_trained:.2f} experts/token in training so far" if experts_trained else '')
        if layers else '')
    return (f"step {step}: train ce {losses['train']['ce']:.4f}, val ce "
            f"{losses['val']['ce']:.4f}{causal}, val aux {losses['val']['aux']:.4f}{routing}")


def done_line(summary):
    """train.py's last line, from the run's summary."""
    causal = summary['val_ce_causal']
    causal = f", causal routing {causal:.4f}" if causal is not None else ''
    trained = (f" (in training {summary['experts_trained']:.2f})" if summary['experts_trained']
               else '')
    routing = (f", experts/token {summary['experts_mean']:.2f}{trained}, load cv "
               f"{summary['load_cv']:.3f}, entropy {summary['entropy']:.3f} (means over MoE layers)"
               if summary['moe_layers'] else " (a dense GPT, no routing)")
    return (f"done: {summary['iter']} iterations, {summary['time']:.0f}s; final val ce "
            f"{summary['val_ce']:.4f}{causal}{routing}")
