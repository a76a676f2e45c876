"""
Decoding as tests: the KV cache and the Expert Cache route and predict exactly as the teacher-forced
causal pass, cached generation equals full recompute, eager generation runs the plain definitions,
the compiled step gives the eager tokens, and a bf16 step reads only the experts it uses.
Run: python -m pytest -q
"""
import functools

import pytest
import torch

import fast
import sample
from conftest import counting_batches, needs_cuda, tiny_config, trained_tiny
from cache import Cache
from model import GPT
from sample import compiled_decode, generate
from router import ROUTERS, expert_cache_rows, online_seqtopk_mask


# -----------------------------------------------------------------------------
# the caches

@pytest.mark.parametrize("router,kw", [("seqtopk", {}), ("seqtopk", {'seq_budget': 'strict'}),
                                       ("topk", {}), ("mrltopk", {}), ("batchtopk", {}),
                                       ("relu", {}), ("windowtopk", {})])
def test_the_expert_cache_routes_decoding_exactly_like_the_causal_prefix_rule(router, kw):
    model = trained_tiny(router, **kw)
    seq = next(counting_batches(seed=3, B=2))[0][:, :24]
    seq[:, 10:] = torch.randint(0, 16, (2, 14))  # off-pattern tokens make routing vary more
    logits_tf, _, tf = model(seq, seq, online=True)  # teacher forcing, one pass
    cache = Cache(model.config)
    steps = [model(seq[:, :6], seq[:, :6], cache=cache)]  # the prompt
    steps += [model(seq[:, m:m + 1], seq[:, m:m + 1], cache=cache) for m in range(6, 24)]
    for layer, (mask_tf, _) in enumerate(tf['routing']):
        assert torch.equal(torch.cat([aux['routing'][layer][0] for _, _, aux in steps], dim=1),
                           mask_tf)
    torch.testing.assert_close(torch.cat([logits for logits, _, _ in steps], dim=1), logits_tf,
                               rtol=1e-4, atol=1e-4)
    if router == 'seqtopk':
        # the Expert Cache holds every token's scores of rank min_k..max_k-1 (here 1..3 of 4
        # experts), a row per token; sample.StaticCache holds them in a buffer of block_size rows,
        # written in place, and its step (the fast paths, by counting) routes alike
        assert cache.layers[0].expert_cache.shape == (2, 24, 3) and cache.pos.item() == 24
        fast_model, static = fast.paths(model), sample.StaticCache(model.config)
        fast_steps = [fast_model(seq[:, :6], cache=static)]
        fast_steps += [fast_model(seq[:, m:m + 1], cache=static) for m in range(6, 24)]
        for layer, (mask_tf, _) in enumerate(tf['routing']):
            assert torch.equal(torch.cat([aux['routing'][layer][0] for _, _, aux in fast_steps],
                                         dim=1), mask_tf)
        buffer = static.layers[0].expert_cache
        assert buffer.shape == (2, 32, 3)
        assert torch.equal(buffer[:, :24], cache.layers[0].expert_cache)


def greedy(model, prompt, n, use_cache, decode=None):
    """Greedy generation, and each step's routing of its newest token (per layer, (B, N))."""
    steps = []
    tokens = generate(model, prompt, n, temperature=0, use_cache=use_cache, decode=decode,
                            on_token=lambda routing: steps.append([m[:, -1] for m, _ in routing]))
    return tokens, steps


@pytest.mark.parametrize("router,kw", [(r, {}) for r in ROUTERS] + [
    ('seqtopk', {'seq_budget': 'strict'}), ('seqtopk', {'rope': False}),
    ('topk', {'moe_every': 0})])
def test_cached_generation_gives_the_recomputed_tokens_and_routing_past_the_context(router, kw):
    model = trained_tiny(router, **kw)  # block_size=32: 5 + 75 tokens start the context again twice
    prompt = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1))
    cached, cached_routing = greedy(model, prompt, 75, use_cache=True)
    recomputed, recomputed_routing = greedy(model, prompt, 75, use_cache=False)
    assert torch.equal(cached, recomputed)
    assert len(cached_routing) == len(recomputed_routing) == 75
    for a, b in zip(cached_routing, recomputed_routing):  # each token took the same experts
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_full_context_starts_again_at_its_last_half():
    model = GPT(tiny_config('topk', block_size=8)).eval()
    prompt = torch.randint(0, 16, (1, 5), generator=torch.Generator().manual_seed(1))
    fed = []  # the tokens each step runs through the model
    generate(model, prompt, 12, temperature=0,
             on_token=lambda routing: fed.append(routing[0][0].shape[1]))
    # the prompt, cached steps up to block_size tokens, then its last block_size // 2 again, ...
    assert fed == [5, 1, 1, 1, 4, 1, 1, 1, 1, 4, 1, 1]


def test_sampling_at_a_tiny_temperature_or_from_the_top_token_alone_is_greedy():
    torch.manual_seed(0)
    model = GPT(tiny_config('topk')).eval()  # untrained: near-uniform next-token logits
    prompt = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1))
    greedy_tokens = generate(model, prompt, 20, temperature=0)
    assert torch.equal(generate(model, prompt, 20, temperature=1.0, sample_top_k=1), greedy_tokens)
    assert torch.equal(generate(model, prompt, 20, temperature=1e-6), greedy_tokens)
    for tiny in (1e-45, 1e-300):  # logits / temperature past float32: inf, once NaN
        assert torch.equal(generate(model, prompt, 20, temperature=tiny), greedy_tokens)
        assert torch.equal(generate(model, prompt, 20, temperature=tiny, sample_top_k=5),
                           greedy_tokens)
    with torch.autocast('cpu', dtype=torch.float16):  # fp16 logits / 1e-6: past 65504
        assert torch.equal(generate(model, prompt, 20, temperature=1e-6),
                           generate(model, prompt, 20, temperature=0))
    assert not torch.equal(generate(model, prompt, 20, temperature=1.0), greedy_tokens)


def test_a_model_whose_context_is_one_token_generates_alike_both_ways():
    torch.manual_seed(0)
    model = GPT(tiny_config('seqtopk', block_size=1)).eval()
    prompt = torch.tensor([[3], [7]])
    cached, recomputed = (greedy(model, prompt, 6, use_cache=c) for c in (True, False))
    assert cached[0].shape == (2, 7) and torch.equal(cached[0], recomputed[0])
    assert all(torch.equal(x, y) for a, b in zip(cached[1], recomputed[1]) for x, y in zip(a, b))


def test_causal_routing_in_the_model_ignores_later_tokens():
    model = trained_tiny('seqtopk')
    seq = torch.randint(0, 16, (2, 30), generator=torch.Generator().manual_seed(4))
    _, _, before = model(seq, online=True)
    changed = seq.clone()
    changed[:, 12:] = (changed[:, 12:] + 5) % 16
    _, _, after = model(changed, online=True)
    for (mask_a, _), (mask_b, _) in zip(before['routing'], after['routing']):
        assert torch.equal(mask_a[:, :12], mask_b[:, :12])


def test_a_prompt_routed_jointly_takes_offline_seqtopk_then_decodes_online():
    model = trained_tiny('seqtopk')
    seq = torch.randint(0, 16, (2, 20), generator=torch.Generator().manual_seed(6))
    cache = Cache(model.config)
    _, _, prompt = model(seq[:, :12], cache=cache, online=False)  # what prompt_routing='joint' does
    _, _, offline = model(seq[:, :12], online=False)
    for (mask_p, _), (mask_o, _) in zip(prompt['routing'], offline['routing']):
        assert torch.equal(mask_p, mask_o)
    # exact budget on the prompt
    assert torch.equal(cache.layers[0].spent, torch.full((2,), 12 * 2))
    # then each token is routed by Eq. 7 against the Expert Cache: the prompt's rows, then its own
    cached = [expert_cache_rows(scores, 1, 4) for _, scores in prompt['routing']]  # max_k = 4
    alone = []
    for t in range(12, 20):
        _, _, step = model(seq[:, t:t + 1], cache=cache)
        for layer, (mask, scores) in enumerate(step['routing']):
            want = online_seqtopk_mask(scores, 2, 1, 4, cached=cached[layer])[0]
            assert torch.equal(mask, want)
            alone.append(torch.equal(want, online_seqtopk_mask(scores, 2, 1, 4)[0]))
            cached[layer] = torch.cat([cached[layer], expert_cache_rows(scores, 1, 4)], dim=1)
    assert not all(alone)  # the cache decided: as first tokens, some would take other experts


@pytest.mark.parametrize("paths", [lambda m: m, fast.paths])
def test_a_decoded_token_ranks_each_layer_s_scores_once_for_its_choice_and_its_cache_rows(
        paths, monkeypatch):
    # the online rule returns the rows the Expert Cache keeps (Eq. 6) with its decision: the layer
    # appends them, and nothing ranks the token's scores again for the cache
    model = paths(trained_tiny('seqtopk'))
    cache = Cache(model.config)
    model.decode_token(torch.randint(0, 16, (2, 6)), cache)  # the prompt, token by token
    ranked = []
    real_topk = torch.Tensor.topk
    monkeypatch.setattr(torch.Tensor, 'topk', lambda t, *a, **kw: ranked.append(t.shape)
                        or real_topk(t, *a, **kw))
    model.decode_token(torch.randint(0, 16, (2, 1)), cache)
    # the plain rule ranks the token once, and Eq. 7's top m*(K - min_k) ranks the Expert Cache's
    # candidates with its own; counted, one ranking in all
    per_layer = 2 if paths is not fast.paths else 1
    assert len(ranked) == per_layer * len(model.routers())
    assert cache.layers[0].expert_cache.shape[1] == 7 and cache.layers[0].spent.shape == (2,)


@pytest.mark.parametrize("router", ["seqtopk", "topk"])
def test_eager_generation_runs_the_plain_definitions_not_fast_py(router, monkeypatch):
    model = trained_tiny(router)
    prompt = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1))
    with_fast = generate(fast.paths(model), prompt, 20, temperature=0)  # the copy that runs them

    def refuse(*args, **kwargs):
        raise AssertionError("eager generation called fast.py")
    for name in ('online_seqtopk_counted', 'online_token_counted', 'sorted_experts',
                 'moe_sorted', 'grouped_mm'):
        monkeypatch.setattr(fast, name, refuse)
    assert torch.equal(generate(model, prompt, 20, temperature=0), with_fast)  # the same tokens


@pytest.mark.parametrize("way", ["plain", "slots"])
def test_a_bf16_decoding_step_casts_only_the_experts_it_uses_and_matches_fp32(way):
    from torch.profiler import profile
    # n_embd = exp_dim = 32: every expert stack is (n_exp, 32, 32)
    model = trained_tiny('topk', n_exp=8)
    prompt = next(counting_batches(seed=3, B=1))[0][:, :12]
    # the plain textbook loop, or the compiled step's slots (each pair's weights gathered), eagerly
    if way == 'slots':
        model = fast.paths(model,
                           experts=lambda r: functools.partial(sample.decode_experts, router=r))
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        with torch.inference_mode(), torch.autocast('cpu', dtype=torch.bfloat16,
                                                    enabled=dtype == torch.bfloat16):
            cache = Cache(model.config)
            model(prompt, cache=cache)
            with profile(record_shapes=True) as prof:
                logits[dtype] = model.decode_token(prompt[:, -1:], cache)[0].float()
    casts = [e.input_shapes[0] for e in prof.events() if e.name == 'aten::_to_copy']
    assert [8, 32, 32] not in casts  # never all 8 experts' matrices
    if way == 'slots':
        assert [2, 32, 32] in casts  # the token's top-2, gathered
    want = logits[torch.float32]
    torch.testing.assert_close(logits[torch.bfloat16], want, rtol=2e-2,
                               atol=2e-2 * want.abs().max().item())


@needs_cuda
def test_cuda_cached_generation_equals_full_recompute():
    model = trained_tiny('seqtopk').cuda()
    prompt = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1)).cuda()
    cached = generate(model, prompt, 25, temperature=0, use_cache=True)
    assert torch.equal(cached, generate(model, prompt, 25, temperature=0, use_cache=False))


# -----------------------------------------------------------------------------
# compiled decoding: one graph per step, the same tokens

def expert_counts(routing, into):
    into.append(torch.cat([mask.sum(-1) for mask, _ in routing], dim=-1))  # (B, tokens x layers)


# batchtopk's threshold and relu bound no token's experts: their step counts its pairs from the
# data, and compiles to one graph all the same (compiled_decode compiles with fullgraph=True: a
# graph break raises)
@pytest.mark.parametrize("router,kw", [("topk", {}), ("seqtopk", {}),
                                       ("seqtopk", {'seq_budget': 'strict'}), ("batchtopk", {}),
                                       ("relu", {}), ("windowtopk", {})])
@pytest.mark.compile
def test_compiled_decoding_gives_exactly_the_eager_tokens_and_expert_counts(router, kw):
    torch._dynamo.reset()
    model = trained_tiny(router, **kw)
    prompt = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1))
    runs = {}
    # 5 + 34 tokens: past block_size=32 the cache starts again, compiled too
    for compile in (False, True):
        counts = []
        tokens = generate(model, prompt, 34, temperature=0,
                          decode=compiled_decode(model) if compile else None,
                          on_token=lambda r: expert_counts(r, counts))
        runs[compile] = tokens, counts
    (eager, eager_counts), (compiled, compiled_counts) = runs[False], runs[True]
    assert torch.equal(compiled, eager)
    assert len(compiled_counts) == 34 and all(torch.equal(a, b)
                                              for a, b in zip(compiled_counts, eager_counts))


@pytest.mark.compile
@pytest.mark.parametrize("router", ["topk", "seqtopk"])
def test_a_decoding_step_compiles_to_one_graph_with_no_break(router):
    torch._dynamo.reset()
    model = trained_tiny(router)
    prompt = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1))
    cache = sample.StaticCache(model.config)
    with torch.inference_mode():
        step = fast.paths(model,
                          experts=lambda r: functools.partial(sample.decode_experts, router=r))
        step(prompt, cache=cache)  # the prompt by the fast paths, as compiled_decode runs it
        with torch._dynamo.config.patch(capture_scalar_outputs=True):  # as compiled_decode
            explanation = torch._dynamo.explain(step.decode_token)(prompt[:, -1:].contiguous(),
                                                                   cache)
    assert (explanation.graph_break_count == 0
            and explanation.graph_count == 1), explanation.break_reasons


@pytest.mark.compile
@pytest.mark.parametrize("router", ["topk", "seqtopk"])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_compiled_decoding_step_compiles_once_for_the_whole_generation(router, batch):
    torch._dynamo.reset()
    model = trained_tiny(router)
    # one sequence, as sample.py decodes (a token's slot count alone sizes its matmuls), or two
    prompt = torch.randint(0, 16, (batch, 5), generator=torch.Generator().manual_seed(1))
    step, cache = compiled_decode(model), sample.StaticCache(model.config)
    torch._dynamo.utils.counters.clear()  # reset() keeps them
    # the graph must not depend on the context
    with torch._dynamo.config.patch(error_on_recompile=True):
        # past block_size: the context starts again; a second generation, the same Cache
        for _ in range(2):
            generate(model, prompt, 34, temperature=0, decode=step, cache=cache)
    assert torch._dynamo.utils.counters['stats']['unique_graphs'] == 1  # compiled: not eager


@pytest.mark.compile
def test_a_compiled_step_decodes_from_one_token_on_a_fresh_cache_or_one_of_another_batch():
    # sample.py's warm-up: a one-token prompt, whose first step meets a cache with no buffers (a
    # static buffer made inside the compiled graph fails); then a batch of 2 on the same cache
    torch._dynamo.reset()
    model = trained_tiny('seqtopk')
    step, cache = compiled_decode(model), sample.StaticCache(model.config)
    for batch in (1, 2):
        prompt = torch.randint(0, 16, (batch, 1), generator=torch.Generator().manual_seed(batch))
        assert torch.equal(generate(model, prompt, 6, temperature=0, decode=step, cache=cache),
                           generate(model, prompt, 6, temperature=0))


@pytest.mark.compile
def test_compiling_the_decoding_step_leaves_the_model_as_it_was():
    torch._dynamo.reset()
    model = trained_tiny('seqtopk')
    prompt = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1))
    before = {name: dict(vars(module)) for name, module in model.named_modules()}
    compiled = generate(model, prompt, 10, temperature=0, decode=compiled_decode(model))
    after = {name: dict(vars(module)) for name, module in model.named_modules()}
    assert before.keys() == after.keys()
    for name in before:  # no module attribute swapped from outside: the step passes its paths
        assert {k: v for k, v in before[name].items() if not k.startswith('_')} == \
            {k: v for k, v in after[name].items() if not k.startswith('_')}, name
    assert torch.equal(generate(model, prompt, 10, temperature=0), compiled)


@pytest.mark.compile
@needs_cuda
@pytest.mark.parametrize("router", ["topk", "seqtopk"])
def test_cuda_a_compiled_decoding_step_never_waits_on_the_host(router):
    torch._dynamo.reset()
    model = trained_tiny(router).cuda()
    prompt = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1)).cuda()
    eager_cache, cache = Cache(model.config), sample.StaticCache(model.config)
    step = compiled_decode(model)
    with torch.inference_mode():
        model(prompt, cache=eager_cache)
        step(prompt, cache)  # the prompt by the fast paths, eagerly
        tokens = torch.randint(0, 16, (4, 2, 1), generator=torch.Generator().manual_seed(2)).cuda()
        for token in tokens[:3]:  # compile, record the CUDA graph, replay: each a token further
            want = model.decode_token(token, eager_cache)
            got = step(token, cache)
            torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
        want = model.decode_token(tokens[3], eager_cache)
        torch.cuda.set_sync_debug_mode('error')  # any host sync raises
        try:
            logits, routing = step(tokens[3], cache)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(logits, want[0], rtol=1e-4, atol=1e-4)  # what eager decoding gives
    assert all(torch.equal(a[0], b[0]) for a, b in zip(routing, want[1]))  # the same experts
