"""
seqmoe's routers on a Hugging Face transformers MoE model (OLMoE, Qwen2-MoE / Qwen1.5-MoE,
Mixtral), training-free: the model's weights, gates and experts stay, only the selection changes.

    model = hf.route(model, 'seqtopk', top_k=4)   # or: with hf.routed(model, 'seqtopk'): ...
    model.generate(ids, attention_mask=mask)      # each new token by Eq. 7, the Expert Cache
    hf.unroute(model)                             # routes as before, bit for bit

Two hooks: the model's (the sequence shape, the attention mask, where decoding is) and each MoE
block's gate's (its softmax scores (B, T, N) through router.py's rule; the experts then run the
selection as a (tokens, most taken) index, each token's unused slots its own best expert at weight
0, which every experts implementation (eager, grouped_mm, batched_mm) runs safely).
"""
from contextlib import contextmanager

import torch

from router import (expert_cache_rows, online_seqtopk_mask, routing_weights, seqtopk_bounds,
                    seqtopk_mask, topk_mask)

try:
    import transformers
except ImportError:
    raise SystemExit("error: hf.py needs transformers 5: pip install 'transformers>=5,<6'")
VERSION = tuple(int(v) for v in transformers.__version__.split('.')[:2])

# the families whose gate returns (logits, weights, index) of a softmax top-K, tested here
FAMILIES = dict(olmoe='OLMoE', qwen2_moe='Qwen2-MoE (Qwen1.5-MoE)', mixtral='Mixtral')
ROUTERS = ('topk', 'seqtopk')


class Routing:
    """A router's selection on a model's MoE blocks, per sequence. online: each token by Eq. 7
    after the tokens before it (causal); else Eq. 5 over each sequence at once. Decoding with the
    KV cache, each new token routes by Eq. 7 against its row's Expert Cache, either way."""

    def __init__(self, model, router, top_k, seq_min_k, seq_max_k, seq_budget, online):
        cfg = model.config
        self.blocks = [m for m in model.modules() if hasattr(m, 'gate') and hasattr(m, 'experts')]
        self.n_exp = self.blocks[0].experts.num_experts
        self.k = top_k or cfg.num_experts_per_tok
        self.min_k, self.max_k = seqtopk_bounds(self.k, self.n_exp, seq_min_k, seq_max_k)
        self.router, self.strict, self.online = router, seq_budget == 'strict', online
        self.renormalize = cfg.model_type == 'mixtral' or cfg.norm_topk_prob  # as the model's
        self.record = None  # a list: each gate's (layer, scores (B, T, N), mask (B, T, N))
        self.handles = [model.register_forward_pre_hook(self.before, with_kwargs=True)]
        self.handles += [b.gate.register_forward_hook(self.gate_hook(i))
                         for i, b in enumerate(self.blocks)]

    def before(self, model, args, kwargs):
        """The forward's shape, its real tokens (B, T) and how many it follows (the KV cache)."""
        x = kwargs.get('input_ids', args[0] if args else None)
        x = kwargs.get('inputs_embeds') if x is None else x
        self.B, self.T = x.shape[:2]
        cache = kwargs.get('cache', kwargs.get('past_key_values'))
        past = cache.get_seq_length() if cache is not None else 0
        mask = kwargs.get('attention_mask')
        if mask is not None and mask.dim() != 2:
            raise ValueError("seqmoe routing reads a 2D attention_mask (B, tokens), 1 = real")
        self.real = (torch.ones(self.B, self.T, dtype=torch.bool, device=x.device)
                     if mask is None else mask[:, -self.T:].bool())
        if past == 0:  # a new context: each layer's Expert Cache, per row, empty
            self.expert_cache = [[(None, None)] * self.B for _ in self.blocks]
        elif len(self.expert_cache[0]) != self.B:
            raise ValueError(f"the KV cache continues {len(self.expert_cache[0])} rows with "
                             f"{self.B}: seqmoe routing decodes without beams (num_beams=1)")
        self.decoding = past > 0

    def gate_hook(self, layer):
        def hook(gate, args, output):
            logits, weights, _ = output
            # (B, T, N), as the gate: softmax in fp32 (before 5.6 the gate returns it first)
            scores = (logits.float() if VERSION < (5, 6) else logits.float().softmax(-1))
            scores = scores.view(self.B, self.T, -1)
            mask = self.select(layer, scores)  # (B, T, N)
            if self.record is not None:
                self.record.append((layer, scores, mask))
            return logits, *expert_slots(scores.flatten(0, 1), mask.flatten(0, 1),
                                         self.renormalize, weights.dtype)
        return hook

    def select(self, layer, scores):
        """The rule's mask (B, T, N): topk's on every token, as the model's; seqtopk's on
        each row's real tokens (a row's budget: its real tokens x K), a pad token taking none."""
        if self.router == 'topk':
            return topk_mask(scores, self.k)
        mask = torch.zeros_like(scores, dtype=torch.bool)
        for b in range(self.B):  # rows hold different numbers of real tokens
            s = scores[b, self.real[b]][None]  # (1, t, N)
            past = self.expert_cache[layer][b]
            if self.online or self.decoding:  # Eq. 7 against the row's Expert Cache
                m, rows = online_seqtopk_mask(s, self.k, self.min_k, self.max_k, self.strict,
                                              *(() if past[0] is None else past))
            else:  # Eq. 5 over the sequence at once; the Expert Cache keeps its rows
                m, rows = (seqtopk_mask(s, self.k, self.min_k, self.max_k),
                           expert_cache_rows(s, self.min_k, self.max_k))
            spent = m.sum((1, 2))
            self.expert_cache[layer][b] = ((rows, spent) if past[0] is None else
                                           (torch.cat([past[0], rows], 1), past[1] + spent))
            mask[b, self.real[b]] = m[0]
        return mask

    def remove(self):
        for handle in self.handles:
            handle.remove()


def expert_slots(scores, mask, renormalize, dtype):
    """The experts' (index, weights), each (M, most taken), from scores and mask (M, N): a
    token's experts best first, its unused slots its best expert again at weight 0 (a pad token:
    its best at weight 0), the gates as the model's (renormalised where the model does)."""
    n = max(int(mask.sum(-1).max()), 1)
    index = scores.masked_fill(~mask, -1.0).topk(n, dim=-1).indices  # (M, n)
    taken = mask.gather(-1, index)
    weights = routing_weights(scores.gather(-1, index), taken, renormalize)
    return weights.to(dtype), torch.where(taken, index, index[:, :1])


def route(model, router='seqtopk', top_k=0, seq_min_k=1, seq_max_k=0, seq_budget='plain',
          online=True):
    """The model (a transformers MoE causal LM), routed by `router` at top_k (0: the model's
    K) with seqmoe's settings; hf.unroute(model) undoes it. Its generate refuses beams."""
    if VERSION < (5, 0):  # 4.x: each family's own block, its gate a linear layer
        raise ValueError(f"hf.py needs transformers 5 (this is {transformers.__version__}): "
                         f"pip install 'transformers>=5,<6'")
    model_type = getattr(model.config, 'model_type', type(model).__name__)
    if model_type not in FAMILIES:
        raise ValueError(f"seqmoe routes {', '.join(FAMILIES.values())} (softmax top-K "
                         f"routers), not {model_type}")
    if router not in ROUTERS or seq_budget not in ('plain', 'strict'):
        raise ValueError(f"router must be one of {', '.join(ROUTERS)} (not {router}) and "
                         f"seq_budget 'plain' or 'strict' (not {seq_budget})")
    if hasattr(model, 'seqmoe'):
        raise ValueError("the model is already routed by seqmoe: hf.unroute(model) first")
    model.seqmoe = Routing(model, router, top_k, seq_min_k, seq_max_k, seq_budget, online)
    model.generate = generate_without_beams(model, model.generate)
    return model


def generate_without_beams(model, generate):
    def without_beams(*args, **kwargs):
        config = kwargs.get('generation_config') or model.generation_config
        if (kwargs.get('num_beams') or config.num_beams or 1) > 1:
            raise ValueError("seqmoe routing decodes without beams (the Expert Cache is per "
                             "row): num_beams=1")
        return generate(*args, **kwargs)
    return without_beams


def unroute(model):
    """The model routing as before route(): its hooks and generate removed."""
    model.seqmoe.remove()
    del model.seqmoe, model.generate
    return model


@contextmanager
def routed(model, *args, **kwargs):
    """with hf.routed(model, 'seqtopk', top_k=4) as model: ... (unrouted after)."""
    route(model, *args, **kwargs)
    try:
        yield model
    finally:
        unroute(model)


def from_pretrained(name, dtype=torch.float32):
    """A causal LM (eval mode) and its tokenizer, from the hub or a local folder."""
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(name)
        model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    except (OSError, ValueError) as e:  # not found, offline, not a causal LM: one line
        reason = (str(e).strip().splitlines() or [''])[0][:200]
        raise ValueError(f"could not load {name} ({type(e).__name__}: {reason})") from None
    return model.eval(), tokenizer
