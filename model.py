"""
A nanoGPT-style GPT with Mixture-of-Experts feed-forward layers, each idea as its plain definition:
the config, attention (RoPE), the MLP, the MoE layer (router -> experts), the block, the GPT; the
routers in router.py, a generation's caches in cache.py. B batch, T tokens, C n_embd, N experts.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from router import ROUTERS


@dataclass
class GPTConfig:
    # the architecture: what the weights fix (ARCHITECTURE)
    block_size: int = 128
    vocab_size: int = 50257    # the data's (train.py sets it)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    bias: bool = False
    rope: bool = True          # rotary positions (False: GPT-2's learned positions)
    n_exp: int = 8             # experts per MoE layer
    exp_dim: int = 128         # hidden width of each expert
    moe_every: int = 1         # every moe_every-th block is MoE, others dense (0: none)
    mlp_dim: int = 0           # hidden width of the dense FFN blocks (0: 4 * n_embd)
    # routing and regularisation: may change when a model is resumed or fine-tuned
    dropout: float = 0.0
    router: str = 'topk'       # a key of router.ROUTERS
    top_k: int = 2             # experts per token (a sequence router's: on average)
    seq_min_k: int = 1         # seqtopk: per-token lower bound
    seq_max_k: int = 0         # seqtopk: per-token upper bound (0: top_k+2; n_exp: none)
    seq_causal: bool = False   # seqtopk: train by the online rule, as decoding routes
    seq_budget: str = 'plain'  # online seqtopk: 'plain' (the paper), 'strict' (<= m*K)
    window_floor: int = 1      # windowtopk: each token's own top experts, added
    score_func: str = 'softmax'  # 'softmax', 'sigmoid' or 'relu' (router relu: unused)
    route_scale: float = 0.0   # gates = route_scale x selected scores (0: ~1 at init)
    norm_topk_prob: bool = False  # a token's selected scores renormalised to sum to 1
    balance: str = 'aux'       # 'aux' (Switch loss), 'bias' (loss-free bias), 'none'
    balance_rate: float = 1e-3  # balance='bias': the bias's step per optimizer step
    aux_loss_weight: float = 0.01  # Switch load-balance loss (balance='aux')
    z_loss_weight: float = 0.001   # router z-loss
    threshold_decay: float = 0.99  # batchtopk: EMA decay of the evaluation threshold
    relu_l1_init: float = 1e-8     # relu: initial lambda (ReMoE's lambda_0)
    relu_l1_step: float = 1.2      # relu: lambda's multiplicative step (ReMoE's alpha)
    relu_l1_per_layer: bool = True  # relu: a lambda per layer (False: one, as ReMoE)
    relu_threshold_step: float = 0.1  # relu: step of the layers' thresholds (0: ReMoE)

    def validate(self):
        """ValueError in the command line's words: "--dropout=1 must be in [0, 1)"."""
        def need(ok, keys, allowed):
            for key in keys.split():
                if not ok(getattr(self, key)):
                    raise ValueError(f"--{key}={getattr(self, key)} must be {allowed}")
        need(lambda v: v >= 1, 'block_size vocab_size n_layer n_head n_embd n_exp '
             'exp_dim top_k window_floor', 'a positive integer')
        need(lambda v: v >= 0, 'moe_every mlp_dim seq_min_k seq_max_k', 'an integer >= 0')
        need(lambda v: v >= 0, 'route_scale aux_loss_weight z_loss_weight '
             'relu_threshold_step', 'a number >= 0')
        need(lambda v: v > 0, 'balance_rate relu_l1_init', 'a positive number')
        need(lambda v: 0 <= v < 1, 'dropout threshold_decay', 'in [0, 1)')
        need(lambda v: v > 1, 'relu_l1_step', 'greater than 1')
        for key, choices in (('router', tuple(ROUTERS)), ('seq_budget', ('plain', 'strict')),
                             ('score_func', ('softmax', 'sigmoid', 'relu')),
                             ('balance', ('aux', 'bias', 'none'))):
            need(lambda v: v in choices, key, 'one of ' + ', '.join(choices))
        need(lambda v: v % self.n_head == 0, 'n_embd', f'a multiple of --n_head={self.n_head}')
        need(lambda v: v <= self.n_layer, 'moe_every',
             f'at most --n_layer={self.n_layer} (0: no MoE layer)')
        need(lambda v: v <= self.n_exp, 'top_k', f'at most --n_exp={self.n_exp}')
        ROUTERS[self.router].check(self)

    def padded_vocab(self):
        """A word-piece vocabulary (GPT-2's 50257) padded to a multiple of 64 (aligned)."""
        return self.vocab_size if self.vocab_size < 1024 else -(-self.vocab_size // 64) * 64


ARCHITECTURE = ('block_size', 'vocab_size', 'n_layer', 'n_head', 'n_embd', 'bias',
                'rope', 'n_exp', 'exp_dim', 'moe_every', 'mlp_dim')


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.dropout, self.rope = config.n_head, config.dropout, config.rope

    def forward(self, x, cache=None, pos=None):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2)  # (B, nh, T, hs)
                   for t in self.c_attn(x).split(C, dim=2))
        if self.rope:  # q.k then depends on how far back a key is: "look back" is easy
            q, k = rotate(q, pos), rotate(k, pos)
        if cache is None:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0)
        else:  # the KV cache: each query sees the positions up to its own
            k, v = cache.write_kv(k, v, pos)  # (B, nh, block_size, hs)
            seen = torch.arange(k.shape[2], device=x.device) <= pos[:, None]  # (T, block_size)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=seen)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


def rotate(x, pos, base=10000.0):
    """RoPE (RoFormer): channel pair i of x (B, nh, T, hs) turned by pos * base^(-2i/hs)."""
    half = x.shape[-1] // 2
    angle = pos[:, None] * base ** (-torch.arange(half, device=x.device) / half)  # (T, hs/2)
    x1, x2 = x.float().unflatten(-1, (half, 2)).unbind(-1)
    cos, sin = angle.cos(), angle.sin()
    turned = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return turned.flatten(-2).type_as(x)


class MLP(nn.Module):
    """The dense FFN, for the blocks between MoE layers."""

    def __init__(self, config):
        super().__init__()
        width = config.mlp_dim or 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, width, bias=config.bias)
        self.c_proj = nn.Linear(width, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


def moe_loop(x, mask, gates, w_fc, w_proj):
    """The textbook MoE over M tokens: for each expert, gather the tokens that take it, run its
    MLP, add the outputs back scaled by their gates. x (M, C), mask and gates (M, N) -> (M, C)."""
    y = torch.zeros_like(x, dtype=torch.promote_types(x.dtype, torch.float32))
    for i in mask.any(0).nonzero().flatten().tolist():  # the experts some token takes
        token = mask[:, i].nonzero().flatten()  # (M_i,): the tokens that take expert i
        h = F.gelu(x[token] @ w_fc[i].to(x.dtype))  # (M_i, H)
        out = (h * gates[token, i, None]) @ w_proj[i].to(x.dtype)  # (M_i, C)
        y.index_add_(0, token, out.to(y.dtype))
    return y.to(x.dtype)


class MoE(nn.Module):
    """A router and n_exp expert MLPs: y = sum_i gate_i(x) * gelu(x @ w_fc[i]) @ w_proj[i]."""

    def __init__(self, config):
        super().__init__()
        C, H, N = config.n_embd, config.exp_dim, config.n_exp
        self.router = ROUTERS[config.router](config)
        self.w_fc = nn.Parameter(torch.empty(N, C, H))
        self.w_proj = nn.Parameter(torch.empty(N, H, C))
        self.dropout = nn.Dropout(config.dropout)
        self.experts = moe_loop  # fast.paths: the sorted dispatch, the same y (tested)

    def forward(self, x, cache=None, online=False):
        B, T, C = x.shape
        past = cache.expert_past() if cache is not None else None  # Expert Cache so far
        mask, gates, scores, aux_loss, S = self.router(x, past, online)  # (B, T, N) each
        if cache is not None and S is not None:  # an online rule decided: the cache keeps
            cache.append_experts(S, mask)  # its Expert Cache S, these tokens' too (Eq. 6)
        # the experts run in the autocast dtype (bf16 on GPUs); the router stays in fp32
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        tokens = x.view(B * T, C), mask.view(B * T, -1), gates.view(B * T, -1).to(x.dtype)
        y = self.experts(*tokens, self.w_fc, self.w_proj)  # (B*T, C)
        return self.dropout(y.view(B, T, C)), aux_loss, (mask, scores)


class Block(nn.Module):

    def __init__(self, config, moe):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.ffn = MoE(config) if moe else MLP(config)

    def forward(self, x, cache=None, online=False, pos=None):
        x = x + self.attn(self.ln_1(x), cache, pos)
        if isinstance(self.ffn, MoE):
            y, aux_loss, routing = self.ffn(self.ln_2(x), cache, online)
            return x + y, aux_loss, routing
        return x + self.ffn(self.ln_2(x)), 0.0, None


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        config.validate()
        self.config = config
        V, C, every = config.padded_vocab(), config.n_embd, config.moe_every
        embeddings = dict(wte=nn.Embedding(V, C))
        if not config.rope:  # GPT-2's learned absolute positions
            embeddings['wpe'] = nn.Embedding(config.block_size, C)
        self.transformer = nn.ModuleDict(dict(
            embeddings, drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, moe=every > 0 and i % every == every - 1)
                             for i in range(config.n_layer)]),
            ln_f=nn.LayerNorm(C, bias=config.bias),
        ))
        self.lm_head = nn.Linear(C, V, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)  # GPT-2: scaled residuals
        for name, p in self.named_parameters():
            if name.endswith(('c_proj.weight', 'w_proj')):
                torch.nn.init.normal_(p, mean=0.0, std=residual_std)
            elif name.endswith('w_fc'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def num_params(self, active=False):
        """Parameters but position embeddings; active=True: a token's experts, at most (spend)."""
        n = sum(p.numel() for name, p in self.named_parameters() if 'wpe' not in name)
        if active:
            k, c = max([r.spend()[1] for r in self.routers()], default=0), self.config
            n -= round(len(self.routers()) * (c.n_exp - k) * 2 * c.n_embd * c.exp_dim)
        return n

    def routers(self):  # the router of every MoE layer, in order
        return [b.ffn.router for b in self.transformer.h if isinstance(b.ffn, MoE)]

    def forward(self, idx, targets=None, cache=None, online=None, moe_ks=None):
        """Logits, the cross-entropy (None without targets) and aux: the aux loss and each MoE
        layer's routing (mask, scores). cache: a Cache to decode with; online: by the online rule
        (default: seq_causal, or with a cache); moe_ks: each MoE layer's k this training step."""
        T, block_size = idx.shape[1], self.config.block_size
        if T > block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size={block_size}")
        pos = cache.positions(T, idx.device) if cache else torch.arange(T, device=idx.device)
        online = (cache is not None or self.config.seq_causal) if online is None else online
        if self.training:  # this step's k, to the routers that train with one
            routers = self.routers()
            for r, k in zip(routers, moe_ks or [self.config.top_k] * len(routers), strict=True):
                r.k = k if r.per_step_k else r.k
        x = self.transformer.wte(idx)  # (B, T, C)
        x = self.transformer.drop(x if self.config.rope else x + self.transformer.wpe(pos))
        aux_loss, routing = 0.0, []
        for i, block in enumerate(self.transformer.h):
            x, layer_aux, layer_routing = block(x, cache.layers[i] if cache else None, online, pos)
            aux_loss = aux_loss + layer_aux
            routing += [layer_routing] if layer_routing is not None else []
        if cache is not None:  # the T tokens are in every layer's caches: the next ones
            cache.advance(T)  # come after them (the position each layer wrote at + T)
        x = self.transformer.ln_f(x)
        aux = dict(aux_loss=aux_loss, routing=routing)
        if targets is None:  # inference: the last position's logits, without the padding
            return self.lm_head(x[:, [-1], :])[..., :self.config.vocab_size], None, aux
        logits = self.lm_head(x)  # (B, T, V padded)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1), ignore_index=-1)
        return logits, loss, aux

    def after_step(self):  # once per optimizer step: the routers' rule (relu's lambda)
        if routers := self.routers():
            routers[0].after_step(routers)

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=weight_decay),
                  dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]  # norms
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas,
                                 fused=device_type == 'cuda')

    def decode_token(self, idx, cache, online=True):
        """Logits after idx (B, T), the routing: a decoding step (T = 1), or the prompt's."""
        logits, _, aux = self(idx, cache=cache, online=online)
        return logits, aux['routing']
