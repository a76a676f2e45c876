"""
Train a Mixture-of-Experts GPT. With no arguments: built-in Shakespeare (characters), CPU or GPU.

    python train.py                                  # topk router, default small model
    python train.py --router=seqtopk --top_k=2       # sequence-level routing, same compute
    python train.py config/tiny.py --max_iters=50    # a preset file, then overrides

Every value below can be overridden with --key=value or a preset file (see configurator.py).
"""
import math
import os
import sys
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint as ckpt_io
import prepare
from configurator import (Rule, configure, device_name, fraction, non_empty, non_negative, non_negative_int, one_of,
                          positive, positive_int)
from model import GPT, GPTConfig
from router import ROUTERS, step_budgets
from runtime import (StopRequest, agree, autocast_for, join_torchrun, keep_freed_cpu_memory, on_lost_peer,
                     pick_device, resume_command)
from stats import (add_counts, done_line, done_summary, eval_line, predictive_entropy, routing_counts,
                   routing_stats, routing_summary, start_line)

# -----------------------------------------------------------------------------
# I/O
out_dir = 'out'
eval_interval = 250
eval_iters = 20
log_interval = 25
always_save_checkpoint = False  # else only when val loss improves (and at the end)
overwrite = False               # allow a new run to replace the checkpoint already in out_dir
init_from = 'scratch'           # 'scratch', 'resume' (out_dir/ckpt.pt), or a ckpt.pt path to fine-tune from
eval_only = False               # evaluate once (e.g. a checkpoint with another router) and exit
# data
dataset = 'shakespeare_char'    # a folder under data/ made by prepare.py
batch_size = 16
block_size = 128
gradient_accumulation_steps = 1
# model
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
bias = False
rope = True                     # rotary positions in attention (False: GPT-2's learned position embeddings)
n_exp = 8
top_k = 2
exp_dim = 128
moe_every = 1                   # every moe_every-th block is MoE (1 = all, 0 = none: a dense GPT)
mlp_dim = 0                     # width of the dense FFN blocks (0 = 4 * n_embd)
router = 'topk'                 # topk | mrltopk | seqtopk | batchtopk | relu | windowtopk (router.ROUTERS)
seq_min_k = 1
seq_max_k = 0                   # 0 = top_k + 2 (the paper's default); n_exp = no upper bound
score_func = 'softmax'          # router scores: 'softmax', 'sigmoid' or 'relu' (ReMoE's gates)
route_scale = 0.0               # gates = route_scale x the selected scores (0 = auto: each gate ~1 at init)
norm_topk_prob = False
balance = 'aux'                 # 'aux' (Switch loss), 'bias' (loss-free: a per-expert bias on the choice), 'none'
balance_rate = 1e-3             # balance='bias': the bias's step per optimizer step
aux_loss_weight = 0.01
z_loss_weight = 0.001
threshold_decay = 0.99          # batchtopk: EMA decay of the threshold used at evaluation
relu_l1_init = 1e-8             # relu: initial regulariser coefficient (ReMoE's lambda_0)
relu_l1_step = 1.2              # relu: lambda's adaptation factor (ReMoE's alpha)
relu_l1_per_layer = True        # relu: each MoE layer its own lambda (False: one for the model, as ReMoE)
relu_threshold_step = 0.1       # relu: step with which a too-sparse layer's ReLU threshold falls below 0 (0: ReMoE)
moe_impl = 'grouped'            # 'grouped' (torch._grouped_mm) or 'loop' (one matmul per expert)
seq_causal = False              # seqtopk: train with the online (causal) rule instead of the offline one
seq_budget = 'plain'            # online seqtopk: 'plain' (the paper) or 'strict' (no prefix overspends)
window_floor = 1                # windowtopk: each token's own top experts added to its window's T*k
k_schedule = ''                 # training's k by step, 'step:k/step:k/...' from each step on (topk, mrltopk)
# optimizer: AdamW with linear warmup then cosine decay
learning_rate = 2e-3
max_iters = 1500
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0
warmup_iters = 100
lr_decay_iters = 0              # 0 = max_iters
min_lr = 2e-4
# system
device = 'auto'                 # 'auto', 'cpu', 'cuda', 'cuda:1', 'mps'
dtype = 'auto'                  # 'auto', 'float32', 'bfloat16', 'float16'
compile = False
seed = 1337
# -----------------------------------------------------------------------------
# what each of train.py's own settings may be (configurator.py), checked before anything runs or out_dir is
# looked at; the model's settings are checked by GPTConfig.validate (model.py)
RULES = dict(
    out_dir=non_empty, eval_interval=positive_int, eval_iters=positive_int, log_interval=positive_int,
    init_from=Rule(lambda v: v in ('scratch', 'resume') or os.path.isfile(v),
                   "'scratch', 'resume' or the path of an existing ckpt.pt"),
    dataset=non_empty, batch_size=positive_int, gradient_accumulation_steps=positive_int,
    learning_rate=positive, max_iters=non_negative_int, weight_decay=non_negative, beta1=fraction, beta2=fraction,
    grad_clip=non_negative, warmup_iters=non_negative_int, lr_decay_iters=non_negative_int, min_lr=non_negative,
    device=device_name, dtype=one_of('auto', 'float32', 'bfloat16', 'float16'), seed=non_negative_int)
RELATIONS = [('min_lr', lambda c: c['min_lr'] <= c['learning_rate'], 'at most --learning_rate={learning_rate}'),
             ('k_schedule', lambda c: not c['k_schedule'] or schedule_ok(c['k_schedule'], c['n_exp']),
              "'step:k/step:k/...', steps rising from 0, each k between 1 and --n_exp={n_exp}"),
             ('k_schedule', lambda c: not c['k_schedule'] or c['router'] not in ROUTERS or ROUTERS[c['router']].per_step_k,
              "'' with --router={router}: only " + ', '.join(n for n, r in ROUTERS.items() if r.per_step_k)
              + " route with a per-step k")]


def schedule(text):
    """'0:16/100:8' -> [(0, 16), (100, 8)]: from each step on, that k."""
    return [tuple(int(v) for v in item.split(':')) for item in text.split('/')]


def schedule_ok(text, n_exp):
    try:
        steps = schedule(text)
    except ValueError:
        return False
    return (all(len(s) == 2 and 1 <= s[1] <= n_exp for s in steps) and steps[0][0] == 0
            and all(a[0] < b[0] for a, b in zip(steps, steps[1:])))


def scheduled_k(steps, step):
    return [k for start, k in steps if start <= step][-1]



config, overridden = configure(globals(), sys.argv[1:], RULES, RELATIONS)
t_begin = time.time()
ddp = 'RANK' in os.environ  # distributed data parallel when launched by torchrun: NCCL on GPUs, gloo on CPU
rank, world_size = (int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])) if ddp else (0, 1)
master_process = rank == 0


def fail(message):
    raise SystemExit(f"error: {message}" if master_process else 1)  # under torchrun, rank 0 says it once


def model_config(model_args):
    """The GPTConfig of these settings, or the one line saying which one it cannot have."""
    try:
        checked = GPTConfig(**model_args)
        checked.validate()
    except ValueError as e:
        fail(e)
    return checked


model_args = {k: config[k] for k in ckpt_io.MODEL_KEYS if k in config}
if init_from == 'scratch':  # resuming or fine-tuning: checked once merged with the checkpoint's settings
    model_config(model_args)
out_dir_problem = ckpt_io.out_dir_problem(out_dir)
if out_dir_problem:
    fail(f"--out_dir={out_dir} {out_dir_problem}")
try:
    device = pick_device(device)
    if ddp:  # this rank's device and its share of the accumulation steps
        device, gradient_accumulation_steps = join_torchrun(device, gradient_accumulation_steps, world_size)
except ValueError as e:
    fail(e)
device_type = 'cuda' if device.startswith('cuda') else device
lr_decay_iters = lr_decay_iters or max_iters
torch.manual_seed(seed)
keep_freed_cpu_memory()
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
dtype, ctx = autocast_for(device, dtype)

# -----------------------------------------------------------------------------
# data: the built-in datasets are prepared on first use, anything else must exist
data_dir = os.path.join('data', dataset)
try:
    if master_process:
        prepare.on_first_use(dataset, data_dir)
    if ddp:
        dist.barrier()  # the other ranks wait for rank 0 to prepare the data
    meta = prepare.check_data(data_dir, block_size)  # every file there, whole, long enough, readable
except ValueError as e:
    fail(e)
data = {split: np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=np.uint16, mode='r')
        for split in ('train', 'val')}
batch_gen = torch.Generator().manual_seed(seed)  # draws the training batches; checkpointed


def get_batch(split, generator=batch_gen):
    # every rank draws the same stream and keeps its share: N processes see what one would
    arr = data[split]
    draws = [torch.randint(len(arr) - block_size, (batch_size,), generator=generator)
             for _ in range(world_size if generator is batch_gen else 1)]
    ix = draws[rank if generator is batch_gen else 0].tolist()
    x = torch.stack([torch.from_numpy(arr[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(arr[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    if device_type == 'cuda':
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


# -----------------------------------------------------------------------------
# model, optimizer, and (for resume) the checkpoint they continue from
model_args['vocab_size'] = meta['vocab_size']
iter_num, best_val_loss, checkpoint = 0, float('inf'), None
run = ckpt_io.RunFiles(out_dir)  # log.jsonl and ckpt.pt, written by rank 0
source = None if init_from == 'scratch' else run.ckpt_path if init_from == 'resume' else init_from
if source is not None:  # resume a run, or fine-tune (a new run) from another run's weights
    try:
        checkpoint, model_args = ckpt_io.load_to_continue(source, init_from == 'resume', model_args, overridden,
                                                          meta, data_dir, quiet=not master_process)
    except ValueError as e:
        fail(e)
    model_config(model_args)
    block_size = model_args['block_size']  # the batches fit the checkpoint's context
    if init_from == 'resume':
        iter_num = run.saved_iter = checkpoint['iter_num']
        best_val_loss = checkpoint['best_val_loss']
if init_from != 'resume' and os.path.exists(run.ckpt_path) and not overwrite and not eval_only:
    fail(f"{out_dir}/ already holds a run; continue it with --init_from=resume, "
         f"or pick another --out_dir, or pass --overwrite=True to replace it")
model = GPT(model_config(model_args))
if checkpoint is not None:
    ckpt_io.load_weights(model, checkpoint, source, quiet=not master_process)
model.to(device)
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if init_from == 'resume':  # a fine-tune starts a fresh optimizer (and warmup) on the loaded weights
    try:
        ckpt_io.restore_state(checkpoint, source, optimizer, batch_gen)
    except ValueError as e:
        fail(e)
run.claim(lock=master_process)  # out_dir, held by this run until it exits (a live run's is refused)
scaler, raw_model = torch.amp.GradScaler(enabled=(dtype == 'float16' and device_type == 'cuda')), model
if compile:
    model = torch.compile(model)
if ddp:  # buffers (batchtopk threshold, relu lambda) are averaged after every step instead
    model = DDP(model, device_ids=[device] if device_type == 'cuda' else None, broadcast_buffers=False)
cfg = raw_model.config
routers = raw_model.routers()  # none in a dense GPT (--moe_every=0)
if master_process:
    print(start_line(raw_model, device, dtype, batch_size, gradient_accumulation_steps, world_size))
if ddp:  # another process of the job dies (killed, out of memory): one line on rank 0, no traceback
    on_lost_peer(master_process, lambda: run.kept("see torchrun's summary", resume_command(world_size, ddp)))


# -----------------------------------------------------------------------------
# evaluation, learning rate, and stopping
@torch.no_grad()
def evaluate(split, online=None, entropy_bins=10):
    """Mean cross-entropy and aux loss over eval_iters fixed batches of a split, and the routing
    counts the plots need (stats.routing_counts)."""
    gen = torch.Generator().manual_seed(int(split == 'val'))  # the same batches at every eval, any seed
    ce, aux, counts = [], [], None
    for _ in range(eval_iters):
        X, Y = get_batch(split, gen)
        with ctx:
            logits, loss, extra = model(X, Y, online=online)
        ce.append(loss.item())
        aux.append(float(extra['aux_loss']))
        if extra['routing']:  # a dense GPT (moe_every=0) routes nothing
            masks = torch.stack([mask for mask, _ in extra['routing']]).cpu()  # (layers, B, T, N)
            counts = add_counts(counts, routing_counts(masks, predictive_entropy(logits).cpu(), cfg.top_k, entropy_bins))
    summary = routing_summary(counts, eval_iters) if counts else {}
    return dict(ce=float(np.mean(ce)), aux=float(np.mean(aux)), **summary), counts


def estimate_loss():
    """Train/val losses and per-layer routing statistics on val, with the routers' state. A router
    with an online rule (seqtopk) is measured offline and causally (online): offline, a token's
    expert count depends on later tokens, so the causal number is the one generation reaches."""
    model.eval()
    losses = {'train': evaluate('train')[0]}
    losses['val'], counts = evaluate('val')
    if any(r.online for r in routers):  # 'val' is whichever of the two the model trains with
        other = 'val_offline' if cfg.seq_causal else 'val_causal'
        losses['val_causal' if cfg.seq_causal else 'val_offline'] = losses['val']
        losses[other] = evaluate('val', online=not cfg.seq_causal)[0]
    layers = [dict(routing_stats(counts['hist'][i], counts['load'][i]),
                   **{name: value.tolist() for name, value in r.named_buffers()}) for i, r in enumerate(routers)]
    model.train()
    return losses, layers


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def checkpoint_now():
    return dict(model=raw_model.state_dict(), optimizer=optimizer.state_dict(), model_args=asdict(cfg),
                config=config, iter_num=iter_num, best_val_loss=best_val_loss, meta=meta, dataset=dataset,
                batch_gen_state=batch_state, torch_rng_state=torch.get_rng_state(),
                pairs_trained=int(pairs_trained), tokens_trained=tokens_trained)


def stop(why, fix):
    """Stop, on every rank, writing nothing more (ckpt.pt keeps the last good state); rank 0 says why
    and how to go on."""
    if ddp:
        dist.destroy_process_group()
    fail(f"{why}; {run.kept(fix, resume_command(world_size, ddp))}")


def stop_diverged(step, what):
    if master_process:
        run.log(dict(event='diverged', iter=step, what=what))
    stop(f"{what} at step {step}: the run diverged and stopped", f"lower --learning_rate (now {learning_rate:g})")


def check_weights(step):
    """Every rank, before evaluating or saving: non-finite weights are never evaluated or saved."""
    bad = ckpt_io.non_finite(raw_model.state_dict())  # the same on every rank: DDP keeps the weights equal
    if bad:
        stop_diverged(step, f"the weights hold NaN or inf ({bad[0]})")


# -----------------------------------------------------------------------------
# training loop (rank 0 evaluates, logs and saves)
if init_from != 'resume' and not eval_only and master_process:
    run.new_log()
    run.log(dict(event='start', config=config, model_args=asdict(cfg), params=raw_model.num_params(),
                 active_params=raw_model.num_params(active=True)))
    if run.error:
        stop(run.error, 'free some space')
stop_request = StopRequest()
if eval_only and any(r.needs_calibration() for r in routers):
    # e.g. batchtopk on a checkpoint not trained with it: its threshold set from training batches, no step
    calibration = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(eval_iters):
            model(*get_batch('train', calibration))
batch_state = batch_gen.get_state()  # the state that draws X, Y: a resumed run redraws the same batch
X, Y = get_batch('train')
# the compute training really spent: (token, expert) pairs the training forwards ran over the token-layers
# they routed, for the whole run (a resumed run carries them on; rank 0's share under DDP)
pairs_trained = torch.tensor(checkpoint.get('pairs_trained', 0) if init_from == 'resume' else 0, device=device)
tokens_trained = checkpoint.get('tokens_trained', 0) if init_from == 'resume' else 0
pairs_logged, tokens_logged = int(pairs_trained), tokens_trained  # at the last log line: its experts/token
t_start = t_last = time.time()
while True:
    lr = get_lr(iter_num)
    for group in optimizer.param_groups:
        group['lr'] = lr

    evaluating = iter_num % eval_interval == 0 or iter_num >= max_iters or eval_only
    if evaluating:
        check_weights(iter_num)
    if evaluating and master_process:
        losses, layers = estimate_loss()
        experts_trained = pairs_trained.item() / tokens_trained if tokens_trained else None
        print(eval_line(iter_num, losses, layers, experts_trained))
        run.log(dict(event='eval', iter=iter_num, lr=lr, time=time.time() - t_start, layers=layers,
                     experts_trained=experts_trained, **{
            f'{split}_{k}': v for split, d in losses.items() for k, v in d.items()}))
        improved = losses['val']['ce'] < best_val_loss
        best_val_loss = min(best_val_loss, losses['val']['ce'])
        if iter_num > 0 and (improved or always_save_checkpoint or iter_num >= max_iters):
            run.save(checkpoint_now())
    if iter_num >= max_iters or eval_only:
        break

    step_loss = 0.0
    # every MoE layer's k for this step (mrltopk draws them), a function of (seed, step) alone: the same on
    # every rank and micro-step, and a resumed run redraws exactly what the straight run drew
    moe_ks = step_budgets(cfg, len(routers), torch.Generator().manual_seed(seed * 1_000_003 + iter_num))
    if k_schedule:
        moe_ks = [scheduled_k(schedule(k_schedule), iter_num)] * len(routers)
    for micro_step in range(gradient_accumulation_steps):
        if ddp:  # gradients are all-reduced on the last micro-step only
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with ctx:
            _, ce, extra = model(X, Y, moe_ks=moe_ks)
            loss = (ce + extra['aux_loss']) / gradient_accumulation_steps
        step_loss = step_loss + loss.detach()
        if routers:  # counted on the device: no host sync
            pairs_trained += sum(mask.sum() for mask, _ in extra['routing'])
            tokens_trained += X.numel() * len(routers)
        batch_state = batch_gen.get_state()
        X, Y = get_batch('train')  # fetch the next batch while the backward runs on GPU
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)  # a no-op without fp16 loss scaling
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float('inf'))  # inf: measure only
    finite = torch.isfinite(step_loss) & (torch.isfinite(grad_norm) | scaler.is_enabled())  # fp16: scaler skips infs
    diverged, stopping, failed_write = agree(ddp, ~finite, stop_request.signal is not None, run.error is not None)
    if failed_write:  # on rank 0 (the only one writing): every rank stops here, none goes on without it
        stop(run.error, 'free some space')
    if diverged:  # the step is not applied; nothing is saved
        stop_diverged(iter_num + 1, f"the training loss is {float(step_loss):.4g}" if not torch.isfinite(step_loss) else
                      f"the gradient norm is {float(grad_norm):.4g}" if not finite else "another process's loss is not finite")
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    for buffer in (b for r in routers for b in r.buffers()) if ddp else ():  # every rank routes alike
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
        buffer.div_(world_size)
    raw_model.after_step()  # the routers' step rule, e.g. relu's lambda and thresholds
    iter_num += 1

    if iter_num % log_interval == 0 and master_process:
        ms, t_last = (time.time() - t_last) * 1000 / log_interval, time.time()
        aux = float(extra['aux_loss'].detach()) if torch.is_tensor(extra['aux_loss']) else 0.0
        experts = None
        if tokens_trained > tokens_logged:  # experts per token-layer since the last log line
            experts = (int(pairs_trained) - pairs_logged) / (tokens_trained - tokens_logged)
            pairs_logged, tokens_logged = int(pairs_trained), tokens_trained
        print(f"iter {iter_num}: ce {ce.item():.4f}, aux {aux:.4f}, lr {lr:.2e}, {ms:.0f} ms/iter")
        run.log(dict(event='train', iter=iter_num, ce=ce.item(), aux=aux, lr=lr, ms_per_iter=ms,
                     experts=experts))
    if stopping:  # preempted (SIGTERM) or Ctrl-C (SIGINT): keep everything, exit cleanly
        check_weights(iter_num)
        if master_process:
            run.save(checkpoint_now())
            run.log(dict(event='stopped', iter=iter_num, signal=stop_request.signal))
            if run.error:
                stop(run.error, 'free some space')
            print(f"{stop_request.signal or 'signal on another rank'}: stopped after step {iter_num} and saved "
                  f"{run.ckpt_path}; continue with: {resume_command(world_size, ddp)}", flush=True)
        if ddp:
            dist.destroy_process_group()
        sys.exit(0)

if run.error:  # the final save or log (rank 0)
    stop(run.error, 'free some space')
if ddp:
    dist.destroy_process_group()
if master_process:  # the run's summary, also the last line of log.jsonl (sweep.py reads it)
    summary = done_summary(cfg, raw_model, routers, losses, layers, experts_trained,
                           iter=iter_num, time=time.time() - t_begin, init_from=init_from, eval_only=eval_only)
    run.log(summary)
    if run.error:
        fail(f"{run.error}; the run finished and {run.ckpt_path} holds its last checkpoint (step {run.saved_iter})")
    print(done_line(summary) + (f"; checkpoint in {run.ckpt_path}" if run.saved_iter is not None else ''))
