"""
The experts and the model around them as tests: the textbook loop, the sorted dispatch and its
grouped kernel equal from any routing mask, static shapes for the exact budgets, float64
gradients, bf16 experts, whole-model compile, and on a GPU (skipped without one) the same in CUDA.
Run: python -m pytest -q
"""
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fast
import sample
from cache import Cache
from conftest import HANG, counting_batches, needs_cuda, tiny_config, train_step, trained_tiny
from fast import moe_sorted
from model import GPT, moe_loop, rotate
from router import ROUTERS, step_ks, topk_mask
from test_graphs import assert_replayed_in_most_steps, cuda_graphs_counted


# -----------------------------------------------------------------------------
# the experts: from any mask to expert outputs, each way equal to a per-token reference

def naive_moe(x, mask, weights, w_fc, w_proj):
    """Reference: every token, every selected expert, one at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e in mask[t].nonzero().flatten().tolist():
            h = torch.nn.functional.gelu(x[t] @ w_fc[e])
            out[t] = out[t] + weights[t, e] * (h @ w_proj[e])
    return out


# the textbook loop, the sorted dispatch with a matmul per expert, and with fast.py's grouped kernel
EXPERTS = dict(textbook=moe_loop,
               sorted=moe_sorted,
               grouped=lambda *a, n_pairs=None: moe_sorted(*a, fast.grouped_mm, n_pairs))


@pytest.mark.parametrize("H", [12, 20])  # the gate before w_proj (on h, narrower) or after
@pytest.mark.parametrize("way", EXPERTS)
def test_every_way_to_run_the_experts_equals_a_per_token_reference_forward_and_gradient(way, H):
    g = torch.Generator().manual_seed(0)
    M, C, N = 24, 16, 6
    mask = torch.rand(M, N, generator=g) < 0.35  # 0 to N experts per token; some experts idle
    mask[:, 5] = False
    mask[3] = False
    weights = torch.rand(M, N, generator=g) * mask
    params = [torch.randn(M, C, generator=g), torch.randn(N, C, H, generator=g) * 0.3,
              torch.randn(N, H, C, generator=g) * 0.3]
    grads = []
    for fn in (lambda *a: EXPERTS[way](a[0], mask, weights, a[1], a[2]),
               lambda *a: naive_moe(a[0], mask, weights, a[1], a[2])):
        leaves = [p.clone().requires_grad_() for p in params]
        out = fn(*leaves)
        (out * torch.linspace(-1, 1, C)).sum().backward()
        grads.append((out.detach(), [p.grad for p in leaves]))
    (out_a, grads_a), (out_b, grads_b) = grads
    torch.testing.assert_close(out_a, out_b, rtol=1e-4, atol=1e-5)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-5)
    assert out_a[3].abs().max() == 0  # a token with no expert gets nothing added


@pytest.mark.parametrize("H", [3, 6])
@pytest.mark.parametrize("way", EXPERTS)
def test_every_way_to_run_the_experts_passes_gradcheck_in_float64(way, H):
    g = torch.Generator().manual_seed(3)
    M, C, N = 9, 4, 5
    mask = torch.rand(M, N, generator=g) < 0.4
    mask[:, 2] = False  # an idle expert: its weights get a zero gradient
    weights = (torch.rand(M, N, generator=g, dtype=torch.float64) * mask).requires_grad_()
    inputs = [torch.randn(M, C, generator=g, dtype=torch.float64).requires_grad_(), weights,
              torch.randn(N, C, H, generator=g, dtype=torch.float64).requires_grad_(),
              torch.randn(N, H, C, generator=g, dtype=torch.float64).requires_grad_()]
    for n_pairs in (None, int(mask.sum())):  # the dynamic and the static (exact budget) paths
        run = EXPERTS[way] if way == 'textbook' else lambda *a: EXPERTS[way](*a, n_pairs=n_pairs)
        assert torch.autograd.gradcheck(lambda x, w, fc, proj: run(x, mask, w, fc, proj), inputs)


@pytest.mark.parametrize("H", [12, 20])
def test_a_token_taking_k_experts_sums_its_k_outputs_gathered_forward_and_gradient(H):
    # topk's fast path on a GPU: each token's k outputs in slots of their own, summed (no atomic
    # addition); by a matmul per expert, seqmoe's grouped op and torch's own (an H100's, here)
    g = torch.Generator().manual_seed(1)
    M, C, N, k = 24, 16, 6, 2
    mask = topk_mask(torch.rand(1, M, N, generator=g) * (torch.arange(N) < 5), k)[0]  # 5 idle
    weights = torch.rand(M, N, generator=g) * mask
    params = [torch.randn(M, C, generator=g), torch.randn(N, C, H, generator=g) * 0.3,
              torch.randn(N, H, C, generator=g) * 0.3]
    want = None
    for mm in (None, fast.expert_loop, fast.grouped_mm, fast.native_grouped_mm):
        leaves = [p.clone().requires_grad_() for p in params]
        out = (naive_moe(leaves[0], mask, weights, *leaves[1:]) if mm is None else
               moe_sorted(leaves[0], mask, weights, *leaves[1:], mm, M * k, k))
        (out * torch.linspace(-1, 1, C)).sum().backward()
        got = [out.detach()] + [p.grad for p in leaves]
        want = want or got
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert (want[2][5] == 0).all()  # the idle expert's weights: no gradient


@pytest.mark.parametrize("H", [24, 48])  # the sorted dispatch's gate before w_proj, or after
@pytest.mark.parametrize("way", ['textbook', 'sorted', 'sorted, k a token'])
def test_under_bf16_each_token_s_expert_outputs_are_summed_in_fp32(way, H):
    # every expert's output is bf16 (or fp32 where the gate multiplies it); their sum is kept in
    # fp32 and rounded once, not per addition; each output scaled by its own gate, where the way
    # puts it: on h in bf16 (the loop; sorted where H <= C), or on the fp32 output (sorted, H > C)
    g = torch.Generator().manual_seed(5)
    M, C, N = 64, 32, 16
    mask = torch.ones(M, N, dtype=torch.bool)  # every token takes every expert: 16 additions
    gates = torch.rand(M, N, generator=g).bfloat16()
    x = torch.randn(M, C, generator=g).bfloat16()
    w_fc, w_proj = torch.randn(N, C, H, generator=g) * 0.3, torch.randn(N, H, C, generator=g) * 0.3
    hs = [torch.nn.functional.gelu(x @ w_fc[i].bfloat16()) for i in range(N)]  # (M, H) bf16
    if way == 'textbook' or H <= C:
        parts = [((h * gates[:, i, None]) @ w_proj[i].bfloat16()).float() for i, h in enumerate(hs)]
    else:
        parts = [(h @ w_proj[i].bfloat16()).float() * gates[:, i, None].float()
                 for i, h in enumerate(hs)]
    in_fp32 = torch.stack(parts).sum(0).bfloat16()
    in_bf16 = functools.reduce(torch.add, [p.bfloat16() for p in parts])
    assert not torch.equal(in_fp32, in_bf16)  # the two sums differ here
    experts = (functools.partial(moe_sorted, k=N) if way == 'sorted, k a token' else
               EXPERTS[way.split(',')[0]])
    with Additions() as added:  # on the CPU a bf16 index_add_ rounds once; CUDA's, per addition
        assert torch.equal(experts(x, mask, gates, w_fc, w_proj), in_fp32)
    assert added.into and all(dtype == torch.float32 for dtype in added.into)


class Additions(TorchDispatchMode):
    """The dtypes of the tensors the experts' outputs are added into (index_add_, or a sum over
    each token's slots), while it is on."""

    def __init__(self):
        super().__init__()
        self.into = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.index_add_.default, torch.ops.aten.sum.dim_IntList) and \
                args[0].is_floating_point():
            self.into.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def test_a_float64_model_trains_a_step():
    torch.manual_seed(0)
    # float64: the loop, torch's kernel has none
    model = fast.paths(GPT(tiny_config('seqtopk')).double())
    x, y = next(counting_batches())
    before = [p.detach().clone() for p in model.parameters()]
    opt = model.configure_optimizers(0.0, 1e-3, (0.9, 0.99), 'cpu')
    _, ce, aux = model(x, y)
    (ce + aux['aux_loss']).backward()
    opt.step()
    assert ce.dtype == torch.float64 and torch.isfinite(ce)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()) if a.dim() >= 2)


def test_with_rope_a_query_s_score_for_a_key_depends_only_on_how_far_back_the_key_is():
    g = torch.Generator().manual_seed(0)
    # (B, nh, T, hs)
    q, k = torch.randn(1, 1, 1, 16, generator=g), torch.randn(1, 1, 1, 16, generator=g)

    def score(i, j):  # query at position i, key at position j
        return (rotate(q, torch.tensor([i])) * rotate(k, torch.tensor([j]))).sum().item()

    assert (score(5, 3) == pytest.approx(score(2, 0), abs=1e-5)
            == pytest.approx(score(105, 103), abs=1e-4))
    assert score(5, 3) != pytest.approx(score(5, 4), abs=1e-3)  # another distance, another score
    assert torch.equal(rotate(q, torch.tensor([0])), q)  # position 0 is not turned
    assert (torch.linalg.norm(rotate(q, torch.tensor([7])))
            == pytest.approx(torch.linalg.norm(q).item()))


def test_an_expert_width_the_grouped_kernel_cannot_take_falls_back_to_a_matmul_per_expert():
    g = torch.Generator().manual_seed(1)
    M, C, H, N = 10, 16, 5, 3  # rows of 5 floats are not 16-byte aligned
    mask = torch.rand(M, N, generator=g) < 0.5
    weights = torch.rand(M, N, generator=g) * mask
    x, w_fc, w_proj = (torch.randn(M, C, generator=g), torch.randn(N, C, H, generator=g),
                       torch.randn(N, H, C, generator=g))
    torch.testing.assert_close(EXPERTS['grouped'](x, mask, weights, w_fc, w_proj),
                               naive_moe(x, mask, weights, w_fc, w_proj), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("slots", [3, 4])
def test_a_decoding_step_s_experts_equal_the_reference(slots):
    # each pair's expert weights gathered; with slots, every token runs `slots` pairs, the experts
    # it takes and then its first again with a zero gate
    g = torch.Generator().manual_seed(2)
    M, C, H, N = 3, 16, 12, 8
    mask = torch.zeros(M, N, dtype=torch.bool)
    mask[0, [1, 6, 2]] = mask[1, 6] = True  # 3 experts, 1 expert, and none at all
    weights = torch.rand(M, N, generator=g) * mask
    x, w_fc, w_proj = (torch.randn(M, C, generator=g), torch.randn(N, C, H, generator=g),
                       torch.randn(N, H, C, generator=g))
    with torch.inference_mode():
        out = sample.slot_experts(x, *sample.slot_pairs(mask, weights, slots), w_fc, w_proj)
    torch.testing.assert_close(out, naive_moe(x, mask, weights, w_fc, w_proj), rtol=1e-4, atol=1e-5)
    assert out[2].abs().max() == 0


@pytest.mark.parametrize("router", ["topk", "seqtopk", "windowtopk", "relu"])
def test_a_decoding_step_of_every_router_equals_its_eager_one(router):
    # the slots of the routers with a bound, the counted pairs of those without
    model = trained_tiny(router)
    prompt = next(counting_batches(seed=3, B=2))[0][:, :12]
    step = fast.paths(model, experts=lambda r: functools.partial(sample.decode_experts, router=r))
    steps = {}
    for name, m in (('eager', model), ('fast', step)):
        with torch.inference_mode():
            cache = Cache(model.config)
            m(prompt[:, :-1], cache=cache)
            steps[name] = m.decode_token(prompt[:, -1:], cache)
    torch.testing.assert_close(steps['fast'][0], steps['eager'][0], rtol=1e-4, atol=1e-5)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(steps['fast'][1], steps['eager'][1]))


def test_the_model_s_files_import_neither_the_fast_paths_nor_the_scripts_tools():
    # a plain reading: model.py, router.py and cache.py run alone; and the scripts load the C++
    # build tools of torch (which warn on a CUDA build without a GPU) only if they compile
    import subprocess
    import sys
    from conftest import REPO
    probe = ("import sys, model, router, cache; print(sorted(m for m in ('fast', 'configurator', "
             "'checkpoint', 'stats') if m in sys.modules)); import fast, prepare, sample, bench; "
             "print('torch.utils.cpp_extension' in sys.modules)")
    result = subprocess.run([sys.executable, '-c', probe], cwd=REPO, capture_output=True, text=True,
                            timeout=HANG)
    assert result.stdout.split('\n')[:2] == ['[]', 'False'], result.stderr


def test_the_model_fits_in_800_lines():
    # README's reading order: model.py, router.py and cache.py, the whole model, in the lines said
    import os
    import re
    from conftest import REPO
    readme = open(os.path.join(REPO, 'README.md'), encoding='utf-8').read()
    said = int(re.search(r'are the whole model in at most (\d+) lines', readme).group(1))
    files = [open(os.path.join(REPO, f), encoding='utf-8').read() for f in ('model.py', 'router.py',
                                                                           'cache.py')]
    assert said == 800 and sum(text.count('\n') for text in files) <= said


@pytest.mark.parametrize("router", ["topk", "mrltopk", "seqtopk", "batchtopk"])
def test_the_exact_budgets_dispatch_with_static_shapes_equal_to_the_dynamic_path(
        router, monkeypatch):
    torch.manual_seed(0)
    model = fast.paths(GPT(tiny_config(router)))
    x, y = next(counting_batches(seed=7))
    # topk, mrltopk, seqtopk and batchtopk in training know their B*T*k pairs before routing ...
    assert [fast.exact_pairs(r, x.numel()) for r in model.routers()] == [x.numel() * 2] * 2
    static = train_step(model, x, y)
    # ... and give the same loss and gradients as the path that counts the pairs (relu's)
    monkeypatch.setattr(fast, 'exact_pairs', lambda router, n_tokens: None)
    dynamic = train_step(model, x, y)
    torch.testing.assert_close(static, dynamic, rtol=0, atol=0)  # loss and gradients, exactly


def test_seqtopk_trained_by_the_online_rule_counts_its_pairs_and_equals_the_plain_model():
    # --seq_causal=True: a prefix may spend more or less than m*K, so no pair count is known ahead
    torch.manual_seed(0)
    plain = GPT(tiny_config('seqtopk', seq_causal=True))
    model = fast.paths(plain)
    x, y = next(counting_batches(seed=7))
    assert [fast.exact_pairs(r, x.numel()) for r in model.routers()] == [None, None]
    torch.testing.assert_close(train_step(model, x, y), train_step(plain, x, y))


@pytest.mark.parametrize("router", ["topk", "mrltopk", "seqtopk", "batchtopk"])
def test_a_training_step_of_the_exact_budgets_never_waits_on_a_data_dependent_size(
        router, monkeypatch):
    from torch.profiler import profile
    torch.manual_seed(0)
    model = fast.paths(GPT(tiny_config(router)))
    x, y = next(counting_batches(seed=7))
    train_step(model, x, y)
    moe_ks = step_ks(model.config, 2)  # drawn outside the step, as train.py draws them
    read = []  # tensors read into Python lists: no aten op records it, so it is caught here
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, 'tolist', lambda t: read.append(t.shape) or tolist(t))
    with profile() as prof:
        train_step(model, x, y, moe_ks=moe_ks)
    def caller(event):
        return event.cpu_parent.name if event.cpu_parent is not None else None
    # no nonzero (nonzero_static, given the size, never asks), no .item() or int() (the CPU
    # grouped kernel reads its offsets itself; CUDA's does that on the device): on a GPU the step
    # never waits for the host
    host_reads = [e.name for e in prof.events() if e.name in ('aten::nonzero', 'aten::item',
                                                              'aten::_local_scalar_dense')
                  and caller(e) not in ('aten::_grouped_mm', 'aten::item')]
    assert host_reads == [] and read == []
    # and every expert matmul is the grouped kernel: 2 forward, 2 input and 2 weight gradients per
    # layer
    assert sum(e.name == 'aten::_grouped_mm' for e in prof.events()) == 6 * model.config.n_layer


@pytest.mark.parametrize("way", ['plain', 'fast'])
def test_under_bf16_autocast_the_experts_run_in_bf16_and_match_fp32(way):
    from model import MoE
    torch.manual_seed(0)
    moe = MoE(tiny_config('seqtopk', n_exp=8, top_k=2, exp_dim=64))
    if way == 'fast':
        moe.experts = functools.partial(fast.sorted_experts, router=moe.router)
    torch.nn.init.normal_(moe.w_fc, std=0.1)
    torch.nn.init.normal_(moe.w_proj, std=0.1)
    x = torch.randn(4, 32, 32)
    outputs = []
    for dtype in (torch.float32, torch.bfloat16):
        moe.zero_grad()
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y, _, (mask, scores) = moe(x)
        assert y.dtype == dtype and scores.dtype == torch.float32  # the router stays fp32
        y.float().square().sum().backward()
        outputs.append((y.float(), mask, scores, moe.w_fc.grad.clone(), moe.w_proj.grad.clone()))
    (y32, mask32, scores32, *grads32), (y16, mask16, scores16, *grads16) = outputs
    # the router's scores to the bit: its logits were not computed (or rounded) in bf16
    assert torch.equal(scores32, scores16) and torch.equal(mask32, mask16)
    torch.testing.assert_close(y16, y32, rtol=2e-2, atol=2e-2 * y32.abs().max().item())
    for g16, g32 in zip(grads16, grads32):
        torch.testing.assert_close(g16, g32, rtol=5e-2, atol=5e-2 * g32.abs().max().item())


def test_the_grouped_kernel_runs_only_where_torch_has_one_without_a_host_sync():
    from fast import grouped_kernel_ok, grouped_kernel_runs
    w = torch.zeros(4, 16, 16)
    assert grouped_kernel_ok(w) and grouped_kernel_ok(w.bfloat16())  # CPU: fp32, bf16, fp16
    assert not grouped_kernel_ok(w.double())  # float64: fast.expert_loop
    assert not grouped_kernel_ok(torch.zeros(4, 16, 3))  # rows of 12 bytes: not 16-byte aligned
    # CUDA: torch's CUTLASS kernel only in bf16 on SM 9.x and 10.x; elsewhere its fallback syncs
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert grouped_kernel_runs('cuda', bf16, (9, 0)) and grouped_kernel_runs('cuda', bf16, (10, 0))
    for capability in ((7, 5), (8, 0), (8, 6), (8, 9), (12, 0)):  # T4, A100, RTX 30, L4, RTX 50
        assert not grouped_kernel_runs('cuda', bf16, capability)
    assert (not grouped_kernel_runs('cuda', fp16, (9, 0))
            and not grouped_kernel_runs('cuda', fp32, (9, 0)))
    assert not grouped_kernel_runs('mps', fp32)


def test_an_expert_without_tokens_gets_a_zero_weight_gradient_whatever_the_kernel_returns(
        monkeypatch):
    x, grad = torch.randn(6, 16), torch.randn(6, 16)
    offs = torch.tensor([2, 2, 6, 6], dtype=torch.int32)  # experts 1 and 3 have no rows
    want = fast.grouped_mm_weight_grad(x, grad, offs)
    monkeypatch.setattr(torch, '_grouped_mm',
                        lambda a, b, offs: torch.ones(4, 16, 16))  # B200's bug
    got = fast.grouped_mm_weight_grad(x, grad, offs)
    assert (got[1] == 0).all() and (got[3] == 0).all() and (want[1] == 0).all()


@pytest.mark.compile
@pytest.mark.parametrize("router", ["topk", "seqtopk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_training_forward_compiles_to_one_graph_with_no_break(router, dtype):
    torch._dynamo.reset()
    model = fast.paths(GPT(tiny_config(router)))
    x, y = next(counting_batches())
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        explanation = torch._dynamo.explain(model)(x, y)
    assert (explanation.graph_break_count == 0
            and explanation.graph_count == 1), explanation.break_reasons


@needs_cuda
def test_cuda_bf16_dispatch_equals_the_fp32_reference_forward_and_gradient():
    g = torch.Generator().manual_seed(0)
    M, C, H, N = 256, 64, 32, 8
    mask = topk_mask(torch.rand(1, M, N, generator=g), 2)[0]
    weights = torch.rand(M, N, generator=g) * mask
    params = [torch.randn(M, C, generator=g), torch.randn(N, C, H, generator=g) * 0.3,
              torch.randn(N, H, C, generator=g) * 0.3]
    results = []
    for device, dtype in (('cpu', torch.float32), ('cuda', torch.bfloat16)):
        # fresh leaves each pass
        leaves = [p.to(device, dtype).detach().requires_grad_() for p in params]
        out = EXPERTS['grouped'](leaves[0], mask.to(device), weights.to(device, dtype), *leaves[1:],
                                 n_pairs=M * 2)
        out.float().square().sum().backward()
        results.append([t.detach().float().cpu() for t in (out, *[p.grad for p in leaves])])
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2 * want.abs().max().item())


@pytest.mark.compile
@needs_cuda
@pytest.mark.parametrize("router", ["topk", "seqtopk"])
def test_cuda_a_training_step_as_cuda_graphs_trains_as_the_eager_one(router):
    losses = {}
    with cuda_graphs_counted() as graphs:
        for way in ('eager', 'graphs'):
            torch.manual_seed(0)
            model = fast.paths(GPT(tiny_config(router)).cuda())
            run = torch.compile(model, mode='reduce-overhead') if way == 'graphs' else model
            opt = model.configure_optimizers(0.0, 3e-3, (0.9, 0.99), 'cuda')
            losses[way] = []
            for step, (x, y) in zip(range(6), counting_batches()):
                torch.compiler.cudagraph_mark_step_begin()  # as train.py, before each call
                with torch.autocast('cuda', dtype=torch.bfloat16):
                    _, ce, aux = run(x.cuda(), y.cuda())
                (ce + aux['aux_loss']).backward()
                losses[way].append(ce.item())  # read before the next replay
                opt.step()
                opt.zero_grad(set_to_none=True)
    assert_replayed_in_most_steps(graphs, 6)  # recorded, then replayed: not only never skipped
    torch.testing.assert_close(losses['graphs'], losses['eager'], rtol=2e-2, atol=2e-2)


@pytest.mark.compile
@needs_cuda
@pytest.mark.parametrize("router", ["topk", "seqtopk"])
def test_cuda_bf16_training_step_compiles_to_one_graph_and_never_syncs(router):
    from fast import grouped_kernel_runs
    if not grouped_kernel_runs('cuda', torch.bfloat16, torch.cuda.get_device_capability()):
        pytest.skip("torch's grouped kernel syncs on this GPU (README: which GPUs sync)")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = fast.paths(GPT(tiny_config(router)).cuda())
    x, y = (t.cuda() for t in next(counting_batches()))
    compiled = torch.compile(model, fullgraph=True)  # a graph break raises

    def step():  # the compiled forward and its compiled backward
        model.zero_grad(set_to_none=True)
        _, ce, aux = compiled(x, y)
        (ce + aux['aux_loss']).backward()
    with torch.autocast('cuda', dtype=torch.bfloat16):
        step()  # compiles
        step()
        torch.cuda.set_sync_debug_mode('error')  # any host sync raises
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.long
@pytest.mark.compile
def test_a_compiled_mrltopk_forward_routes_each_layer_with_the_k_the_script_drew():
    # the k's are drawn outside the model (train.py: router.step_ks per step), compiled or not
    torch._dynamo.reset()
    x, y = next(counting_batches())
    torch.manual_seed(0)
    model = fast.paths(GPT(tiny_config('mrltopk', n_exp=8, top_k=8, n_layer=3)))
    compiled = torch.compile(model)
    for seed in (1, 2):
        ks = step_ks(model.config, 3, torch.Generator().manual_seed(seed))
        runs = [forward(x, y, moe_ks=ks) for forward in (model, compiled)]
        for _, ce, aux in runs:
            assert [int(mask.sum(-1).unique()) for mask, _ in aux['routing']] == ks
        assert runs[1][1].item() == pytest.approx(runs[0][1].item(), rel=1e-5)
    assert set(ks) <= {2, 4, 8}


@pytest.mark.compile
@pytest.mark.parametrize("router", ROUTERS)
def test_torch_compile_trains_with_every_router_like_the_plain_eager_model(router):
    torch.manual_seed(0)
    model = GPT(tiny_config(router))
    x, y = next(counting_batches())
    _, eager_ce, _ = model(x, y)  # every idea in its plain form
    _, ce, aux = torch.compile(fast.paths(model))(x, y)
    (ce + aux['aux_loss']).backward()
    assert ce.item() == pytest.approx(eager_ce.item(), rel=1e-4)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("way", ['plain', 'fast'])
def test_a_nan_in_the_router_s_input_gives_a_nan_loss_never_an_error(router, way):
    # what train.py's divergence check then stops on, with its one line, whatever the router
    torch.manual_seed(0)
    model = GPT(tiny_config(router))
    x, y = next(counting_batches())
    with torch.no_grad():
        model.transformer.wte.weight[x[0, 3]] = float('nan')  # one token's embedding
    _, ce, aux = (fast.paths(model) if way == 'fast' else model)(x, y)
    assert torch.isnan(ce)
    if router in ('topk', 'seqtopk', 'batchtopk', 'mrltopk'):  # the exact budgets stay exact
        assert all(int(mask.sum()) == x.numel() * model.routers()[0].k
                   for mask, _ in aux['routing'])


def test_a_word_piece_vocabulary_is_padded_to_a_multiple_of_64_and_never_sampled():
    # GPT-2's 50257 ids: the output layer runs 50304 rows (aligned); generation sees 50257 logits
    model = GPT(tiny_config('topk', vocab_size=50257)).eval()
    assert model.lm_head.weight.shape[0] == model.transformer.wte.weight.shape[0] == 50304
    idx = torch.randint(0, 50257, (1, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert model(idx)[0].shape == (1, 1, 50257)
        assert model(idx, idx)[0].shape == (1, 4, 50304)
    assert GPT(tiny_config('topk', vocab_size=76)).lm_head.weight.shape[0] == 76  # characters


def test_the_output_layer_is_the_token_embedding_and_active_params_count_top_k_experts():
    # GPT-2's weight tying; active: what one token runs, top_k of each MoE layer's n_exp experts
    cfg = tiny_config('topk', n_exp=8, top_k=2)
    model = GPT(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    expert = 2 * cfg.n_embd * cfg.exp_dim  # its w_fc and w_proj
    assert model.num_params() - model.num_params(active=True) == len(model.routers()) * 6 * expert
