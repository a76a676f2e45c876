"""
The experts' side of a MoE layer: one dispatch path from any routing mask to the experts' outputs,
for every router (model.py's MoE layer calls it), and the grouped matmuls it runs on.

The (token, expert) pairs a mask selects are sorted by expert, each pair's token is gathered, both
expert matmuls run as one grouped matmul each (torch._grouped_mm where it can run, else one matmul
per expert), the outputs are scaled by the gates and added back to their tokens.
"""
import functools
import os
import subprocess
import warnings

import torch
from torch.nn import functional as F


def grouped_kernel_ok(kernel, *mats):
    """Whether to run torch._grouped_mm: it takes fp32, bf16 and fp16 on CPU (not float64), bf16 on CUDA
    GPUs of compute capability 8.0 or more (other devices and older GPUs take the loop), and 16-byte
    aligned rows (or columns, for a transposed operand)."""
    return kernel and hasattr(torch, '_grouped_mm') and all(
        (m.device.type == 'cpu' and m.dtype in (torch.float32, torch.bfloat16, torch.float16)
         or m.device.type == 'cuda' and m.dtype == torch.bfloat16 and torch.cuda.get_device_capability(m.device) >= (8, 0))
        and min(m.stride()[-2:]) == 1 and max(m.stride()[-2:]) * m.element_size() % 16 == 0 for m in mats)


def expert_groups(offs):
    """(expert, first row, end row) of each non-empty group; a host sync, so only the fallback uses it."""
    ends = offs.tolist()
    return [(e, start, end) for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)) if end > start]


def expert_matmul(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, kernel: bool) -> torch.Tensor:
    """Each expert's rows of x times its matrix: x (P, C) grouped by expert, w (N, C, H) -> (P, H)."""
    if grouped_kernel_ok(kernel, x, w):
        return torch._grouped_mm(x, w, offs=offs)
    out = x.new_empty(x.shape[0], w.shape[2])
    for e, start, end in expert_groups(offs):  # one matmul per expert with tokens
        torch.mm(x[start:end], w[e], out=out[start:end])
    return out


# The grouped matmul as two custom ops: torch.compile traces through them (their fake kernels give the
# output shapes), so the model compiles to one graph, and in eager mode each picks its kernel.
grouped_mm = torch.library.custom_op('seqmoe::grouped_mm', expert_matmul, mutates_args=())


@torch.library.custom_op('seqmoe::grouped_mm_weight_grad', mutates_args=())
def grouped_mm_weight_grad(x: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor, kernel: bool) -> torch.Tensor:
    """The gradient of grouped_mm's w: each expert's x rows, transposed, times its grad rows -> (N, C, H)."""
    if grouped_kernel_ok(kernel, x.t(), grad):
        return torch._grouped_mm(x.t(), grad, offs=offs)
    out = x.new_zeros(offs.shape[0], x.shape[1], grad.shape[1])  # experts without tokens get zeros
    for e, start, end in expert_groups(offs):
        torch.mm(x[start:end].t(), grad[start:end], out=out[e])
    return out


@grouped_mm.register_fake
def _(x, w, offs, kernel):
    return x.new_empty(x.shape[0], w.shape[2])


@grouped_mm_weight_grad.register_fake
def _(x, grad, offs, kernel):
    return x.new_empty(offs.shape[0], x.shape[1], grad.shape[1])


def grouped_mm_setup(ctx, inputs, output):
    x, w, offs, kernel = inputs
    ctx.save_for_backward(x, w, offs)
    ctx.kernel = kernel


def grouped_mm_backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = grouped_mm(grad, w.transpose(1, 2), offs, ctx.kernel) if ctx.needs_input_grad[0] else None
    grad_w = grouped_mm_weight_grad(x, grad, offs, ctx.kernel) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None, None


grouped_mm.register_autograd(grouped_mm_backward, setup_context=grouped_mm_setup)


def dispatch(x, mask, weights, w_fc, w_proj, n_pairs=None, kernel=True, slots=None, budget=None):
    """The one path from any routing mask to expert outputs.

    x: (M, C) tokens; mask, weights: (M, N), any number of experts per token; w_fc: (N, C, H),
    w_proj: (N, H, C), cast here to x's dtype (in decoding only the experts it uses: a bf16 step
    then reads a few experts' weights, not all). Returns sum_i weights[:, i] * expert_i(x) of shape (M, C).
    n_pairs: how many (token, expert) pairs the mask selects, when the router knows it in advance
    (topk, offline seqtopk, batchtopk in training: M * top_k). Then every shape is fixed and nothing
    waits on the device; None (relu, batchtopk's threshold, online seqtopk) finds them: one host sync.
    kernel: use torch._grouped_mm where it can run (in inference with fewer pairs than experts, as in
    decoding, one batched matmul over the pairs' gathered expert matrices), else one matmul per expert.
    slots: in a decoding step, the most experts a token takes (the router's bound): each token then
    runs exactly `slots` pairs, those it does not take with a zero gate, so the step's shapes are static.
    budget: with slots, the experts a token takes on average (the router's top_k): on the CPU, where the
    C++ op cannot run, the slots past it run only in a step where a token takes one of them.
    """
    M, N = mask.shape
    if slots is not None:
        return slot_dispatch(x, mask, weights, w_fc, w_proj, slots, budget)
    selected = mask.t().reshape(-1)  # expert-major: expert 0's tokens first, then expert 1's, ...
    if n_pairs is None:  # a size known only on the host: that sync is unavoidable, and nonzero is it in one op
        pair = selected.nonzero().squeeze(1)
    else:  # the same pairs in a tensor of a size given in advance: no sync, no data-dependent shape
        pair = torch.nonzero_static(selected, size=n_pairs).squeeze(1)
    token_idx = pair % M
    gate = weights.t().reshape(-1).index_select(0, pair)
    inference = not torch.is_grad_enabled() and not torch.compiler.is_compiling()
    if inference and kernel and pair.shape[0] < N:  # fewer pairs than experts (decoding): each pair's
        # expert matrices gathered and one batched matmul; on CPU 2x faster than a matmul per expert
        expert = pair // M
        h = F.gelu(torch.bmm(x.index_select(0, token_idx).unsqueeze(1), w_fc.index_select(0, expert).to(x.dtype)))
        y = torch.bmm(h * gate[:, None, None], w_proj.index_select(0, expert).to(x.dtype)).squeeze(1)
        return torch.zeros_like(x).index_add_(0, token_idx, y)
    w_fc, w_proj = w_fc.to(x.dtype), w_proj.to(x.dtype)
    offs = mask.sum(0).cumsum(0).to(torch.int32)  # where each expert's group of rows ends
    h = F.gelu(expert_mm(x.index_select(0, token_idx), w_fc, offs, kernel, inference))
    y = expert_mm(h * gate.unsqueeze(-1), w_proj, offs, kernel, inference)  # scale the narrower h, not y
    return torch.zeros_like(x).index_add_(0, token_idx, y)


def slot_dispatch(x, mask, weights, w_fc, w_proj, slots, budget=None):
    """A decoding step's experts with static shapes: each token's `slots` slots hold the experts it takes,
    then its first expert again with a zero gate (so no other expert's weights are read). On a GPU all slots
    run, as one CUDA graph replays them. On the CPU, where a step's time is mostly its experts' matmuls, the
    C++ op of experts_cpu.cpp runs only the slots taken; where it cannot be built, inductor's kernel runs
    the slots, those past `budget` under torch.cond, only when a token takes one (on the bench model, online
    seqtopk's token takes more than top_k experts in a third of a layer's steps): a branch on the host, with
    no shape depending on the data."""
    taken, expert = mask.to(x.dtype).topk(slots, dim=-1)  # the experts it takes come first
    expert = torch.where(taken > 0, expert, expert[:, :1])
    gate = weights.gather(-1, expert) * taken
    if x.device.type != 'cpu':
        return slot_experts(x, expert, gate, w_fc, w_proj)
    if x.dtype == w_fc.dtype == torch.float32 and cpu_kernel():
        return torch.ops.seqmoe.token_experts(x, expert, gate, w_fc, w_proj)
    usual = min(budget or slots, slots)
    order = dealt(usual, cpu_threads())  # see dealt
    y = slot_experts(x, expert[:, order], gate[:, order], w_fc, w_proj)
    if usual == slots:
        return y
    rest = (x, expert[:, usual:], gate[:, usual:], w_fc, w_proj)
    return y + torch.cond(taken[:, usual:].any(), slot_experts, no_experts, rest)


@torch.compiler.assume_constant_result  # decided when the step compiles: a constant of its graph
def cpu_kernel():
    """Whether the op of experts_cpu.cpp can run: built on first use (about 20 s on 2 cores, then loaded from
    torch's extension cache), with the system's C++ compiler and ninja, as inductor compiles its own kernels."""
    return built_cpu_kernel()


@functools.cache  # one build (or one failed try) per process
def built_cpu_kernel():
    # imported here, not at the top: on a CUDA build of torch without a GPU, importing it prints a warning,
    # which every script would otherwise print before its first line
    from torch.utils import cpp_extension
    try:
        cpp_extension.load('seqmoe_experts_cpu', [os.path.join(os.path.dirname(__file__), 'experts_cpu.cpp')],
                           extra_cflags=['-O3', '-march=native', '-fopenmp'], extra_ldflags=['-fopenmp'],
                           is_python_module=False)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        warnings.warn(f"experts_cpu.cpp could not be built ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                      f"the compiled CPU decoding step runs inductor's kernel over every slot instead")
        return False
    torch.library.register_fake('seqmoe::token_experts')(lambda x, expert, gate, w_fc, w_proj: torch.empty_like(x))
    return True


def slot_experts(x, expert, gate, w_fc, w_proj):
    """sum over slots s of gate[:, s] * expert[:, s](x): each slot's expert matrices gathered, one batched matmul."""
    M, C = x.shape
    slots = expert.shape[1]
    tokens = x.repeat_interleave(slots, dim=0).unsqueeze(1)  # (M * slots, 1, C)
    expert = expert.flatten()
    h = F.gelu(torch.bmm(tokens, w_fc.index_select(0, expert).to(x.dtype)))
    y = torch.bmm(h * gate.reshape(-1, 1, 1), w_proj.index_select(0, expert).to(x.dtype))
    return y.view(M, slots, C).sum(dim=1)


def no_experts(x, expert, gate, w_fc, w_proj):
    return torch.zeros_like(x)


def dealt(slots, threads):
    """An order of the slots for a compiled CPU step, whose loop over them the threads split into contiguous
    chunks: the ranks dealt round-robin to the chunks, so that each thread gets its share of the experts a
    token takes (the first ranks) and of the idle slots, not one thread all the taken and another the idle.
    The step waits for its slowest thread: of 4 slots on 2 threads, a token's 2 taken experts would otherwise
    both run on one."""
    chunk = -(-slots // threads)
    chunks = -(-slots // chunk)
    return [rank for first in range(chunks) for rank in range(first, slots, chunks)]


@torch.compiler.assume_constant_result  # read when the step compiles: a constant of its graph
def cpu_threads():
    return torch.get_num_threads()


def expert_mm(x, w, offs, kernel, inference):
    """grouped_mm, by the cheapest path that is right: the custom op (autograd and compile for every
    kernel) only where it is needed; eagerly, torch._grouped_mm with its own autograd where it runs (a
    Python custom op costs ~0.1 ms a call in a training step), and no autograd at all in inference."""
    if inference:
        return expert_matmul(x, w, offs, kernel)
    if not torch.compiler.is_compiling() and grouped_kernel_ok(kernel, x, w):
        return torch._grouped_mm(x, w, offs=offs)
    return grouped_mm(x, w, offs, kernel)
