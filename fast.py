"""
Fast paths: what model.py and router.py define, computed faster, each tested equal to its plain
definition. The scripts choose them once: paths(model) is the model, sharing its weights, with
its MoE layers running the sorted dispatch and its SeqTopK routers the online rule by counting.
The model never imports this file; eager generation runs the plain definitions.

Design choices, measured (results/README.md's section in quotes; CPU: bench's 64/8 MoE layer,
fp32; H100: bf16; GPU busy and kernel counts there predate kernel_work, which counts kernels alone):
- Pairs sorted by expert, a block of rows each (moe_sorted): the CPU layer 1.56x its dense FFN,
  the textbook loop 2.97x ("The house refactor"); H100 eager 2.92 ms, the textbook loop 42.06.
- One grouped matmul for the blocks (grouped_mm, a custom op compile traces): H100 2.92 ms, a
  matmul per expert 11.05 ("GPU (NVIDIA H100), 2026-11-23: eager"); CPU 1.57x and 1.59x ("CPU
  speed"). torch's own op traces in bf16 only (its meta kernel: compile's fake tensors).
- The pair count where the budget is exact (exact_pairs: nonzero_static): no host sync, so the
  compiled training step is one graph ("Compiled training step without host syncs"), and
- CUDA graphs for it (graph_step): the gpu-size step 1.41x its dense twin, 2.30x at 4425cc8; the
  layer compiled without them 3.77 ms of wall for 1.13 of kernels ("The GPU work on an H100").
- A GPU sums a token's k outputs from k slots written once, no atomics: ~9% compiled in
  nanochat's moe.py, not measured here; the CPU keeps index_add_ (no atomics there).
- The gate on the narrower of h and y ((g h) W = g (h W)), the gather by index_select: the gate
  after w_proj, x[token] and the slots cost the CPU layer 33% together, 2.03x against 1.53x
  ("The GPU work on the CPU: before and after").
- SeqTopK's online rule by counting (online_seqtopk_counted): 164 ms, 428 token by token, at a
  960-token context on the CPU ("The plain-sight refactor").
- torch's grouped matmul and autograd on capability 9.x in bf16 (native_grouped_mm): the compiler
  sees the op; not measured alone. B200 gives an expert without rows a weight gradient
  (pytorch#172439): grouped_mm_weight_grad zeroes it.
"""
import copy
import functools

import torch
from torch.nn import functional as F

from model import MoE


def paths(model, moe_impl='grouped', experts=None):
    """A copy of model sharing its parameters and buffers, running the fast paths: the experts by
    sorted_experts (moe_impl 'grouped': one kernel; 'loop': a matmul per expert), or
    experts(router) where given; SeqTopK's online rule by counting."""
    def sharing(module):  # its own attributes, the same tensors
        clone = copy.copy(module)
        clone._modules = {name: sharing(child) for name, child in module._modules.items()}
        return clone
    fast = sharing(model)
    for moe in (m for m in fast.modules() if isinstance(m, MoE)):
        moe.experts = (experts(moe.router) if experts else
                       functools.partial(sorted_experts, router=moe.router, moe_impl=moe_impl))
        if moe.router.online:
            moe.router.online_rule = online_seqtopk_counted
    return fast


# -----------------------------------------------------------------------------
# the sorted dispatch and its grouped matmul

def expert_loop(x, w, offs):
    """Each expert's block of rows of x (P, C) times its matrix of w (N, C, H) -> (P, H); offs
    (N,): where each expert's rows end. A matmul per expert (a host sync)."""
    rows = offs.diff(prepend=offs.new_zeros(1)).tolist()  # each expert's row count
    return torch.cat([x_e @ w_e for x_e, w_e in zip(x.split(rows), w)])


def moe_sorted(x, mask, gates, w_fc, w_proj, grouped_mm=expert_loop, n_pairs=None, k=None):
    """model.moe_loop with the pairs sorted by expert: x (M, C) -> (M, C), the sum in fp32 at least.
    n_pairs: the pairs the mask selects, when known in advance (else counted: a host sync); k: the
    experts every token takes, where that is one number (the sum then gathers: no atomics)."""
    M, N = mask.shape
    selected = mask.t().reshape(-1)  # (N * M,): expert 0's tokens first, then expert 1's, ...
    pair = (selected.nonzero() if n_pairs is None  # (P,)
            else torch.nonzero_static(selected, size=n_pairs)).squeeze(1)
    token = pair % M  # (P,)
    offs = mask.sum(0).cumsum(0).to(torch.int32)  # (N,): where each expert's rows end
    h = F.gelu(grouped_mm(x.index_select(0, token), w_fc.to(x.dtype), offs))  # (P, H)
    gate = gates.t().reshape(-1).index_select(0, pair)[:, None]  # (P, 1)
    dtype = torch.promote_types(x.dtype, torch.float32)
    # the gate on the narrower of h and y, w_proj being linear: (g h) W = g (h W)
    if h.shape[1] <= x.shape[1]:
        y = grouped_mm(h * gate.to(h.dtype), w_proj.to(x.dtype), offs).to(dtype)  # (P, C)
    else:
        y = grouped_mm(h, w_proj.to(x.dtype), offs).to(dtype) * gate.to(dtype)  # (P, C)
    if k is None:  # each pair's output added into its token's row
        return torch.zeros_like(x, dtype=dtype).index_add_(0, token, y).to(x.dtype)
    # k a token: each pair to a slot of its token's (its place among them), each slot written once
    slot = token * k + (mask.cumsum(1) - 1).t().reshape(-1)[pair]  # (P,)
    return y.new_empty(M * k, y.shape[1]).index_copy(0, slot, y).view(M, k, -1).sum(1).to(x.dtype)


def exact_pairs(router, n_tokens):
    """The pairs the router's mask selects where its budget is exact (Router.budget: topk's k per
    token, offline SeqTopK's and BatchTopK's top_k per token in training); else None (counted: a
    host sync)."""
    budget = router.budget()
    return None if budget is None else n_tokens * budget


def static_step(model):
    """Whether the model's training step has static shapes and no host sync, so that it may run as
    CUDA graphs: each router's pairs known in advance (exact_pairs) for a k fixed over steps (not
    mrltopk's, drawn each step: a graph per draw); a dense model's too."""
    return all(exact_pairs(r, 1) is not None and not r.draws_k for r in model.routers())


def graph_step(model, device_type):
    """Whether train.py and bench run the model's training step as CUDA graphs: on a GPU, its
    shapes static (static_step) and no router with state (buffers), which its forward may update
    (batchtopk's and relu's counts since the last step, balance='bias''s load): a replay's update
    was never tested equal to eager's."""
    stateless = not any(True for r in model.routers() for _ in r.buffers())
    return device_type == 'cuda' and static_step(model) and stateless


def compiled(model, graphs):
    """The model compiled for its training step (as CUDA graphs where graphs) and for evaluation,
    never as CUDA graphs: out of training seqtopk's, batchtopk's and relu's pairs are counted
    (exact_pairs: None), as many as the data's, a graph recorded per count or none. No compile
    added: the step's module would recompile for model.eval() anyway (training is guarded)."""
    step = torch.compile(model, mode='reduce-overhead' if graphs else None)
    return step, torch.compile(model) if graphs else step


def sorted_experts(x, mask, gates, w_fc, w_proj, router, mm=None, moe_impl='grouped'):
    """moe_sorted with the pair count where the router's budget is exact (static shapes, no host
    sync: one compiled graph of the training forward); on a GPU, k where every token takes k
    (topk: a sum with no atomics); the matmul mm, by default expert_matmul's for x and moe_impl."""
    budget = router.budget()  # k where every token takes k: the most one takes
    k = budget if x.is_cuda and budget is not None and budget == router.most_k() else None
    if mm is None:
        capability = torch.cuda.get_device_capability(x.device) if x.is_cuda else None
        mm = expert_matmul(x.device.type, x.dtype, capability, moe_impl)
        if mm is native_grouped_mm and not grouped_kernel_ok(x, w_fc):  # rows not 16-byte aligned
            mm = grouped_mm
    return moe_sorted(x, mask, gates, w_fc, w_proj, mm, exact_pairs(router, mask.shape[0]), k)


def grouped_kernel_runs(device_type, dtype, capability=None):
    """Whether torch._grouped_mm runs as one kernel with no host sync: on the CPU; on CUDA only in
    bf16 on capability 9.x (H100, H200) and 10.x (B200). Elsewhere (A100, L4, RTX 30-50) torch
    copies the offsets to the host and runs a matmul per expert, as expert_loop."""
    if device_type == 'cpu':
        return dtype in (torch.float32, torch.bfloat16, torch.float16)
    return device_type == 'cuda' and dtype == torch.bfloat16 and capability[0] in (9, 10)


def expert_matmul(device_type, dtype, capability=None, moe_impl='grouped'):
    """The experts' matmul, training and evaluation: expert_loop where moe_impl='loop'; on CUDA
    capability 9.x (H100, H200) in bf16 torch._grouped_mm with its own autograd, which the compiler
    sees; elsewhere seqmoe's op grouped_mm: torch has no fp32 CPU kernel for compile's fake tensors,
    and B200's kernel gives an expert without rows a weight gradient (pytorch#172439)."""
    if moe_impl == 'loop':
        return expert_loop
    native = device_type == 'cuda' and dtype == torch.bfloat16 and capability[0] == 9
    return native_grouped_mm if native else grouped_mm


def native_grouped_mm(x, w, offs):  # torch's op and autograd
    return torch._grouped_mm(x, w, offs=offs)


def grouped_kernel_ok(*mats):
    """grouped_kernel_runs for these matrices, with 16-byte aligned rows (or columns)."""
    def ok(m):
        capability = torch.cuda.get_device_capability(m.device) if m.is_cuda else None
        aligned = min(m.stride()[-2:]) == 1 and max(m.stride()[-2:]) * m.element_size() % 16 == 0
        return grouped_kernel_runs(m.device.type, m.dtype, capability) and aligned
    return hasattr(torch, '_grouped_mm') and all(ok(m) for m in mats)


# A custom op with its gradient, which torch.compile traces (the docstring above).
@torch.library.custom_op('seqmoe::grouped_mm', mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """expert_loop in one kernel: x (P, C) grouped by expert, w (N, C, H) -> (P, H)."""
    if grouped_kernel_ok(x, w):
        return torch._grouped_mm(x, w, offs=offs)
    return expert_loop(x, w, offs)


@torch.library.custom_op('seqmoe::grouped_mm_weight_grad', mutates_args=())
def grouped_mm_weight_grad(x: torch.Tensor, grad: torch.Tensor,
                           offs: torch.Tensor) -> torch.Tensor:
    """The gradient of grouped_mm's w: each expert's x rows, transposed, times its grad rows."""
    if grouped_kernel_ok(x.t(), grad):  # an expert without rows gets 0, whatever the kernel gives
        empty = offs.diff(prepend=offs.new_zeros(1)) == 0  # (B200: pytorch#172439)
        return torch._grouped_mm(x.t(), grad, offs=offs).masked_fill_(empty[:, None, None], 0)
    rows = offs.diff(prepend=offs.new_zeros(1)).tolist()  # experts without rows: zeros
    return torch.stack([x_e.t() @ g_e for x_e, g_e in zip(x.split(rows), grad.split(rows))])


grouped_mm.register_fake(lambda x, w, offs: x.new_empty(x.shape[0], w.shape[2]))
grouped_mm_weight_grad.register_fake(
    lambda x, grad, offs: x.new_empty(offs.shape[0], x.shape[1], grad.shape[1]))


def grouped_mm_backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = grouped_mm(grad, w.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
    grad_w = grouped_mm_weight_grad(x, grad, offs) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


grouped_mm.register_autograd(
    grouped_mm_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


# -----------------------------------------------------------------------------
# online SeqTopK by counting

def cached_at_least(past, candidates):
    """For each candidate (B, T, R): how many of the Expert Cache's (B, P, R) score at least as
    high, in chunks that bound the (B, chunk*R, P*R) table."""
    B, T, R = candidates.shape
    cached = past.reshape(B, 1, -1)
    chunk = max(1, 2 ** 24 // max(1, B * R * cached.shape[-1]))
    counts = [(cached >= candidates[:, t0:t0 + chunk].reshape(B, -1, 1)).sum(-1, dtype=torch.int32)
              for t0 in range(0, T, chunk)]
    return (counts[0] if len(counts) == 1 else torch.cat(counts, dim=1)).view(B, T, R)


def online_seqtopk_counted(scores, k, min_k, max_k, strict=False, past=None, spent=None,
                           n_past=None):
    """router.online_seqtopk_mask for new tokens (B, T, N) after the Expert Cache past (B, P, R)
    of n_past tokens (default P; rows past them unwritten: a static buffer) that took spent (B,):
    the mask and the new tokens' Expert Cache rows (B, T, R)."""
    B, T, N = scores.shape
    R = max_k - min_k  # a token's candidates: its entries of rank [min_k, max_k)
    P = 0 if past is None else past.shape[1]
    if n_past is None:
        n_past = P
    elif P:  # rows past n_past are not yet written: NaN, never at least as high as anything
        unwritten = torch.arange(P, device=scores.device)[:, None] >= n_past  # (P, 1)
        past = past.masked_fill(unwritten, float('nan'))
    dev = scores.device
    ranked, order = scores.topk(max_k, dim=-1)  # (B, T, max_k), as router.py ranks them
    candidates = ranked.narrow(-1, min_k, R)  # (B, T, R)
    # A candidate of token m is taken iff fewer than m*(k - min_k) candidates of tokens 1..m come
    # before it: earlier tokens' scoring >= it (earlier tokens win ties) and its token's better
    # ranks. `before` counts them, the candidate itself included.
    if T == 1:  # a decoding step
        mask = online_token_counted(scores[:, 0], ranked[:, 0], order[:, 0], past, n_past, k,
                                    min_k, max_k, spent if strict else None)
        return mask[:, None], candidates
    # Sort the new candidates once (stable over the token-major flattening: ties go by token, then
    # rank); those before a candidate of token m are the ones placed at or ahead of it that belong
    # to tokens <= m. Counted in blocks of S tokens, ~T*T*R/S + T*S*R*R work: earlier blocks' by a
    # running count per block start, its own block's by comparing places directly.
    ordered = candidates.reshape(B, T * R).sort(dim=-1, descending=True, stable=True).indices
    token_of = ordered // R
    S = 16
    n_blocks = -(-T // S)
    place = torch.full((B, n_blocks * S * R), T * R, dtype=ordered.dtype, device=dev)  # pad: last
    place.narrow(1, 0, T * R).scatter_(-1, ordered, torch.arange(T * R, device=dev).expand(B, -1))
    place = place.view(B, n_blocks, S * R)
    token = torch.arange(S, device=dev).repeat_interleave(R)
    same_block_earlier = token[None, :] <= token[:, None]  # (candidate, other)
    before = torch.empty(B, n_blocks, S * R, dtype=torch.int32, device=dev)
    chunk = max(1, 2 ** 24 // max(1, B * (T * R + (S * R) ** 2)))  # blocks at once: bounds memory
    for b0 in range(0, n_blocks, chunk):
        here = place[:, b0:b0 + chunk]  # (B, blocks, S*R)
        start = torch.arange(b0, b0 + here.shape[1], device=dev) * S
        earlier = (token_of[:, None, :] < start[None, :, None]).cumsum(dim=-1, dtype=torch.int32)
        in_block = ((here[:, :, None, :] <= here[..., None]) & same_block_earlier).sum(
            -1, dtype=torch.int32)
        before[:, b0:b0 + chunk] = earlier.gather(-1, here.clamp_max(T * R - 1)) + in_block
    before = before.view(B, -1).narrow(1, 0, T * R).view(B, T, R)
    if P:  # the Expert Cache's tokens are all earlier
        before += cached_at_least(past, candidates)
    position = n_past + torch.arange(1, T + 1, device=dev)  # m, 1-based
    counts = (before <= (position * (k - min_k))[:, None]).sum(dim=-1) + min_k  # (B, T)
    if strict:  # spent_m = min(spent_{m-1} + count_m, m*k), in closed form: a cumulative min
        spent = torch.zeros(B, dtype=torch.long, device=dev) if spent is None else spent
        total = counts.cumsum(dim=1)
        slack = torch.cat([spent[:, None], position * k - total], dim=1).cummin(dim=1).values
        capped = total + slack[:, 1:]
        counts = capped - torch.cat([spent[:, None], capped[:, :-1]], dim=1)
    rank = torch.arange(max_k, device=dev)  # a token takes its experts of rank < its count
    taken = rank < counts[..., None]  # (B, T, max_k)
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, taken), candidates


def online_token_counted(scores, ranked, order, past, n_past, k, min_k, max_k, spent=None):
    """router.online_seqtopk_mask by counting, for token m = n_past + 1 (scores (B, N), their
    best max_k ranked (B, max_k) with their experts' order) after the Expert Cache past (B, P, R)
    of n_past tokens (past None: none; no row past them): its candidate of rank r wins when fewer
    than m*(k - min_k) candidates come before it, the cached ones scoring at least as high
    (earlier tokens win ties) and its own r better ranks."""
    B, R, m = scores.shape[0], max_k - min_k, n_past + 1
    rank = torch.arange(max_k, device=scores.device)
    ahead = rank[:R].expand(B, R)  # (B, R): its better ranks
    if past is not None:  # (B, R): the cached ones at least as high
        ahead = ahead + (past.reshape(B, -1, 1) >= ranked[:, None, min_k:]).sum(1)
    count = min_k + (ahead < m * (k - min_k)).sum(-1)  # (B,): its wins are a run of its ranks
    if spent is not None:
        count = torch.minimum(count, m * k - spent)
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, rank < count[:, None])
