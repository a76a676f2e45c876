"""
The paper's claims as tests. Run: python -m pytest -q test_router.py
"""
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from model import GPT, GPTConfig, dispatch
from router import seqtopk_mask, topk_mask, route

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
        route(random_scores(1, 4, 8), 'top2', 2)
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


@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_dispatch_equals_a_per_token_reference_forward_and_gradient(impl):
    g = torch.Generator().manual_seed(0)
    M, C, H, N = 24, 16, 12, 6
    mask = torch.rand(M, N, generator=g) < 0.35  # 0 to N experts per token; some experts idle
    mask[:, 5] = False
    mask[3] = False
    weights = torch.rand(M, N, generator=g) * mask
    params = [torch.randn(M, C, generator=g), torch.randn(N, C, H, generator=g) * 0.3,
              torch.randn(N, H, C, generator=g) * 0.3]
    grads = []
    for fn in (lambda *a: dispatch(*a[:1], mask, weights, *a[1:], impl=impl),
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


# -----------------------------------------------------------------------------
# the model trains with every router

def tiny_config(router, **kw):
    return GPTConfig(block_size=32, vocab_size=16, n_layer=2, n_head=2, n_embd=32, n_exp=4, top_k=2,
                     exp_dim=32, router=router, **kw)


@pytest.mark.parametrize("router", ["topk", "seqtopk"])
def test_a_tiny_model_learns_with_each_router(router):
    torch.manual_seed(0)
    model = GPT(tiny_config(router, moe_every=1))
    opt = model.configure_optimizers(0.0, 3e-3, (0.9, 0.99), 'cpu')
    g = torch.Generator().manual_seed(0)
    # a learnable language: counting upward mod 16 from a random start
    def batch():
        start = torch.randint(0, 16, (8, 1), generator=g)
        seq = (start + torch.arange(33)) % 16
        return seq[:, :-1], seq[:, 1:]
    losses = []
    for _ in range(30):
        x, y = batch()
        _, ce, aux = model(x, y)
        (ce + aux['aux_loss']).backward()
        opt.step()
        opt.zero_grad()
        losses.append(ce.item())
        masks = [mask for mask, _ in aux['routing']]
        assert all(mask.sum() == mask.shape[0] * mask.shape[1] * 2 for mask in masks)
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])


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
    # a prompt longer than the context is one clear line, not a traceback
    result = run('sample.py', f'--out_dir={out}', '--start=' + 'a' * 100, cwd=workdir)
    assert result.returncode != 0 and 'longer than the model' in result.stderr and 'Traceback' not in result.stderr


@pytest.mark.parametrize("args,message", [
    (['--router=top3'], "unknown router 'top3'"),
    (['--top_k=9'], "top_k=9 must be between 1 and n_exp=8"),
    (['--router=seqtopk', '--seq_min_k=3'], "bounds"),
    (['--n_exp=many'], "expects a value of type int"),
    (['--routr=topk'], "unknown setting --routr"),
    (['--dataset=nothing_here'], "no data in data/nothing_here"),
])
def test_bad_settings_fail_at_start_with_one_line(workdir, args, message):
    result = run('train.py', '--out_dir=bad', *args, cwd=workdir)
    assert result.returncode != 0 and 'Traceback' not in result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
