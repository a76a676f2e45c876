"""
A nanoGPT-style GPT whose feed-forward layers are Mixture-of-Experts layers.

Read top to bottom: config, attention, the dense MLP, the MoE layer, the block, and the GPT with its
generate loop. The routers live in router.py, the expert dispatch (one path for every router) in
experts.py, and the caches that decoding carries (KV and Expert Cache) in cache.py.
"""
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from configurator import (Rule, above, check, fraction, non_negative, non_negative_int, one_of, positive,
                          positive_int)
from cache import Cache
from experts import dispatch
from router import ROUTERS, Router, check_router, step_budgets, step_rules


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
    moe_every: int = 1         # every moe_every-th block is MoE, the others dense (1 = all MoE, 0 = none)
    mlp_dim: int = 0           # hidden width of the dense FFN blocks (0 = 4 * n_embd)
    router: str = 'topk'       # a key of router.ROUTERS
    seq_min_k: int = 1         # seqtopk per-token lower bound
    seq_max_k: int = 0         # seqtopk per-token upper bound; 0 = top_k + 2, n_exp = unbounded
    score_func: str = 'softmax'  # router scores from the logits: 'softmax' or 'sigmoid' (each expert on its own)
    route_scale: float = 0.0   # gates = route_scale x the selected scores; 0 = auto: each gate ~1 at init
    norm_topk_prob: bool = False  # renormalise the selected gate values to sum to 1 per token (then x route_scale)
    balance: str = 'aux'       # load balancing: 'aux' (Switch loss), 'bias' (loss-free: a bias on the choice), 'none'
    balance_rate: float = 1e-3  # balance='bias': the bias's step per optimizer step
    aux_loss_weight: float = 0.01  # Switch load-balance loss (balance='aux')
    z_loss_weight: float = 0.001   # router z-loss
    threshold_decay: float = 0.99  # batchtopk: EMA decay of the evaluation threshold
    relu_l1_init: float = 1e-8     # relu: initial regulariser coefficient lambda_0 (ReMoE default)
    relu_l1_step: float = 1.2      # relu: lambda's multiplicative step alpha (ReMoE default)
    relu_l1_per_layer: bool = True  # relu: each MoE layer its own lambda (False = ReMoE: one for the model)
    relu_threshold_step: float = 0.1  # relu: step of the layers' ReLU thresholds (0 = ReMoE: always 0)
    moe_impl: str = 'grouped'  # 'grouped' (torch._grouped_mm where it runs) or 'loop' (a matmul per expert)
    seq_causal: bool = False   # seqtopk: route every position by the online rule (as in decoding)
    seq_budget: str = 'plain'  # online seqtopk: 'plain' (the paper) or 'strict' (no prefix overspends)

    def validate(self):
        """ValueError with a one-line, actionable message for an impossible config, in the words of the
        command line ("--top_k=9 must be at most --n_exp=8"): train.py says it as it is."""
        check(asdict(self), MODEL_RULES, [('n_embd', lambda c: c['n_embd'] % c['n_head'] == 0,
                                           'a multiple of --n_head={n_head}')])
        check_router(self)


# what each model setting may be (configurator.py's vocabulary); the routers check the rest (router.py)
MODEL_RULES = dict(
    block_size=positive_int, vocab_size=positive_int, n_layer=positive_int, n_head=positive_int,
    n_embd=positive_int, dropout=fraction, n_exp=positive_int, top_k=positive_int, exp_dim=positive_int,
    moe_every=non_negative_int, mlp_dim=non_negative_int, seq_min_k=non_negative_int,
    seq_max_k=non_negative_int, aux_loss_weight=non_negative, z_loss_weight=non_negative, threshold_decay=fraction,
    score_func=one_of('softmax', 'sigmoid'), route_scale=non_negative, balance=one_of('aux', 'bias', 'none'),
    balance_rate=positive,
    relu_l1_init=positive, relu_l1_step=above(1), relu_threshold_step=non_negative,
    moe_impl=one_of('grouped', 'loop'), seq_budget=one_of('plain', 'strict'),
    router=Rule(lambda v: v in ROUTERS, 'one of ' + ', '.join(ROUTERS)))  # ROUTERS as it is when checked
# settings that may change on resume or fine-tuning; the rest is architecture
ROUTING_KEYS = {'router', 'top_k', 'seq_min_k', 'seq_max_k', 'norm_topk_prob', 'aux_loss_weight', 'z_loss_weight',
                'score_func', 'route_scale', 'balance', 'balance_rate',
                'threshold_decay', 'relu_l1_init', 'relu_l1_step', 'relu_l1_per_layer', 'relu_threshold_step',
                'moe_impl', 'dropout', 'seq_causal', 'seq_budget'}


# inductor's settings for the compiled CPU decoding step, where every matmul has one row (one token):
CPU_DECODE_OPTIONS = {
    'cpp_wrapper': True,  # the step's kernel calls in C++, not Python: no interpreter between them
    # the one-row matmuls of the linear layers as inductor's own fused reductions rather than BLAS calls
    'post_grad_fusion_options': {'decompose_mm_pass': {}},
    # store an expert's activations (gelu x gate) once: left inlined, the second expert matmul recomputes
    # them for every 8 output columns it reads them from
    'realize_opcount_threshold': 4,
}


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x, cache=None, pos=None):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, n_head, T, head size)
                   for t in self.c_attn(x).split(C, dim=2))
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        else:  # the KV cache: each query attends to every position up to its own (the unused rest is masked)
            k, v = cache.write_kv(k, v, pos)
            allowed = torch.arange(k.shape[2], device=x.device) <= pos[:, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


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


class MoE(nn.Module):
    """Router + n_exp expert MLPs. Returns the output, the auxiliary loss, and the routing used."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.router = Router(config)
        self.w_fc = nn.Parameter(torch.empty(config.n_exp, config.n_embd, config.exp_dim))
        self.w_proj = nn.Parameter(torch.empty(config.n_exp, config.exp_dim, config.n_embd))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, cache=None, causal=False):
        B, T, C = x.shape
        N = self.config.n_exp
        mask, weights, scores, aux_loss = self.router(x, cache, causal)
        # the experts run in the autocast dtype (bf16 on GPUs); the router above stays in fp32
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        kernel = self.config.moe_impl == 'grouped'
        # a decoding step with static shapes (the router's bound on a token's experts, unused slots gated 0) where
        # it pays: compiled, or on a GPU, where counting the pairs would wait on the device
        decoding = T == 1 and kernel and not torch.is_grad_enabled() and (x.is_cuda or torch.compiler.is_compiling())
        y = dispatch(x.reshape(-1, C).to(dtype), mask.view(-1, N), weights.view(-1, N).to(dtype),
                     self.w_fc, self.w_proj, self.router.fixed_pairs(B * T, causal), kernel=kernel,
                     slots=self.router.slots() if decoding else None, budget=self.router.budget())
        return self.dropout(y.view(B, T, C)), aux_loss, (mask, scores)


class Block(nn.Module):

    def __init__(self, config, moe):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.ffn = MoE(config) if moe else MLP(config)

    def forward(self, x, cache=None, causal=False, pos=None):
        x = x + self.attn(self.ln_1(x), cache, pos)
        if isinstance(self.ffn, MoE):
            y, aux_loss, routing = self.ffn(self.ln_2(x), cache, causal)
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
            h=nn.ModuleList([Block(config, moe=config.moe_every > 0 and i % config.moe_every == config.moe_every - 1)
                             for i in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.compiled_step = None  # stepper(compile=True) compiles decode_step once
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

    def routers(self):
        """The Router of every MoE layer, in order."""
        return [block.ffn.router for block in self.transformer.h if isinstance(block.ffn, MoE)]

    def forward(self, idx, targets=None, cache=None, causal=None, moe_ks=None):
        """Returns logits, the cross-entropy (None without targets) and aux, a dict holding the
        weighted auxiliary loss and each MoE layer's routing (mask, scores) for statistics.
        cache: a Cache to decode with (idx are then the tokens after those it holds); causal: route
        seqtopk by the online rule (default: config.seq_causal; always, when decoding).
        moe_ks: in training, the k of each MoE layer for this step (plain ints, e.g. from
        router.step_budgets with a seeded generator); None draws them from torch's default generator
        (only mrltopk draws). In training, relu's routers also record their active fractions."""
        B, T = idx.shape
        if cache is None and T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size={self.config.block_size}")
        pos = torch.arange(T, device=idx.device) if cache is None else cache.positions(T, idx.device)
        causal = (cache is not None or self.config.seq_causal) if causal is None else causal
        if self.training:  # this step's k of each MoE layer: the router's draw (mrltopk), else top_k
            routers = self.routers()
            for router, k in zip(routers, step_budgets(self.config, len(routers)) if moe_ks is None else moe_ks,
                                 strict=True):
                router.k = k
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        aux_loss, routing = 0.0, []
        for i, block in enumerate(self.transformer.h):
            x, layer_aux, layer_routing = block(x, None if cache is None else cache.layers[i], causal, pos)
            aux_loss = aux_loss + layer_aux
            if layer_routing is not None:
                routing.append(layer_routing)
        if cache is not None:
            cache.pos.add_(T)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None, dict(aux_loss=aux_loss, routing=routing)
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1), ignore_index=-1)
        return logits, loss, dict(aux_loss=aux_loss, routing=routing)

    def after_step(self):
        """Once per optimizer step (train.py calls it after DDP has averaged the routers' state): the
        routers' step rule, e.g. relu's controller, from what they measured in the step's forwards."""
        step_rules(self.routers())

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]   # matrices, embeddings, expert weights
        no_decay = [p for p in params if p.dim() < 2]  # biases and norms
        groups = [dict(params=decay, weight_decay=weight_decay),
                  dict(params=no_decay, weight_decay=0.0)]
        fused = device_type == 'cuda'
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)

    def decode_step(self, idx, cache):
        """One decoding step: the logits after idx (B, 1) and each MoE layer's routing, with the caches.
        The host's bookkeeping (cache.reserve) is left to the caller, so that the step compiles to one
        graph whose shapes never change: generate(compile=True) runs it as stepper(compile=True) does."""
        logits, _, aux = self(idx, cache=cache, causal=True)
        return logits, aux['routing']

    def stepper(self, compile=False):
        """generate's decoding step, step(idx, cache): decode_step, eager or compiled (once per model:
        fullgraph, and on CUDA mode='reduce-overhead', so that the whole step replays as one CUDA graph)."""
        if not compile:
            return self.decode_step
        if self.compiled_step is None:
            cuda = next(self.parameters()).is_cuda
            self.compiled_step = torch.compile(self.decode_step, fullgraph=True, mode='reduce-overhead' if cuda else None,
                                               options=None if cuda else CPU_DECODE_OPTIONS)

        def step(idx, cache):
            cache.reserve(idx.shape[1])
            if idx.is_cuda:
                torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are read: replay anew
            return self.compiled_step(idx, cache)
        return step

    @torch.inference_mode()  # no autograd bookkeeping at all: each small decoding op costs less
    def generate(self, idx, max_new_tokens, temperature=1.0, sample_top_k=None, use_cache=True,
                 prompt_routing='online', on_step=None, compile=False):
        """Sample max_new_tokens after idx (B, T).

        use_cache: decode with a Cache (KV + Expert Cache), else recompute the whole context every
        step. Either way seqtopk routes each new token by the online rule, so both agree exactly.
        compile: run the cached decoding step compiled (stepper); the prompt runs eagerly. The first
        step compiles (seconds to a minute), later calls reuse it.
        prompt_routing: 'online' routes the prompt token by token with the same rule (generation
        and causal evaluation agree); 'joint' routes it as one sequence (offline SeqTopK), as the
        paper's code does. on_step(routing) sees each step's routing, e.g. to count experts.
        Past block_size tokens, the uncached path crops the context; the cached one starts its
        cache again from the last block_size // 2 tokens."""
        if prompt_routing not in ('online', 'joint'):
            raise ValueError(f"prompt_routing must be 'online' or 'joint', got '{prompt_routing}'")
        if not use_cache and (prompt_routing == 'joint' or compile):
            raise ValueError(f"{'compile=True' if compile else 'prompt_routing=joint'} needs use_cache=True: "
                             f"{'it compiles the cached step' if compile else 'recomputing would re-route the prompt'}")
        cache, step, idx_next = Cache(self.config), self.stepper(compile), None
        for i in range(max_new_tokens):
            if not use_cache:
                logits, _, aux = self(idx[:, -self.config.block_size:], causal=True)
                routing = aux['routing']
            elif i == 0 or cache.length == self.config.block_size:  # the prompt, or the context once full
                cache.reset()
                context = idx[:, -(self.config.block_size // 2):] if i > 0 else idx
                logits, _, aux = self(context, cache=cache, causal=(prompt_routing == 'online' or i > 0))
                routing = aux['routing']
            else:  # the token sampled last (its own tensor: a slice of idx would change its strides)
                logits, routing = step(idx_next, cache)
            if on_step is not None:
                on_step(routing)
            logits = logits[:, -1, :]
            if temperature <= 0:  # greedy
                idx_next = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if sample_top_k is not None:
                    v, _ = torch.topk(logits, min(sample_top_k, logits.size(-1)))
                    logits = logits.masked_fill(logits < v[:, [-1]], -float('inf'))  # no host sync on a GPU
                idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
