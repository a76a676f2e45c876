"""
Fast paths: what router.py and experts.py define, computed faster. None is needed to understand
the model and each is tested equal to its plain definition. The scripts pass them to the model
explicitly (GPT.forward's `fast=`); without them every idea runs as its plain definition.

- grouped_mm: experts.expert_loop in one kernel (torch._grouped_mm), which compile can trace;
  moe_experts: experts.moe_sorted with it, and with the pair count known in advance.
- online_seqtopk_mask: router.online_seqtopk_mask for many tokens at once by counting instead of
  token by token, against a static Expert Cache in a few ops for one decoding token, and with
  the strict budget in closed form.
- compiled_decode: a decoding step compiled to one graph (CUDA graphs on a GPU), each token
  running a fixed number of (token, expert) pairs; on the CPU its experts run in one C++ op
  (experts_cpu.cpp) that runs only the experts a token takes.
"""
import functools
import os
import subprocess
import warnings
from typing import Callable, NamedTuple

import torch
from torch.nn import functional as F

from experts import expert_loop, moe_sorted


class Paths(NamedTuple):
    """What the model computes faster when given (GPT.forward(..., fast=Paths)): the MoE layer's
    experts (x, mask, gates, moe, online) -> y, and SeqTopK's online rule (scores, k, min_k,
    max_k, strict, layer_cache) -> mask."""
    experts: Callable
    online_mask: Callable


# -----------------------------------------------------------------------------
# the grouped matmul: experts.expert_loop in one kernel

def grouped_kernel_runs(device_type, dtype, capability=None):
    """Whether torch._grouped_mm runs as one kernel with no host sync: on the CPU in fp32, bf16 and
    fp16; on CUDA only in bf16 on compute capability 9.x (H100, H200) and 10.x (B200). Elsewhere
    (A100, L4, RTX 30-50, fp32 or fp16) torch falls back to copying the offsets to the host and a
    matmul per expert: experts.expert_loop, the same."""
    if device_type == 'cpu':
        return dtype in (torch.float32, torch.bfloat16, torch.float16)
    return device_type == 'cuda' and dtype == torch.bfloat16 and capability[0] in (9, 10)


def grouped_kernel_ok(*mats):
    """Whether torch._grouped_mm takes these matrices as one kernel: grouped_kernel_runs for their
    device, and 16-byte aligned rows (or columns, transposed)."""
    def ok(m):
        capability = torch.cuda.get_device_capability(m.device) if m.is_cuda else None
        aligned = min(m.stride()[-2:]) == 1 and max(m.stride()[-2:]) * m.element_size() % 16 == 0
        return grouped_kernel_runs(m.device.type, m.dtype, capability) and aligned
    return hasattr(torch, '_grouped_mm') and all(ok(m) for m in mats)


# A custom op with its gradient, so that torch.compile traces through it: torch._grouped_mm has
# no fp32 CPU kernel for compile's fake tensors, and the loop (where the kernel cannot run) syncs.
@torch.library.custom_op('seqmoe::grouped_mm', mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """experts.expert_loop: x (P, C) grouped by expert, w (N, C, H) -> (P, H)."""
    if grouped_kernel_ok(x, w):
        return torch._grouped_mm(x, w, offs=offs)
    return expert_loop(x, w, offs)


@torch.library.custom_op('seqmoe::grouped_mm_weight_grad', mutates_args=())
def grouped_mm_weight_grad(x: torch.Tensor, grad: torch.Tensor,
                           offs: torch.Tensor) -> torch.Tensor:
    """The gradient of grouped_mm's w: each expert's x rows, transposed, times its grad rows."""
    if grouped_kernel_ok(x.t(), grad):  # an expert without rows gets 0, whatever the kernel gives
        empty = offs.diff(prepend=offs.new_zeros(1)) == 0  # (B200: pytorch#172439)
        return torch._grouped_mm(x.t(), grad, offs=offs).masked_fill(empty[:, None, None], 0)
    out = x.new_zeros(offs.shape[0], x.shape[1], grad.shape[1])  # experts without rows: zeros
    ends = offs.tolist()
    for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
        torch.mm(x[start:end].t(), grad[start:end], out=out[e])
    return out


grouped_mm.register_fake(lambda x, w, offs: x.new_empty(x.shape[0], w.shape[2]))
grouped_mm_weight_grad.register_fake(
    lambda x, grad, offs: x.new_empty(offs.shape[0], x.shape[1], grad.shape[1]))


def grouped_mm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def grouped_mm_backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = grouped_mm(grad, w.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
    grad_w = grouped_mm_weight_grad(x, grad, offs) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


grouped_mm.register_autograd(grouped_mm_backward, setup_context=grouped_mm_setup)


def moe_experts(x, mask, gates, moe, online):
    """experts.moe_loop as the sorted dispatch, with the grouped kernel (moe_impl='grouped') and,
    where the router knows it (the exact budgets), the pair count: static shapes, no host sync,
    so that compile makes one graph of the training forward."""
    mm = grouped_mm if moe.config.moe_impl == 'grouped' else expert_loop
    n_pairs = moe.router.n_pairs(mask.shape[0], online)
    return moe_sorted(x, mask, gates, moe.w_fc, moe.w_proj, mm, n_pairs)


# -----------------------------------------------------------------------------
# online SeqTopK by counting

def cached_at_least(past, candidates):
    """For each candidate (B, T, R) of the new tokens: how many of the Expert Cache's (B, P, R)
    score at least as high (int32), compared in chunks that bound the (B, chunk*R, P*R) table."""
    B, T, R = candidates.shape
    cached = past.reshape(B, 1, -1)
    chunk = max(1, 2 ** 24 // max(1, B * R * cached.shape[-1]))
    counts = [(cached >= candidates[:, t0:t0 + chunk].reshape(B, -1, 1)).sum(-1, dtype=torch.int32)
              for t0 in range(0, T, chunk)]
    return (counts[0] if len(counts) == 1 else torch.cat(counts, dim=1)).view(B, T, R)


def online_seqtopk_mask(scores, k, min_k, max_k, past=None, n_past=None, spent=None,
                        strict=False):
    """router.online_seqtopk_mask for the newest T tokens scores (B, T, N), after earlier ones.
    past (B, P, R): the Expert Cache, router.expert_cache_rows of the earlier tokens (-inf in
    slots not yet written); n_past: how many there are (default P; a tensor in a decoding step,
    whose static cache is longer); spent (B,): the experts they took (for strict)."""
    B, T, N = scores.shape
    R = max_k - min_k  # a token's candidates: its entries of rank [min_k, max_k)
    P = 0 if past is None else past.shape[1]
    n_past = P if n_past is None else n_past
    dev = scores.device
    ranked, order = scores.topk(max_k, dim=-1)  # (B, T, max_k), as router.py ranks them
    candidates = ranked.narrow(-1, min_k, R)  # (B, T, R)
    # A candidate of token m is taken iff fewer than m*(k - min_k) candidates of tokens 1..m come
    # before it: earlier tokens' scoring >= it (earlier tokens win ties) and its token's better
    # ranks. `before` counts them, the candidate itself included.
    if T == 1 and not strict:  # a decoding step, m = n_past + 1: as few ops as it can
        # its candidate of rank min_k + j is taken iff at most m*(k - min_k) - 1 - j cached ones
        # score at least as high; both sides move monotonically in j: the taken ranks are a prefix
        before = cached_at_least(past if P else scores.new_empty(B, 0, R), candidates).view(B, R)
        taken = before <= (n_past + 1) * (k - min_k) - 1 - torch.arange(R, device=dev)
        mask = torch.zeros_like(scores, dtype=torch.bool)
        mask.scatter_(-1, order.narrow(-1, 0, min_k), True)
        return mask.scatter_(-1, order.narrow(-1, min_k, R), taken.view(B, 1, R))
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
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, rank < counts[..., None])


def online_mask(scores, k, min_k, max_k, strict, cache):
    """online_seqtopk_mask against a generation's LayerCache (whole static buffer, its position a
    tensor: no host sync), or none."""
    past = (cache.expert_cache, cache.n_past(), cache.spent) if cache is not None else (None,) * 3
    return online_seqtopk_mask(scores, k, min_k, max_k, *past, strict=strict)


# what train.py, bench.py and a generation pass to the model for speed
FAST = Paths(experts=moe_experts, online_mask=online_mask)


# -----------------------------------------------------------------------------
# the compiled decoding step: each token's experts in a fixed number of slots

def slot_pairs(mask, gates, slots):
    """Each token's experts in `slots` slots (M, slots), those it takes first, and their gates; a
    slot it does not take holds its first expert again with gate 0 (no other weights are read)."""
    taken, expert = mask.to(gates.dtype).topk(slots, dim=-1)
    expert = torch.where(taken > 0, expert, expert[:, :1])
    return expert, gates.gather(-1, expert) * taken


def slot_experts(x, expert, gate, w_fc, w_proj):
    """experts.moe_loop over (M, slots) experts and gates, each pair's expert weights gathered
    (as gpt-fast decodes Mixtral): no shape depends on the data. The matrices are cast after the
    gather: a bf16 step reads only the experts it uses."""
    M, C = x.shape
    expert = expert.flatten()
    h = F.gelu(torch.bmm(x.repeat_interleave(gate.shape[1], dim=0).unsqueeze(1),
                         w_fc.index_select(0, expert).to(x.dtype)))  # (P, 1, H)
    y = torch.bmm(h * gate.reshape(-1, 1, 1), w_proj.index_select(0, expert).to(x.dtype))
    return y.view(M, -1, C).sum(dim=1)


def no_experts(x, expert, gate, w_fc, w_proj):
    return torch.zeros_like(x)


def decode_experts(x, mask, gates, moe, online, slots=None, cpu=False):
    """The experts of a decoding step, each token in `slots` slots (default the router's max_k;
    a router without a bound counts its pairs: moe_experts). On the CPU in float32 the C++ op
    runs only the slots a token takes, splitting each expert's columns over the threads; without
    it, inductor's kernel runs the slots, dealt to the threads, those past top_k only in a step
    where a token takes one (torch.cond: a branch on the host, no shape from the data)."""
    slots = slots or moe.router.max_k()
    if slots is None:
        return moe_experts(x, mask, gates, moe, online)
    expert, gate = slot_pairs(mask, gates, slots)  # (M, slots) each
    w_fc, w_proj = moe.w_fc, moe.w_proj
    if not cpu:
        return slot_experts(x, expert, gate, w_fc, w_proj)
    if x.dtype == w_fc.dtype == torch.float32 and cpu_kernel():
        return torch.ops.seqmoe.token_experts(x, expert, gate, w_fc, w_proj)
    usual = min(moe.config.top_k, slots)
    order = dealt(usual, cpu_threads())
    y = slot_experts(x, expert[:, order], gate[:, order], w_fc, w_proj)
    if usual == slots:
        return y
    rest = (x, expert[:, usual:], gate[:, usual:], w_fc, w_proj)
    return y + torch.cond(gate[:, usual:].ne(0).any(), slot_experts, no_experts, rest)


# inductor's settings for the CPU step, where every matmul has one row (one token)
CPU_DECODE_OPTIONS = {
    'cpp_wrapper': True,  # the step's kernel calls in C++, no interpreter between them
    'post_grad_fusion_options': {'decompose_mm_pass': {}},  # one-row matmuls as fused reductions
    'realize_opcount_threshold': 4,  # an expert's activations stored once, not recomputed per read
}


def compiled_decode(model, slots=None):
    """model.decode_token compiled once (fullgraph; on CUDA replayed as a CUDA graph), with the
    fast paths and each token's experts in `slots` slots (default: its router's max_k), as a
    decode(idx, cache) for model.generate."""
    cuda = next(model.parameters()).is_cuda
    experts = functools.partial(decode_experts, slots=slots, cpu=not cuda)
    paths = FAST._replace(experts=experts)
    compiled = torch.compile(functools.partial(model.decode_token, fast=paths), fullgraph=True,
                             mode='reduce-overhead' if cuda else None,
                             options=None if cuda else CPU_DECODE_OPTIONS)

    def decode(idx, cache):
        if idx.is_cuda:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are read: replay
        return compiled(idx, cache)
    return decode


def dealt(slots, threads):
    """An order of the slots for a compiled CPU step, whose loop over them the threads split into
    contiguous chunks: the ranks dealt round-robin to the chunks, so each thread gets its share of
    the experts a token takes (the first ranks) and of the idle slots; the step waits for the
    slowest thread."""
    chunk = -(-slots // threads)
    chunks = -(-slots // chunk)
    return [rank for first in range(chunks) for rank in range(first, slots, chunks)]


@torch.compiler.assume_constant_result  # read when the step compiles: a constant of its graph
def cpu_threads():
    return torch.get_num_threads()


@torch.compiler.assume_constant_result  # decided when the step compiles: a constant of its graph
def cpu_kernel():
    """Whether the op of experts_cpu.cpp can run: built on first use (about 20 s, then loaded from
    torch's extension cache) with the C++ compiler and ninja that inductor uses too."""
    return built_cpu_kernel()


@functools.cache  # one build (or one failed try) per process
def built_cpu_kernel():
    from torch.utils import cpp_extension  # here: on a CUDA torch without a GPU, importing it warns
    try:
        source = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'experts_cpu.cpp')
        cpp_extension.load('seqmoe_experts_cpu', [source], is_python_module=False,
                           extra_cflags=['-O3', '-march=native', '-fopenmp'],
                           extra_ldflags=['-fopenmp'])
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        warnings.warn(f"experts_cpu.cpp could not be built ({why}); the compiled CPU decoding step "
                      f"runs inductor's kernel over every slot instead")
        return False
    torch.library.register_fake('seqmoe::token_experts')(
        lambda x, expert, gate, w_fc, w_proj: torch.empty_like(x))
    return True
