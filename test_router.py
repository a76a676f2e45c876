"""
The paper's claims as tests. Run: python -m pytest -q
"""
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from model import GPT, GPTConfig, dispatch
from router import ROUTERS, check_router, mrltopk_budgets, mrltopk_draw, seqtopk_mask, switch_balance, topk_mask

REPO = os.path.dirname(os.path.abspath(__file__))
OFFLINE_ENV = dict(os.environ, HF_DATASETS_OFFLINE='1', HF_HUB_OFFLINE='1')


def random_scores(B, T, N, seed=0, ties=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 3, (B, T, N), generator=g).float() if ties else torch.randn(B, T, N, generator=g)
    return logits.softmax(-1)


# -----------------------------------------------------------------------------
# routers

def test_topk_takes_exactly_k_experts_per_token():
    scores = random_scores(3, 17, 8)
    mask = topk_mask(scores, 3)
    assert (mask.sum(-1) == 3).all()
    # and they are the token's best: every selected score >= every unselected one
    assert (scores.masked_fill(~mask, 2).amin(-1) >= scores.masked_fill(mask, -1).amax(-1)).all()


@pytest.mark.parametrize("k,budgets", [(8, [2, 4, 8]), (4, [2, 4]), (2, [2]), (1, [1]), (6, [2, 4, 6]),
                                       (12, [2, 4, 8, 12]), (64, [2, 4, 8, 16, 32, 64])])
def test_mrltopk_draws_from_the_powers_of_two_up_to_k_plus_k_itself(k, budgets):
    assert mrltopk_budgets(k) == budgets
    draws = mrltopk_draw(k, 3000, torch.Generator().manual_seed(0))
    assert len(draws) == 3000 and all(isinstance(d, int) for d in draws)  # plain ints: static shapes
    counts = np.array([draws.count(b) for b in budgets])
    assert counts.sum() == 3000 and (abs(counts / 3000 - 1 / len(budgets)) < 0.04).all()  # uniform
    assert draws == mrltopk_draw(k, 3000, torch.Generator().manual_seed(0))  # reproducible from the seed


def test_mrltopk_routes_each_token_to_its_layers_drawn_k_in_training_and_k_at_evaluation():
    model = GPT(tiny_config('mrltopk', n_exp=8, top_k=4, n_layer=3))
    x = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(0))
    _, _, aux = model(x, moe_ks=[2, 4, 2])  # training mode: each layer its own k
    assert [mask.sum(-1).unique().tolist() for mask, _ in aux['routing']] == [[2], [4], [2]]
    for (mask, scores), k in zip(aux['routing'], (2, 4, 2)):
        assert torch.equal(mask, topk_mask(scores, k))  # the token's best k, as topk
    seen = set()
    for _ in range(20):  # no draws given: each layer draws from torch's default generator
        _, _, aux = model(x)
        seen |= {int(mask.sum(-1).unique()) for mask, _ in aux['routing']}
    assert seen == {2, 4}
    model.eval()
    _, _, aux = model(x, moe_ks=[2, 2, 2])  # evaluation ignores draws: every token takes top_k
    assert all((mask.sum(-1) == 4).all() for mask, _ in aux['routing'])
    assert torch.equal(model.generate(x[:, :3], 8, temperature=0), model.generate(x[:, :3], 8, temperature=0,
                                                                                   use_cache=False))


@pytest.mark.parametrize("k,min_k,max_k", [(2, 1, None), (3, 1, None), (2, 0, 8), (2, 2, 2), (4, 1, 8)])
def test_seqtopk_spends_exactly_T_times_k_experts_per_sequence(k, min_k, max_k):
    B, T, N = 4, 33, 8
    for ties in (False, True):
        mask = seqtopk_mask(random_scores(B, T, N, seed=k, ties=ties), k, min_k, max_k)
        assert (mask.sum(dim=(1, 2)) == T * k).all()
        per_token = mask.sum(-1)
        assert per_token.min() >= min_k
        assert per_token.max() <= (k + 2 if max_k is None else max_k)


def test_seqtopk_bounds_bind_each_token():
    # one token has all the high scores: unbounded it would take everything, bounded it gets k+2
    scores = torch.full((1, 6, 8), 0.01)
    scores[0, 0] = 0.9
    assert seqtopk_mask(scores, 2, min_k=0, max_k=8)[0, 0].sum() == 8
    assert seqtopk_mask(scores, 2, min_k=1, max_k=8)[0, 0].sum() == 7  # the other 5 keep one each
    mask = seqtopk_mask(scores, 2)
    assert mask[0, 0].sum() == 4 and (mask[0].sum(-1) >= 1).all() and mask.sum() == 12


def brute_force_best_total(scores, k, min_k, max_k):
    """Highest total score over all selections of T*k entries with per-token counts in bounds."""
    T, N = scores.shape
    best = -1.0
    for chosen in itertools.combinations(range(T * N), T * k):
        counts = np.bincount(np.array(chosen) // N, minlength=T)
        if counts.min() >= min_k and counts.max() <= max_k:
            best = max(best, float(scores.flatten()[list(chosen)].sum()))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_seqtopk_selection_is_the_highest_total_score_under_the_bounds(seed):
    T, N, k = 3, 4, 2
    for ties in (False, True):
        scores = random_scores(1, T, N, seed=seed, ties=ties)
        for min_k, max_k in [(1, 3), (0, 4), (1, 4), (2, 2)]:
            mask = seqtopk_mask(scores, k, min_k, max_k)
            got = float(scores[mask].sum())
            assert got == pytest.approx(brute_force_best_total(scores[0], k, min_k, max_k), abs=1e-6)


def test_seqtopk_is_deterministic_under_ties():
    scores = torch.full((2, 16, 8), 1 / 8)  # every entry tied
    first = seqtopk_mask(scores, 2)
    assert torch.equal(first, seqtopk_mask(scores.clone(), 2))
    assert (first.sum(dim=(1, 2)) == 32).all()


def test_seqtopk_on_a_single_token_is_topk():
    scores = random_scores(5, 1, 16, seed=3)
    for k in (1, 2, 4):
        assert torch.equal(seqtopk_mask(scores, k), topk_mask(scores, k))


@pytest.mark.parametrize("k,min_k,max_k", [(9, 1, None), (2, 3, None), (4, 1, 3), (0, 0, None)])
def test_infeasible_budgets_raise_a_clear_error(k, min_k, max_k):
    with pytest.raises(ValueError, match="top_k|bounds"):
        seqtopk_mask(random_scores(1, 4, 8), k, min_k, max_k)


def test_unknown_router_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown router 'top2'"):
        check_router('top2', 2, 8)
    with pytest.raises(ValueError, match="n_exp"):
        GPTConfig(n_exp=4, top_k=5).validate()


# -----------------------------------------------------------------------------
# dispatch: one path from any mask to expert outputs

def naive_moe(x, mask, weights, w_fc, w_proj):
    """Reference: every token, every selected expert, one at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e in mask[t].nonzero().flatten().tolist():
            h = torch.nn.functional.gelu(x[t] @ w_fc[e])
            out[t] = out[t] + weights[t, e] * (h @ w_proj[e])
    return out


@pytest.mark.parametrize("kernel", [True, False])
def test_dispatch_equals_a_per_token_reference_forward_and_gradient(kernel):
    g = torch.Generator().manual_seed(0)
    M, C, H, N = 24, 16, 12, 6
    mask = torch.rand(M, N, generator=g) < 0.35  # 0 to N experts per token; some experts idle
    mask[:, 5] = False
    mask[3] = False
    weights = torch.rand(M, N, generator=g) * mask
    params = [torch.randn(M, C, generator=g), torch.randn(N, C, H, generator=g) * 0.3,
              torch.randn(N, H, C, generator=g) * 0.3]
    grads = []
    for fn in (lambda *a: dispatch(*a[:1], mask, weights, *a[1:], kernel=kernel),
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


def test_an_expert_width_the_grouped_kernel_cannot_take_falls_back_to_a_matmul_per_expert():
    g = torch.Generator().manual_seed(1)
    M, C, H, N = 10, 16, 5, 3  # rows of 5 floats are not 16-byte aligned
    mask = torch.rand(M, N, generator=g) < 0.5
    weights = torch.rand(M, N, generator=g) * mask
    x, w_fc, w_proj = torch.randn(M, C, generator=g), torch.randn(N, C, H, generator=g), torch.randn(N, H, C, generator=g)
    torch.testing.assert_close(dispatch(x, mask, weights, w_fc, w_proj), naive_moe(x, mask, weights, w_fc, w_proj),
                               rtol=1e-4, atol=1e-5)


def train_step(model, x, y):
    """Loss and gradients of one training step (forward + backward)."""
    model.zero_grad()
    _, ce, aux = model(x, y)
    (ce + aux['aux_loss']).backward()
    return ce.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("router", ["topk", "mrltopk", "seqtopk", "batchtopk"])
def test_the_exact_budgets_dispatch_with_static_shapes_equal_to_the_dynamic_path(router, monkeypatch):
    from router import Router
    torch.manual_seed(0)
    model = GPT(tiny_config(router))
    x, y = next(counting_batches(seed=7))
    # topk, mrltopk, seqtopk and batchtopk in training know their B*T*k pairs before routing ...
    assert [b.ffn.router.fixed_pairs(x.numel()) for b in model.transformer.h] == [x.numel() * 2] * 2
    static = train_step(model, x, y)
    # ... and give the same loss and gradients as the path that counts the pairs (relu's)
    monkeypatch.setattr(Router, 'fixed_pairs', lambda self, n_tokens, causal=False: None)
    dynamic = train_step(model, x, y)
    assert torch.equal(static[0], dynamic[0])
    for a, b in zip(static[1], dynamic[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("router", ["topk", "mrltopk", "seqtopk", "batchtopk"])
def test_a_training_step_of_the_exact_budgets_never_waits_on_a_data_dependent_size(router):
    from torch.profiler import profile
    torch.manual_seed(0)
    model = GPT(tiny_config(router))
    x, y = next(counting_batches(seed=7))
    train_step(model, x, y)
    with profile() as prof:
        train_step(model, x, y)
    def caller(event):
        return event.cpu_parent.name if event.cpu_parent is not None else None
    # no nonzero, no .item() or int() (the CPU grouped kernel reads its offsets itself; CUDA's does
    # that on the device): on a GPU the step never stops to wait for the host
    host_reads = [e.name for e in prof.events() if e.name in ('aten::nonzero', 'aten::item', 'aten::tolist')
                  and caller(e) != 'aten::_grouped_mm']
    assert host_reads == []
    # and every expert matmul is the grouped kernel: 2 forward, 2 input and 2 weight gradients per layer
    assert sum(e.name == 'aten::_grouped_mm' for e in prof.events()) == 6 * model.config.n_layer


def test_under_bf16_autocast_the_experts_run_in_bf16_and_match_fp32():
    from model import MoE
    torch.manual_seed(0)
    moe = MoE(tiny_config('seqtopk', n_exp=8, top_k=2, exp_dim=64))
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
        outputs.append((y.float(), mask, moe.w_fc.grad.clone(), moe.w_proj.grad.clone()))
    (y32, mask32, *grads32), (y16, mask16, *grads16) = outputs
    assert torch.equal(mask32, mask16)  # same routing: the scores were not rounded to bf16
    torch.testing.assert_close(y16, y32, rtol=2e-2, atol=2e-2 * y32.abs().max().item())
    for g16, g32 in zip(grads16, grads32):
        torch.testing.assert_close(g16, g32, rtol=5e-2, atol=5e-2 * g32.abs().max().item())


@pytest.mark.parametrize("router", ["topk", "seqtopk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_training_forward_compiles_to_one_graph_with_no_break(router, dtype):
    torch._dynamo.reset()
    model = GPT(tiny_config(router))
    x, y = next(counting_batches())
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        explanation = torch._dynamo.explain(model)(x, y)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons


# on a GPU (skipped without one, so CI stays CPU-only)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


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
        leaves = [p.to(device, dtype).requires_grad_() for p in params]
        out = dispatch(leaves[0], mask.to(device), weights.to(device, dtype), *leaves[1:], n_pairs=M * 2)
        out.float().square().sum().backward()
        results.append([t.detach().float().cpu() for t in (out, *[p.grad for p in leaves])])
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2 * want.abs().max().item())


@needs_cuda
@pytest.mark.parametrize("router", ["topk", "seqtopk"])
def test_cuda_bf16_training_step_compiles_to_one_graph_and_never_syncs(router):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(tiny_config(router)).cuda()
    x, y = (t.cuda() for t in next(counting_batches()))
    with torch.autocast('cuda', dtype=torch.bfloat16):
        explanation = torch._dynamo.explain(model)(x, y)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        train_step(model, x, y)  # warm-up
        torch.cuda.set_sync_debug_mode('error')  # any host sync raises
        try:
            train_step(model, x, y)
        finally:
            torch.cuda.set_sync_debug_mode(0)


@needs_cuda
def test_cuda_cached_generation_equals_full_recompute():
    model = trained_tiny('seqtopk').cuda()
    prompt = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1)).cuda()
    cached = model.generate(prompt, 25, temperature=0, use_cache=True)
    assert torch.equal(cached, model.generate(prompt, 25, temperature=0, use_cache=False))


# -----------------------------------------------------------------------------
# the model trains with every router

def tiny_config(router, **kw):
    settings = dict(block_size=32, vocab_size=16, n_layer=2, n_head=2, n_embd=32, n_exp=4, top_k=2, exp_dim=32)
    return GPTConfig(router=router, **{**settings, **kw})


def counting_batches(seed=0, B=8, T=32):
    """A learnable language: counting upward mod 16 from a random start."""
    g = torch.Generator().manual_seed(seed)
    while True:
        seq = (torch.randint(0, 16, (B, 1), generator=g) + torch.arange(T + 1)) % 16
        yield seq[:, :-1], seq[:, 1:]


def train_tiny(model, steps, lr=3e-3, check=None):
    opt = model.configure_optimizers(0.0, lr, (0.9, 0.99), 'cpu')
    losses = []
    for _, (x, y) in zip(range(steps), counting_batches()):
        _, ce, aux = model(x, y)
        (ce + aux['aux_loss']).backward()
        opt.step()
        opt.zero_grad()
        model.adapt_relu()  # relu's lambda, once per step (a no-op for the other routers)
        losses.append(ce.item())
        if check:
            check(aux['routing'])
    return losses


@pytest.mark.parametrize("router", ROUTERS)
def test_a_tiny_model_learns_with_each_router(router):
    torch.manual_seed(0)
    model = GPT(tiny_config(router))
    losses = train_tiny(model, 30)
    assert all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])


@pytest.mark.parametrize("router", ["topk", "seqtopk", "batchtopk"])
def test_every_budgeted_router_spends_exactly_B_T_k_experts_in_training(router):
    def check(routing):
        for mask, _ in routing:
            B, T, _ = mask.shape
            assert mask.sum() == B * T * 2
    train_tiny(GPT(tiny_config(router)), 5, check=check)


def test_batchtopk_takes_the_top_B_T_k_entries_of_the_batch():
    from router import batchtopk_mask
    scores = random_scores(4, 9, 8, seed=1)
    mask = batchtopk_mask(scores, 2)
    assert mask.sum() == 4 * 9 * 2
    assert scores[mask].min() >= scores[~mask].max()
    assert mask.sum(-1).max() > 2  # unlike topk, tokens compete across the whole batch


def test_batchtopk_evaluation_does_not_depend_on_the_rest_of_the_batch():
    torch.manual_seed(0)
    model = GPT(tiny_config('batchtopk'))
    train_tiny(model, 10)
    thresholds = [m.ffn.router.threshold.item() for m in model.transformer.h]
    assert all(0 < t < 1 for t in thresholds)
    assert 'transformer.h.0.ffn.router.threshold' in model.state_dict()  # saved with checkpoints
    model.eval()
    x, y = next(counting_batches(seed=5, B=4))
    alone_logits, _, alone = model(x[:1], y[:1])
    batch_logits, _, batched = model(x, y)
    for (mask_alone, _), (mask_batched, _) in zip(alone['routing'], batched['routing']):
        assert torch.equal(mask_alone[0], mask_batched[0])
    torch.testing.assert_close(alone_logits[0], batch_logits[0], rtol=1e-5, atol=1e-5)


def test_relu_routing_moves_the_active_fraction_toward_k_over_n():
    torch.manual_seed(0)
    model = GPT(tiny_config('relu', n_exp=8, relu_l1_init=1e-4))
    routers = model.routers()
    target = 2 / 8
    fractions = []
    train_tiny(model, 60, check=lambda routing: fractions.append(
        np.mean([mask.float().mean().item() for mask, _ in routing])))
    start, end = abs(np.mean(fractions[:5]) - target), abs(np.mean(fractions[-10:]) - target)
    assert start > 0.15 and end < start / 2, (fractions[:5], fractions[-10:])
    assert routers[0].l1_coef.item() != 1e-4  # lambda adapted
    assert 'transformer.h.0.ffn.router.l1_coef' in model.state_dict()


def test_remoe_regulariser_is_the_switch_formula_on_the_relu_gates():
    # hand computation: 4 tokens, 3 experts, K=1: N * sum_e mean_t(gate_e) * tokens_e / (tokens * K)
    gates = torch.tensor([[0.5, 0.0, 0.0], [0.2, 0.4, 0.0], [0.0, 0.0, 0.0], [0.3, 0.0, 0.8]], requires_grad=True)
    mask = gates > 0
    mean_gate, tokens = [0.25, 0.1, 0.2], [3, 1, 1]
    expected = 3 * sum(g * n for g, n in zip(mean_gate, tokens)) / (4 * 1)
    value = switch_balance(gates, mask, 1)
    assert value.item() == pytest.approx(expected)
    value.backward()  # an L1 on each gate, weighted by its expert's token count: busy experts shrink most
    assert torch.allclose(gates.grad, torch.tensor([3.0, 1.0, 1.0]).expand(4, 3) * 3 / (4 * 4))


def test_relu_loss_is_lambda_times_remoe_regulariser_alone():
    # no softmax balance loss and no z-loss for relu, whatever their weights say
    model = GPT(tiny_config('relu', n_exp=8, aux_loss_weight=1.0, z_loss_weight=1.0, relu_l1_init=0.5))
    x = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(0))
    _, _, aux = model(x)
    expected = sum(0.5 * switch_balance(torch.relu(b.ffn.router.gate(h)), torch.relu(b.ffn.router.gate(h)) > 0, 2)
                   for b, h in zip(model.transformer.h, layer_inputs(model, x)))
    assert aux['aux_loss'].item() == pytest.approx(expected.item(), rel=1e-5)


def layer_inputs(model, x):
    """The normalised input of every block's FFN (what its router sees)."""
    h = model.transformer.wte(x) + model.transformer.wpe(torch.arange(x.shape[1]))
    inputs = []
    for block in model.transformer.h:
        h = h + block.attn(block.ln_1(h))
        inputs.append(block.ln_2(h))
        h = h + block.ffn(block.ln_2(h))[0]
    return inputs


@pytest.mark.parametrize("per_layer", [False, True])
def test_relu_steps_lambda_once_per_step_from_the_layer_mean_or_each_layer(per_layer):
    # per_layer=False is ReMoE's controller: one lambda for the model, from the mean over its layers
    model = GPT(tiny_config('relu', n_exp=8, n_layer=3, relu_l1_per_layer=per_layer))  # target 2/8 active
    routers = model.routers()
    x = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(0))
    model.adapt_relu()
    assert routers[0].l1_coef.item() == pytest.approx(1e-8)  # nothing measured yet: lambda_0 unchanged
    for router in routers:  # every logit 0: layer 0 fully open (its ReLU opens at -1), layers 1-2 shut
        torch.nn.init.zeros_(router.gate.weight)
    routers[0].threshold.fill_(-1.0)
    fractions = []  # per micro-step, per layer
    for _ in range(2):  # two micro-steps of one step
        _, _, aux = model(x)
        fractions.append([mask.float().mean().item() for mask, _ in aux['routing']])
    assert np.mean(fractions, axis=0).tolist() == [1.0, 0.0, 0.0]  # the mean over layers, 1/3, is too dense
    model.adapt_relu()
    expected = [1e-8 * 1.2, 1e-8 / 1.2, 1e-8 / 1.2] if per_layer else [1e-8 * 1.2] * 3
    assert [r.l1_coef.item() for r in routers] == pytest.approx(expected)
    # each layer's threshold moves by step x its own relative error (active - 1/4) / (1/4), never above 0
    step = model.config.relu_threshold_step
    assert [r.threshold.item() for r in routers] == pytest.approx([-1 + step * 3, -step, -step], abs=1e-6)
    assert all(r.active_count.item() == 0 for r in routers)  # measurements cleared after the step
    model.eval()
    model(x)
    model.adapt_relu()  # evaluation measures nothing: nothing changes
    assert [r.l1_coef.item() for r in routers] == pytest.approx(expected)


@pytest.mark.parametrize("threshold_step", [0.1, 0.0])
def test_a_relu_layer_with_every_gate_shut_reopens_through_its_threshold(threshold_step):
    # ReMoE's lambda only pushes gates shut: with threshold_step=0 (ReMoE exactly) a shut layer stays shut
    model = GPT(tiny_config('relu', relu_threshold_step=threshold_step))
    x = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(0))
    for router in model.routers():
        torch.nn.init.zeros_(router.gate.weight)  # every logit 0: every gate shut at threshold 0
    for _ in range(2):
        _, _, aux = model(x)
        model.adapt_relu()
    assert all((mask.sum() > 0) == (threshold_step > 0) for mask, _ in aux['routing'])


def test_relu_with_every_gate_closed_gives_no_nan():
    model = GPT(tiny_config('relu'))
    for block in model.transformer.h:
        torch.nn.init.zeros_(block.ffn.router.gate.weight)  # every logit 0: ReLU closes every gate
    x, y = next(counting_batches())
    _, ce, aux = model(x, y)
    assert all(mask.sum() == 0 for mask, _ in aux['routing'])
    (ce + aux['aux_loss']).backward()
    assert torch.isfinite(ce) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_dense_layers_between_moe_layers():
    model = GPT(tiny_config('seqtopk', moe_every=2))
    _, _, aux = model(torch.zeros(1, 8, dtype=torch.long))
    assert len(aux['routing']) == 1  # 2 layers, every second one MoE


# -----------------------------------------------------------------------------
# the scripts, end to end, offline

def run(script, *args, cwd):
    return subprocess.run([sys.executable, os.path.join(REPO, script), *args], cwd=cwd, env=OFFLINE_ENV,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
    """A folder with the built-in data prepared by prepare.py (offline)."""
    path = tmp_path_factory.mktemp('work')
    result = run('prepare.py', cwd=path)
    assert result.returncode == 0, result.stderr
    return path


def test_prepare_builds_the_builtin_shakespeare_offline(workdir):
    import pickle
    data_dir = workdir / 'data' / 'shakespeare_char'
    meta = pickle.load(open(data_dir / 'meta.pkl', 'rb'))
    train = np.fromfile(data_dir / 'train.bin', dtype=np.uint16)
    val = np.fromfile(data_dir / 'val.bin', dtype=np.uint16)
    assert len(train) > 4_000_000 and abs(len(val) / (len(train) + len(val)) - 0.1) < 0.001
    text = ''.join(meta['itos'][int(i)] for i in train[:3000])
    assert 'THESEUS:\n' in text and '**' not in text and '_' not in text and '#' not in text
    # deterministic: a second run writes the same bytes
    again = run('prepare.py', '--out_dir=again', cwd=workdir)
    assert again.returncode == 0
    assert (workdir / 'again' / 'train.bin').read_bytes() == (data_dir / 'train.bin').read_bytes()


def test_gpt2_tokenizer_is_built_offline_and_exact():
    from prepare import gpt2_encoding
    enc = gpt2_encoding()
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.n_vocab == 50257 and enc.decode([15496, 995]) == "Hello world"


def test_a_hub_dataset_offline_fails_at_once_with_one_line(tmp_path):
    result = run('prepare.py', '--dataset=roneneldan/TinyStories', cwd=tmp_path)
    assert result.returncode != 0
    assert 'Traceback' not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and '--text=PATH' in result.stderr


def test_train_then_sample_produces_text(workdir):
    out = workdir / 'out-seqtopk'
    result = run('train.py', os.path.join(REPO, 'config', 'tiny.py'), '--router=seqtopk', f'--out_dir={out}',
                 cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert (out / 'ckpt.pt').exists() and 'val ce' in result.stdout
    log = [line for line in open(out / 'log.jsonl')]
    assert any('"event": "eval"' in line for line in log)
    result = run('sample.py', f'--out_dir={out}', '--start=ROMEO:', '--max_new_tokens=40', '--num_samples=1',
                 cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith('ROMEO:') and len(result.stdout.split('---')[0]) >= 40
    assert 'experts per generated token: mean' in result.stdout
    colored = run('sample.py', f'--out_dir={out}', '--start=ROMEO:', '--max_new_tokens=10', '--num_samples=1',
                  '--color=True', cwd=workdir)
    assert colored.returncode == 0 and '\033[48;5;' in colored.stdout  # tokens coloured by expert count
    # a prompt longer than the context is one clear line, not a traceback
    result = run('sample.py', f'--out_dir={out}', '--start=' + 'a' * 100, cwd=workdir)
    assert result.returncode != 0 and 'longer than the model' in result.stderr and 'Traceback' not in result.stderr


# -----------------------------------------------------------------------------
# causal decoding: online SeqTopK, the Expert Cache and the KV cache

def test_online_seqtopk_routes_token_m_as_seqtopk_over_tokens_1_to_m():
    from router import online_seqtopk_mask
    for ties in (False, True):
        for k, min_k, max_k in [(2, 1, None), (2, 0, 8), (3, 1, 8), (2, 2, 2)]:
            scores = random_scores(3, 20, 8, seed=k, ties=ties)
            mask, _, _ = online_seqtopk_mask(scores, k, min_k, max_k)
            prefix_rule = torch.stack([seqtopk_mask(scores[:, :m], k, min_k, max_k)[:, m - 1]
                                       for m in range(1, 21)], dim=1)
            assert torch.equal(mask, prefix_rule)
            # the same routing when the sequence arrives in pieces, the earlier ones in the Expert Cache
            past, spent, pieces = None, None, []
            for start, end in [(0, 5), (5, 6), (6, 13), (13, 14), (14, 20)]:
                piece, rows, spent = online_seqtopk_mask(scores[:, start:end], k, min_k, max_k, past, spent)
                past = rows if past is None else torch.cat([past, rows], dim=1)
                pieces.append(piece)
            assert torch.equal(torch.cat(pieces, dim=1), mask) and torch.equal(spent, mask.sum(dim=(1, 2)))


def test_online_seqtopk_is_causal_and_starts_as_topk():
    from router import online_seqtopk_mask
    scores = random_scores(2, 24, 8, seed=1)
    mask, _, _ = online_seqtopk_mask(scores, 2)
    assert torch.equal(mask[:, 0], topk_mask(scores[:, :1], 2)[:, 0])  # position 1 is routed as topk
    for m in (1, 7, 15):
        changed = scores.clone()
        changed[:, m:] = random_scores(2, 24 - m, 8, seed=99 + m)
        assert torch.equal(online_seqtopk_mask(changed, 2)[0][:, :m], mask[:, :m])


def test_strict_budget_never_overspends_a_prefix_while_plain_can():
    from router import online_seqtopk_mask
    scores = random_scores(16, 64, 8, seed=2, ties=True)
    budget = 2 * torch.arange(1, 65)
    plain, _, _ = online_seqtopk_mask(scores, 2)
    strict, _, spent = online_seqtopk_mask(scores, 2, strict=True)
    assert (plain.sum(-1).cumsum(-1) > budget).any()  # the paper's plain rule does overspend
    assert (strict.sum(-1).cumsum(-1) <= budget).all()
    assert (strict.sum(-1) >= 1).all() and torch.equal(spent, strict.sum(dim=(1, 2)))


def trained_tiny(router, **kw):
    torch.manual_seed(0)
    model = GPT(tiny_config(router, **kw))
    train_tiny(model, 10)
    return model.eval()


@pytest.mark.parametrize("router,kw", [("seqtopk", {}), ("seqtopk", {'seq_budget': 'strict'}), ("topk", {}),
                                       ("mrltopk", {}), ("batchtopk", {}), ("relu", {})])
def test_the_expert_cache_routes_decoding_exactly_like_the_causal_prefix_rule(router, kw):
    from model import Cache
    model = trained_tiny(router, **kw)
    seq = next(counting_batches(seed=3, B=2))[0][:, :24]
    seq[:, 10:] = torch.randint(0, 16, (2, 14))  # off-pattern tokens make routing vary more
    logits_tf, _, tf = model(seq, seq, causal=True)  # teacher forcing, one pass
    cache = Cache(model.config.n_layer)
    steps = [model(seq[:, :6], seq[:, :6], cache=cache)]  # the prompt
    steps += [model(seq[:, m:m + 1], seq[:, m:m + 1], cache=cache) for m in range(6, 24)]
    for layer, (mask_tf, _) in enumerate(tf['routing']):
        assert torch.equal(torch.cat([aux['routing'][layer][0] for _, _, aux in steps], dim=1), mask_tf)
    torch.testing.assert_close(torch.cat([logits for logits, _, _ in steps], dim=1), logits_tf,
                               rtol=1e-4, atol=1e-4)
    if router == 'seqtopk':
        # the Expert Cache holds every token's scores of rank min_k..max_k-1 (here 1..3 of 4 experts)
        assert cache.layers[0]['candidates'].shape == (2, 24, 3)


@pytest.mark.parametrize("router", ROUTERS)
def test_kv_cached_generation_equals_full_recompute(router):
    model = trained_tiny(router)
    prompt = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1))
    cached = model.generate(prompt, 25, temperature=0, use_cache=True)
    recomputed = model.generate(prompt, 25, temperature=0, use_cache=False)
    assert torch.equal(cached, recomputed)


def test_causal_routing_in_the_model_ignores_later_tokens():
    model = trained_tiny('seqtopk')
    seq = torch.randint(0, 16, (2, 30), generator=torch.Generator().manual_seed(4))
    _, _, before = model(seq, causal=True)
    changed = seq.clone()
    changed[:, 12:] = (changed[:, 12:] + 5) % 16
    _, _, after = model(changed, causal=True)
    for (mask_a, _), (mask_b, _) in zip(before['routing'], after['routing']):
        assert torch.equal(mask_a[:, :12], mask_b[:, :12])


def test_a_prompt_routed_jointly_takes_offline_seqtopk_then_decodes_online():
    from model import Cache
    model = trained_tiny('seqtopk')
    seq = torch.randint(0, 16, (2, 20), generator=torch.Generator().manual_seed(6))
    cache = Cache(model.config.n_layer)
    _, _, prompt = model(seq[:, :12], cache=cache, causal=False)  # what prompt_routing='joint' does
    _, _, offline = model(seq[:, :12], causal=False)
    for (mask_p, _), (mask_o, _) in zip(prompt['routing'], offline['routing']):
        assert torch.equal(mask_p, mask_o)
    assert torch.equal(cache.layers[0]['spent'], torch.full((2,), 12 * 2))  # exact budget on the prompt
    _, _, step = model(seq[:, 12:13], cache=cache)
    assert all(mask.shape == (2, 1, 4) and mask.sum() >= 2 for mask, _ in step['routing'])


# -----------------------------------------------------------------------------
# scale: DDP, exact resume, atomic checkpoints

def last_eval(out_dir):
    import json
    evals = [json.loads(line) for line in open(out_dir / 'log.jsonl') if '"event": "eval"' in line]
    return evals[-1]


@pytest.mark.parametrize("router", ["seqtopk", "relu"])
def test_ddp_on_two_cpu_processes_matches_one_process_with_the_same_global_batch(workdir, router):
    # relu: lambda and the thresholds step once per step, from the active fractions of every micro-batch
    common = [os.path.join(REPO, 'config', 'tiny.py'), f'--router={router}', '--gradient_accumulation_steps=2',
              '--max_iters=6', '--eval_interval=6', '--relu_l1_init=0.01']
    single = run('train.py', *common, f'--out_dir=single-{router}', cwd=workdir)
    assert single.returncode == 0, single.stderr
    ddp = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                          os.path.join(REPO, 'train.py'), *common, f'--out_dir=ddp-{router}'],
                         cwd=workdir, env=OFFLINE_ENV, capture_output=True, text=True, timeout=300)
    assert ddp.returncode == 0, ddp.stderr
    assert '2 processes' in ddp.stdout
    a, b = last_eval(workdir / f'single-{router}'), last_eval(workdir / f'ddp-{router}')
    assert a['iter'] == b['iter'] == 6
    assert abs(a['val_ce'] - b['val_ce']) < 1e-4 and abs(a['train_ce'] - b['train_ce']) < 1e-4
    if router == 'relu':  # the same lambda and thresholds, and they moved
        for key in ('l1_coef', 'relu_threshold'):
            assert [l[key] for l in a['layers']] == pytest.approx([l[key] for l in b['layers']], rel=1e-5, abs=1e-7)
        assert all(l['l1_coef'] != 0.01 for l in a['layers']) and any(l['relu_threshold'] < 0 for l in a['layers'])


@pytest.mark.parametrize("router", ["seqtopk", "batchtopk", "mrltopk", "relu"])
def test_twenty_steps_straight_equal_ten_plus_resumed_ten(workdir, router):
    # mrltopk at top_k=4 of 4 draws k from {2, 4} per layer and step; relu carries lambda in the checkpoint
    common = [os.path.join(REPO, 'config', 'tiny.py'), f'--router={router}', '--lr_decay_iters=20',
              '--eval_interval=10'] + (['--top_k=4'] if router == 'mrltopk' else [])
    straight = run('train.py', *common, '--max_iters=20', f'--out_dir=straight-{router}', cwd=workdir)
    first = run('train.py', *common, '--max_iters=10', f'--out_dir=split-{router}', cwd=workdir)
    resumed = run('train.py', *common, '--max_iters=20', '--init_from=resume', f'--out_dir=split-{router}',
                  cwd=workdir)
    for result in (straight, first, resumed):
        assert result.returncode == 0, result.stderr
    a, b = last_eval(workdir / f'straight-{router}'), last_eval(workdir / f'split-{router}')
    assert a['iter'] == b['iter'] == 20
    assert a['val_ce'] == pytest.approx(b['val_ce'], abs=1e-6)
    assert a['train_ce'] == pytest.approx(b['train_ce'], abs=1e-6)


def test_resume_with_another_architecture_is_a_clear_error(workdir):
    out = workdir / 'arch'
    assert run('train.py', os.path.join(REPO, 'config', 'tiny.py'), '--max_iters=2', f'--out_dir={out}',
               cwd=workdir).returncode == 0
    result = run('train.py', os.path.join(REPO, 'config', 'tiny.py'), '--init_from=resume', '--n_exp=8',
                 f'--out_dir={out}', cwd=workdir)
    assert result.returncode != 0 and 'Traceback' not in result.stderr
    assert 'trained with n_exp=4' in result.stderr
    again = run('train.py', os.path.join(REPO, 'config', 'tiny.py'), f'--out_dir={out}', cwd=workdir)
    assert again.returncode != 0 and 'already holds a run' in again.stderr  # no silent overwrite


def test_a_run_killed_while_saving_leaves_a_loadable_checkpoint(workdir):
    import signal
    import time
    out = workdir / 'killed'
    for delay in (0.05, 0.3, 0.7):
        proc = subprocess.Popen([sys.executable, os.path.join(REPO, 'train.py'), os.path.join(REPO, 'config', 'tiny.py'),
                                 '--max_iters=100000', '--eval_interval=1', '--eval_iters=1', '--always_save_checkpoint=True',
                                 f'--out_dir={out}', '--overwrite=True'],
                                cwd=workdir, env=OFFLINE_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while not (out / 'ckpt.pt').exists() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(delay)  # the run saves every step: this lands in or near a save
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
        assert ckpt['iter_num'] >= 1 and 'model' in ckpt
        (out / 'ckpt.pt').unlink()


@pytest.mark.parametrize("router", ROUTERS)
def test_torch_compile_trains_with_every_router_like_eager(router):
    torch.manual_seed(0)
    model = GPT(tiny_config(router))
    x, y = next(counting_batches())
    _, eager_ce, _ = model(x, y)
    _, ce, aux = torch.compile(model)(x, y)
    (ce + aux['aux_loss']).backward()
    assert ce.item() == pytest.approx(eager_ce.item(), rel=1e-4)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# -----------------------------------------------------------------------------
# experiments: plots from logs, sweeps

def synthetic_run(path, router, T=8, layers=2, N=4):
    """A log.jsonl shaped like train.py's, with made-up numbers (no training needed)."""
    import json
    path.mkdir()
    def layer(i):
        return dict(experts_mean=2.0, experts_min=1, experts_max=3, experts_hist=[0, 10, 20, 10, 0],
                    load=[10, 20, 30, 20], load_var=50.0, load_cv=0.35 - 0.05 * i, dead_experts=0, entropy=0.9 + 0.01 * i)
    records = [dict(event='start', model_args=dict(router=router, top_k=2, n_exp=N))]
    for it in (0, 10, 20):
        rec = dict(event='eval', iter=it, layers=[layer(i) for i in range(layers)], val_ce=3.0 - it / 100,
                   val_experts_by_position=[2.0] * T, val_experts_by_entropy=[1.5, 2.0, 2.5, 0.0],
                   val_tokens_by_entropy=[5, 10, 5, 0])
        if router == 'seqtopk':
            rec.update(val_causal_experts_by_position=[2 + 0.1 * t for t in range(T)],
                       val_offline_experts_by_position=[2.0] * T)
        records.append(rec)
    (path / 'log.jsonl').write_text('\n'.join(json.dumps(r) for r in records) + '\n')


def test_plots_are_written_from_logs_alone(tmp_path):
    import plot
    synthetic_run(tmp_path / 'a', 'topk')
    synthetic_run(tmp_path / 'b', 'seqtopk')
    plot.main([str(tmp_path / 'a'), str(tmp_path / 'b')])
    for name in ('load_variance', 'entropy_per_layer', 'experts_histogram', 'experts_by_position', 'experts_by_entropy'):
        png = tmp_path / f'{name}.png'
        assert png.exists() and png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and png.stat().st_size > 5000
    with pytest.raises(SystemExit, match='no log.jsonl'):
        plot.main([str(tmp_path / 'missing')])
