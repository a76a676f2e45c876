"""
Train a Mixture-of-Experts GPT. With no arguments: built-in Shakespeare (characters), CPU or GPU.

    python train.py                                  # topk router, default small model
    python train.py --router=seqtopk --top_k=2       # sequence-level routing, same compute
    python train.py config/tiny.py --max_iters=50    # a preset file, then overrides
    torchrun --standalone --nproc_per_node=4 train.py --router=seqtopk
Every value below and every field of model.GPTConfig can be set with --key=value or a preset
file; --help lists them.
"""
import math
import os
import sys
import time
import uuid
from dataclasses import asdict, replace
from importlib.util import find_spec

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint as ckpt
import fast
from configurator import (Rule, a_seed, at_step, autocast_for, check, configure, device_name,
                          fraction, keep_freed_cpu_memory, non_empty, non_negative,
                          non_negative_int, one_of, pick_device, positive, positive_int, schedule)
from model import GPT, GPTConfig
from router import ROUTERS, step_ks
from stats import (ExpertSpend, add_counts, done_line, done_summary, eval_line,
                   predictive_entropy, routing_counts, routing_stats, routing_summary, start_line)

# -----------------------------------------------------------------------------
# I/O
out_dir = 'out'
eval_interval = 250
eval_iters = 20
log_interval = 25
always_save_checkpoint = False  # else only when val loss improves (and at the end)
overwrite = False               # a new run may replace the run in out_dir (moved to replaced/)
init_from = 'scratch'           # 'scratch', 'resume' (out_dir's run, its settings) or a ckpt.pt
eval_only = False               # evaluate init_from's checkpoint (scratch: out_dir's run) once
wandb_log = False               # log each evaluation to Weights & Biases (pip install wandb)
wandb_project = 'seqmoe'
wandb_run_name = ''             # '' = out_dir
# data
dataset = ckpt.DEFAULT_DATASET  # a folder under data/ made by prepare.py
batch_size = 16
gradient_accumulation_steps = 1
# model: every field of model.GPTConfig, with its default there (vocab_size comes from the data)
globals().update({k: v for k, v in asdict(GPTConfig()).items() if k != 'vocab_size'})
k_schedule = ''                 # training's k from each step on, 'step:k/step:k' (topk, mrltopk)
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
moe_impl = 'grouped'            # the experts' matmuls: 'grouped' (one kernel), 'loop' (per expert)
seed = 1337
# -----------------------------------------------------------------------------
RULES = dict(
    out_dir=non_empty, eval_interval=positive_int, eval_iters=positive_int,
    log_interval=positive_int, dataset=non_empty, batch_size=positive_int,
    init_from=Rule(lambda v: v in ('scratch', 'resume') or os.path.isfile(v),
                   "'scratch', 'resume' or the path of an existing ckpt.pt"),
    gradient_accumulation_steps=positive_int, learning_rate=positive, max_iters=non_negative_int,
    weight_decay=non_negative, beta1=fraction, beta2=fraction, grad_clip=non_negative,
    warmup_iters=non_negative_int, lr_decay_iters=non_negative_int, min_lr=non_negative,
    device=device_name, dtype=one_of('auto', 'float32', 'bfloat16', 'float16'),
    moe_impl=one_of('grouped', 'loop'), seed=a_seed,
    wandb_log=Rule(lambda v: not v or find_spec('wandb'), 'False: wandb is not installed (pip '
                   'install wandb)'))
RELATIONS = [('min_lr', lambda c: c['min_lr'] <= c['learning_rate'],
              'at most --learning_rate={learning_rate}')]
MODEL_RELATIONS = [  # checked on the model's settings as the run uses them (a checkpoint's, merged)
    ('k_schedule', lambda c: not c['k_schedule'] or schedule(c['k_schedule']) and all(
        1 <= k <= c['n_exp'] for _, k in schedule(c['k_schedule'])),
     "'step:k/step:k/...', steps rising from 0, each k between 1 and --n_exp={n_exp}"),
    ('k_schedule', lambda c: not c['k_schedule'] or ROUTERS[c['router']].per_step_k,
     "'' with --router={router}: only " + ', '.join(n for n, r in ROUTERS.items() if r.per_step_k)
     + " route with a per-step k")]
config, overridden = configure(globals(), sys.argv[1:], RULES, RELATIONS, GPTConfig)
t_begin = time.time()

# -----------------------------------------------------------------------------
# the run: its processes, its files, its model's settings (merged with a checkpoint's)
ddp = 'RANK' in os.environ  # launched by torchrun: NCCL on GPUs, gloo on the CPU
rank, world_size = (int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])) if ddp else (0, 1)
master_process = rank == 0
run = ckpt.Run(out_dir, ddp, master_process, world_size, config)  # files; how it stops
fail = run.fail
if eval_only and init_from == 'scratch':  # an evaluation of the run in out_dir: its checkpoint
    init_from = config['init_from'] = run.ckpt_path if os.path.isfile(run.ckpt_path) else fail(
        f"--eval_only=True evaluates a checkpoint and {out_dir}/ holds none; give "
        f"--init_from=PATH/ckpt.pt, or the --out_dir of a run")
reads_only = eval_only and run.holds_run()  # an evaluation writes nothing into a run's folder
if not reads_only and (problem := run.out_dir_problem()):
    fail(f"--out_dir={out_dir} {problem}")
model_args = {k: config[k] for k in ckpt.MODEL_KEYS if k in config}
iter_num, best_val_loss, checkpoint, from_run = 0, float('inf'), {}, None  # from_run: its base run
run_id = uuid.uuid4().hex[:12]  # names this run in its log, its checkpoint and a sweep's table
source = {'scratch': None, 'resume': run.ckpt_path}.get(init_from, init_from)
try:
    if source is not None:
        checkpoint, model_args = ckpt.load_to_continue(
            source, init_from == 'resume', model_args, overridden, quiet=not master_process)
    if init_from == 'resume' or eval_only:  # the run goes on with its own settings (evaluated:
        # its data and val batches), but those given here
        keep = config if init_from == 'resume' else ('dataset', 'batch_size', 'eval_iters')
        kept = {k: v for k, v in checkpoint.get('config', {}).items() if k in keep and k in config
                and k not in overridden and k not in ('out_dir', 'init_from', 'eval_only')}
        config.update(kept)
        globals().update(kept)
        check(config, RULES, RELATIONS)
    cfg = GPTConfig(**model_args)
    cfg.validate()  # the settings as the run uses them: a checkpoint's, merged
    check(dict(config, **model_args), {}, MODEL_RELATIONS)
except ValueError as e:
    fail(e)
block_size = cfg.block_size
if init_from == 'resume':
    if (logged := run.logged_run_id()) not in (None, checkpoint.get('run_id')):
        fail(f"{source} is not the checkpoint of the run in {run.log_path} (run {logged}): "
             f"that run replaced it and stopped before its first save; start again with "
             f"--overwrite=True, or give another --out_dir")
    iter_num = run.saved_iter = checkpoint['iter_num']
    if iter_num >= max_iters and not eval_only:  # it would save and log its end again
        fail(f"{source} is at step {iter_num} already, the run's end (--max_iters={max_iters}); "
             f"give a larger --max_iters to train on, or --eval_only=True to evaluate it")
    run_id, from_run = checkpoint.get('run_id', run_id), checkpoint.get('from_run')
    # the best val loss is the checkpoint's only under the routing it was measured with
    same_routing = all(checkpoint['model_args'].get(k) == v for k, v in model_args.items())
    best_val_loss = checkpoint['best_val_loss'] if same_routing else float('inf')
elif checkpoint:
    from_run = checkpoint.get('run_id')
    iter_num = checkpoint.get('iter_num', 0) if eval_only else 0  # an evaluation: its step
if eval_only:  # an evaluation reads a checkpoint and writes into no training run's folder
    run.write = master_process and not reads_only
elif init_from != 'resume' and run.holds_run() and not overwrite:
    fail(f"{out_dir}/ already holds a run; continue it with --init_from=resume, "
         f"or pick another --out_dir, or pass --overwrite=True to replace it"
         if os.path.exists(run.ckpt_path) else f"{out_dir}/ already holds a run that saved no "
         f"checkpoint; pass --overwrite=True to start it again, or pick another --out_dir")

# -----------------------------------------------------------------------------
# the device, the data, the model and the optimizer
data_dir = os.path.join('data', dataset)
try:
    device = pick_device(device)
    if ddp:  # this rank's device and its share of the accumulation steps
        device, gradient_accumulation_steps = ckpt.join_torchrun(
            device, gradient_accumulation_steps, world_size)
    if master_process:  # the built-in datasets are prepared on first use
        ckpt.on_first_use(dataset, data_dir)
    if ddp:
        dist.barrier()  # the other ranks wait for rank 0 to prepare the data
    meta = ckpt.check_data(data_dir, block_size)  # every file there, whole and long enough
    if checkpoint:
        ckpt.check_vocabulary(checkpoint, source, meta, data_dir)
except ValueError as e:
    fail(e)
cfg = replace(cfg, vocab_size=meta['vocab_size'])  # a checkpoint's: checked to be the same
device_type = device.split(':')[0]
lr_decay_iters = lr_decay_iters or max_iters
torch.manual_seed(seed)
keep_freed_cpu_memory()
dtype, ctx = autocast_for(device, dtype)
data = {split: np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=np.uint16, mode='r')
        for split in ('train', 'val')}
batch_gen = torch.Generator().manual_seed(seed)  # draws the training batches; checkpointed


def get_batch(split, generator=batch_gen):
    # every rank draws the training stream whole and keeps its share: N processes see what 1 would
    ours = generator is batch_gen
    x, y = ckpt.get_batch(data[split], block_size, batch_size, generator,
                          draws=world_size if ours else 1, take=rank if ours else 0)
    if device_type == 'cuda':
        return (t.pin_memory().to(device, non_blocking=True) for t in (x, y))
    return x.to(device), y.to(device)


model = fast.paths(GPT(cfg), moe_impl)  # the same weights, run by fast.py's equal paths
if checkpoint:
    ckpt.load_weights(model, checkpoint, source, quiet=not master_process)
model.to(device)
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if init_from == 'resume':  # a fine-tune starts a fresh optimizer (and warmup) on the weights
    ckpt.restore_state(checkpoint, source, optimizer, batch_gen, quiet=not master_process)
if wandb_log and master_process:  # W&B's run, whose id is this run's: before any file is written
    run.track(wandb_project, wandb_run_name or out_dir, run_id)
run.claim()  # out_dir, held by this run until it exits (rank 0, when it writes there)
scaler = torch.amp.GradScaler(device_type, enabled=dtype == 'float16')  # fp16: loss scaling
raw_model, routers = model, model.routers()  # no routers: a dense GPT
# compiled on one GPU, a training step that fast.graph_step allows runs as CUDA graphs (its
# hundreds of kernels launched as a few replays); evaluation never does (fast.compiled)
graphs = compile and not ddp and gradient_accumulation_steps == 1 and \
    fast.graph_step(raw_model, device_type)
model, eval_model = fast.compiled(model, graphs) if compile else (model, model)
if ddp:  # the routers' buffers (batchtopk's threshold, relu's lambda) are averaged instead
    model = DDP(model, device_ids=[device] if device_type == 'cuda' else None,
                broadcast_buffers=False)
    run.on_lost_peer()
if master_process:
    print(start_line(raw_model, device, dtype, batch_size, gradient_accumulation_steps,
                     world_size))


# -----------------------------------------------------------------------------
# evaluation, learning rate, each layer's k, checkpoints
@torch.no_grad()
def evaluate(split, online=None, entropy_bins=10):
    """Mean cross-entropy and aux loss over eval_iters fixed batches, and the routing counts."""
    gen = torch.Generator().manual_seed(int(split == 'val'))  # the same batches at every eval
    ce, aux, counts = [], [], None
    for _ in range(eval_iters):
        X, Y = get_batch(split, gen)
        with ctx:
            logits, loss, extra = eval_model(X, Y, online=online)
        ce.append(loss.item())
        aux.append(float(extra['aux_loss']))
        if extra['routing']:
            masks = torch.stack([mask for mask, _ in extra['routing']]).cpu()  # (layers, B, T, N)
            entropy = predictive_entropy(logits[..., :cfg.vocab_size]).cpu()
            counts = add_counts(counts, routing_counts(masks, entropy, cfg.top_k, entropy_bins))
    summary = routing_summary(counts, eval_iters) if counts else {}
    return dict(ce=float(np.mean(ce)), aux=float(np.mean(aux)), **summary), counts


def estimate_loss():
    """Train/val losses, per-layer routing on val and the routers' state. A router with an online
    rule is measured offline and causally: the causal number is what generation reaches."""
    model.eval()
    losses = {'train': evaluate('train')[0]}
    losses['val'], counts = evaluate('val')
    if any(r.online for r in routers):  # 'val' is whichever of the two the model trains with
        trained, other = ('val_causal', 'val_offline') if cfg.seq_causal else (
            'val_offline', 'val_causal')
        losses[trained], losses[other] = losses['val'], evaluate('val', not cfg.seq_causal)[0]
    layers = [dict(routing_stats(counts['hist'][i], counts['load'][i]),
                   **{name: value.tolist() for name, value in r.named_buffers()})
              for i, r in enumerate(routers)]
    model.train()
    return losses, layers


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def layer_ks(step):
    """Each MoE layer's k this step, a function of (seed, step): a resumed run redraws them."""
    if k_schedule:
        return [at_step(schedule(k_schedule), step)] * len(routers)
    return step_ks(cfg, len(routers), torch.Generator().manual_seed(seed * 1_000_003 + step))


def checkpoint_now():
    return dict(model=raw_model.state_dict(), optimizer=optimizer.state_dict(),
                model_args=asdict(cfg), config=config, iter_num=iter_num,
                best_val_loss=best_val_loss, meta=meta, dataset=dataset,
                batch_gen_state=batch_state, torch_rng_state=torch.get_rng_state(),
                run_id=run_id, from_run=from_run, **spend.state())


def evaluate_and_save():
    """Rank 0: the losses, a log record, and the checkpoint when val improved."""
    global best_val_loss, losses, layers
    losses, layers = estimate_loss()
    print(eval_line(iter_num, losses, layers, spend.per_token()))
    record = dict(event='eval', iter=iter_num, lr=lr, time=time.time() - t_start, layers=layers,
                  experts_trained=spend.per_token(),
                  **{f'{split}_{k}': v for split, d in losses.items() for k, v in d.items()})
    run.log(record)  # and to W&B with --wandb_log=True
    improved = losses['val']['ce'] < best_val_loss
    best_val_loss = min(best_val_loss, losses['val']['ce'])
    if iter_num > 0 and not eval_only and (
            improved or always_save_checkpoint or iter_num >= max_iters):
        run.save(checkpoint_now())


# -----------------------------------------------------------------------------
# the training loop (rank 0 evaluates, logs and saves)
code = ckpt.code_version() if master_process else None  # the commit this process runs
if init_from != 'resume' or eval_only:  # a new run, or an evaluation in a folder of its own
    run.new_log()  # the run this one replaces is moved out of the way first
    run.log(dict(event='start', eval_only=eval_only, config=config, model_args=asdict(cfg),
                 run_id=run_id, from_run=from_run, code=code, params=raw_model.num_params(),
                 active_params=raw_model.num_params(active=True)))
    run.write_failed()
run.listen(at_once=eval_only)  # an evaluation has nothing to save
if eval_only and any(r.needs_calibration() for r in routers):
    # e.g. batchtopk on a checkpoint not trained with it: its threshold set from training batches
    calibration = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(eval_iters):
            eval_model(*get_batch('train', calibration))
            raw_model.after_step()  # the routers' step rule: here batchtopk's threshold
spend = ExpertSpend(checkpoint if init_from == 'resume' else {}, device)  # experts per token
batch_state = batch_gen.get_state()  # the state that draws X, Y: a resumed run redraws them
X, Y = get_batch('train')
t_start = t_last = time.time()
while True:
    lr = get_lr(iter_num)
    for group in optimizer.param_groups:
        group['lr'] = lr
    if iter_num % eval_interval == 0 or iter_num >= max_iters or eval_only:
        run.check_weights(raw_model, iter_num)
        if master_process:
            evaluate_and_save()
    if iter_num >= max_iters or eval_only:
        break

    moe_ks, step_loss = layer_ks(iter_num), 0.0
    for micro_step in range(gradient_accumulation_steps):
        if ddp:  # gradients are all-reduced on the last micro-step only
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        if graphs:  # a new step (CUDA graphs)
            torch.compiler.cudagraph_mark_step_begin()
        with ctx:  # ce and aux read before the next call: a CUDA graph's replay overwrites them
            _, ce, extra = model(X, Y, moe_ks=moe_ks)
            loss = (ce + extra['aux_loss']) / gradient_accumulation_steps
        step_loss = step_loss + loss.detach()
        spend.add(extra['routing'], X.numel())
        batch_state = batch_gen.get_state()
        X, Y = get_batch('train')  # fetch the next batch while the backward runs on GPU
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)  # a no-op without fp16 loss scaling
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float('inf'))
    stopping = run.check_step(iter_num + 1, step_loss, grad_norm, scaler.is_enabled())
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    for buffer in (b for r in routers for b in r.buffers()) if ddp else ():
        dist.all_reduce(buffer)  # their mean: under DDP every rank routes alike
        buffer.div_(world_size)
    raw_model.after_step()  # the routers' rule after each step, e.g. relu's lambda
    iter_num += 1

    if iter_num % log_interval == 0 and master_process:
        ms, t_last = (time.time() - t_last) * 1000 / log_interval, time.time()
        aux = float(extra['aux_loss'].detach()) if torch.is_tensor(extra['aux_loss']) else 0.0
        print(f"iter {iter_num}: ce {ce.item():.4f}, aux {aux:.4f}, lr {lr:.2e}, {ms:.0f} ms/iter")
        run.log(dict(event='train', iter=iter_num, ce=ce.item(), aux=aux, lr=lr, ms_per_iter=ms,
                     experts=spend.since_last_log()))
    if stopping:  # preempted (SIGTERM) or Ctrl-C (SIGINT): keep everything, exit cleanly
        run.after_signal(raw_model, iter_num, checkpoint_now)

run.write_failed()  # the final save or log (rank 0)
if ddp:
    dist.destroy_process_group()
if master_process:  # the run's summary, also the last line of log.jsonl (sweep.py reads it)
    summary = done_summary(cfg, raw_model, routers, losses, layers, spend.per_token(),
                           iter=iter_num, time=time.time() - t_begin, init_from=init_from,
                           eval_only=eval_only, run_id=run_id, from_run=from_run,
                           code=code, config=config)
    run.log(summary)
    if run.error:
        fail(f"{run.error}; the run finished and {run.ckpt_path} holds its last checkpoint "
             f"(step {run.saved_iter})")
    print(done_line(summary) + (f"; checkpoint in {run.ckpt_path}" if run.saved_iter is not None
                                else ''))
    if run.wandb:
        run.wandb.finish()
