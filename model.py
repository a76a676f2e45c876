"""
A nanoGPT-style GPT whose feed-forward layers are Mixture-of-Experts layers.

Read top to bottom: config, attention, the dense MLP, the expert dispatch (one path for every
router), the MoE layer, the block, and the GPT with its generate loop. The routers themselves
live in router.py.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from router import route, routing_weights, seqtopk_bounds, ROUTERS


@dataclass
class GPTConfig:
    block_size: int = 256
    vocab_size: int = 50304
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False
    n_exp: int = 8             # experts per MoE layer
    top_k: int = 2             # experts per token (the average, for sequence-level routers)
    exp_dim: int = 256         # hidden width of each expert
    moe_every: int = 1         # every moe_every-th block is MoE, the others dense (1 = all MoE)
    router: str = 'topk'       # one of router.ROUTERS
    seq_min_k: int = 1         # seqtopk per-token lower bound
    seq_max_k: int = 0         # seqtopk per-token upper bound; 0 = top_k + 2, n_exp = unbounded
    norm_topk_prob: bool = False  # renormalise the selected gate values to sum to 1 per token
    aux_loss_weight: float = 0.01  # Switch load-balance loss
    z_loss_weight: float = 0.001   # router z-loss
    moe_impl: str = 'grouped'  # 'grouped' (one torch._grouped_mm) or 'loop' (a matmul per expert)

    def validate(self):
        """Raise ValueError with a one-line, actionable message for an impossible config."""
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router '{self.router}': choose one of {', '.join(ROUTERS)}")
        if self.router == 'seqtopk':
            seqtopk_bounds(self.top_k, self.n_exp, self.seq_min_k, self.seq_max_k or None)
        elif not 1 <= self.top_k <= self.n_exp:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_exp={self.n_exp}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.moe_impl not in ('grouped', 'loop'):
            raise ValueError(f"moe_impl must be 'grouped' or 'loop', got '{self.moe_impl}'")


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """The dense FFN, for the blocks between MoE layers."""

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


def grouped_matmul(x, w, counts, impl='grouped'):
    """Rows of x grouped by expert (counts[e] rows for expert e, in order) times w[e]: (M, C) -> (M, H)."""
    grouped_ok = x.device.type == 'cpu' or x.dtype == torch.bfloat16  # the CUDA kernel is bf16-only
    if impl == 'grouped' and grouped_ok and hasattr(torch, '_grouped_mm'):
        return torch._grouped_mm(x, w, offs=counts.cumsum(0).to(torch.int32))
    # fallback: one matmul per expert (a loop over experts, never over tokens)
    return torch.cat([xe @ we for xe, we in zip(x.split(counts.tolist()), w)])


def dispatch(x, mask, weights, w_fc, w_proj, impl='grouped'):
    """The one path from any routing mask to expert outputs.

    x: (M, C) tokens; mask, weights: (M, N), any number of experts per token;
    w_fc: (N, C, H), w_proj: (N, H, C). Returns sum_i weights[:, i] * expert_i(x) of shape (M, C).
    """
    expert_idx, token_idx = mask.t().nonzero(as_tuple=True)  # sorted by expert: one group each
    counts = mask.sum(dim=0)
    h = F.gelu(grouped_matmul(x[token_idx], w_fc, counts, impl))
    y = grouped_matmul(h, w_proj, counts, impl)
    y = y * weights[token_idx, expert_idx].unsqueeze(-1)
    return torch.zeros_like(x).index_add_(0, token_idx, y)


class MoE(nn.Module):
    """Router + n_exp expert MLPs. Returns the output, the auxiliary loss, and the routing used."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.router = nn.Linear(config.n_embd, config.n_exp, bias=False)
        self.w_fc = nn.Parameter(torch.empty(config.n_exp, config.n_embd, config.exp_dim))
        self.w_proj = nn.Parameter(torch.empty(config.n_exp, config.exp_dim, config.n_embd))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        cfg = self.config
        B, T, C = x.shape
        # Router in fp32 even under autocast: ranking near-tied scores must not depend on bf16 rounding.
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float())  # (B, T, N)
        scores = logits.softmax(dim=-1)
        mask = route(scores, cfg.router, cfg.top_k, cfg.seq_min_k, cfg.seq_max_k or None)
        weights = routing_weights(scores, mask, cfg.norm_topk_prob).to(x.dtype)
        y = dispatch(x.view(-1, C), mask.view(-1, cfg.n_exp), weights.view(-1, cfg.n_exp),
                     self.w_fc, self.w_proj, cfg.moe_impl)
        # Switch load balance: N * sum_e (share of assignments to e) * (mean score of e).
        load = mask.view(-1, cfg.n_exp).sum(0).float()
        balance = cfg.n_exp * (load / load.sum() * scores.view(-1, cfg.n_exp).mean(0)).sum()
        z_loss = logits.logsumexp(dim=-1).square().mean()  # keeps router logits small (ST-MoE)
        aux_loss = cfg.aux_loss_weight * balance + cfg.z_loss_weight * z_loss
        return self.dropout(y.view(B, T, C)), aux_loss, (mask, scores)


class Block(nn.Module):

    def __init__(self, config, moe):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.ffn = MoE(config) if moe else MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        if isinstance(self.ffn, MoE):
            y, aux_loss, routing = self.ffn(self.ln_2(x))
            return x + y, aux_loss, routing
        return x + self.ffn(self.ln_2(x)), 0.0, None


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        config.validate()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, moe=(i % config.moe_every == config.moe_every - 1))
                             for i in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)  # GPT-2: scale the residual projections
        for name, p in self.named_parameters():
            if name.endswith('c_proj.weight') or name.endswith('w_proj'):
                torch.nn.init.normal_(p, mean=0.0, std=residual_std)
            elif name.endswith('w_fc'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, active=False):
        """Parameters without position embeddings; active=True counts top_k of the n_exp experts."""
        n = sum(p.numel() for p in self.parameters()) - self.transformer.wpe.weight.numel()
        if active:
            cfg = self.config
            n_moe = sum(isinstance(b.ffn, MoE) for b in self.transformer.h)
            n -= n_moe * (cfg.n_exp - cfg.top_k) * 2 * cfg.n_embd * cfg.exp_dim
        return n

    def forward(self, idx, targets=None):
        """Returns logits, the cross-entropy (None without targets) and aux, a dict holding the
        weighted auxiliary loss and each MoE layer's routing (mask, scores) for statistics."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size={self.config.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        aux_loss, routing = 0.0, []
        for block in self.transformer.h:
            x, layer_aux, layer_routing = block(x)
            aux_loss = aux_loss + layer_aux
            if layer_routing is not None:
                routing.append(layer_routing)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None, dict(aux_loss=aux_loss, routing=routing)
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1), ignore_index=-1)
        return logits, loss, dict(aux_loss=aux_loss, routing=routing)

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]   # matrices, embeddings, expert weights
        no_decay = [p for p in params if p.dim() < 2]  # biases and norms
        groups = [dict(params=decay, weight_decay=weight_decay),
                  dict(params=no_decay, weight_decay=0.0)]
        fused = device_type == 'cuda'
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, sample_top_k=None):
        """Sample max_new_tokens after idx (B, T). Recomputes the (cropped) context every step."""
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.config.block_size:]
            logits, _, _ = self(idx_cond)
            logits = logits[:, -1, :]
            if temperature <= 0:  # greedy
                idx_next = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if sample_top_k is not None:
                    v, _ = torch.topk(logits, min(sample_top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float('inf')
                idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
