"""
Train a Mixture-of-Experts GPT. With no arguments: built-in Shakespeare (characters), CPU or GPU.

    python train.py                                  # topk router, default small model
    python train.py --router=seqtopk --top_k=2       # sequence-level routing, same compute
    python train.py config/tiny.py --max_iters=50    # a preset file, then overrides

Every value below can be overridden with --key=value or a preset file (see configurator.py).
"""
import json
import math
import os
import shlex
import signal
import sys
import time
from contextlib import suppress
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint as ckpt_io
import prepare
from configurator import (Rule, configure, device_name, fraction, non_empty, non_negative, non_negative_int, one_of,
                          positive, positive_int)
from model import GPT, GPTConfig, ROUTING_KEYS
from router import step_budgets
from runtime import autocast_for, join_torchrun, keep_freed_cpu_memory, pick_device
from stats import (add_counts, done_line, eval_line, layer_mean, predictive_entropy, routing_counts, routing_stats,
                   routing_summary)

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
n_exp = 8
top_k = 2
exp_dim = 128
moe_every = 1                   # every moe_every-th block is MoE (1 = all, 0 = none: a dense GPT)
mlp_dim = 0                     # width of the dense FFN blocks (0 = 4 * n_embd)
router = 'topk'                 # topk | mrltopk | seqtopk | batchtopk | relu (router.ROUTERS)
seq_min_k = 1
seq_max_k = 0                   # 0 = top_k + 2 (the paper's default); n_exp = no upper bound
score_func = 'softmax'          # router scores: 'softmax' or 'sigmoid'
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
RELATIONS = [('min_lr', lambda c: c['min_lr'] <= c['learning_rate'], 'at most --learning_rate={learning_rate}')]
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
    fail(f"--out_dir={out_dir} {out_dir_problem}; give another --out_dir")
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
if not os.path.exists(data_dir) and master_process:
    if dataset not in prepare.BUILTIN:
        fail(f"no data in {data_dir}/; make it with `python prepare.py --text=FILE` or "
             f"`--dataset=HUB_NAME_OR_PATH` (or use the built-in --dataset=shakespeare_char)")
    print(f"preparing the built-in dataset '{dataset}' in {data_dir}/")
    prepare.main(prepare.BUILTIN[dataset] + [f'--out_dir={data_dir}'])
if ddp:
    dist.barrier()  # the other ranks wait for rank 0 to prepare the data
try:
    meta = prepare.check_data(data_dir, block_size)  # every file there, whole, long enough, readable
except ValueError as e:
    fail(e)
data = {split: np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=np.uint16, mode='r')
        for split in ('train', 'val')}
batch_gen = torch.Generator().manual_seed(seed)  # draws the training batches; checkpointed


def get_batch(split, generator=batch_gen):
    # Every rank draws the same stream of batches and keeps its own: the global batch is what one
    # process with gradient_accumulation_steps * world_size micro-steps would see.
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
ckpt_path = os.path.join(out_dir, 'ckpt.pt')
source = None if init_from == 'scratch' else ckpt_path if init_from == 'resume' else init_from
if source is not None:  # resume a run, or fine-tune (a new run) from another run's weights
    if not os.path.isfile(source):
        fail(f"--init_from=resume but there is no checkpoint at {source}; "
             f"start the run with --init_from=scratch, or give the --out_dir of the run to continue")
    checkpoint = ckpt_io.load(source, ('model', 'model_args') + (
        ('optimizer', 'iter_num', 'best_val_loss', 'batch_gen_state', 'torch_rng_state') if init_from == 'resume' else ()),
        quiet=not master_process)  # under torchrun, rank 0 says what is wrong once
    try:  # settings not given here come from the checkpoint; of those given, only the routing may differ
        model_args = ckpt_io.merged_args(checkpoint['model_args'], model_args, overridden, ROUTING_KEYS, source)
    except ValueError as e:
        fail(e)
    if checkpoint['model_args'].get('vocab_size') != meta['vocab_size']:
        fail(f"{source} has vocab_size={checkpoint['model_args'].get('vocab_size')}, but {data_dir} has "
             f"{meta['vocab_size']}; use the dataset it was trained on (--dataset={checkpoint.get('dataset')})")
    model_config(model_args)
    if init_from == 'resume':
        iter_num, best_val_loss = checkpoint['iter_num'], checkpoint['best_val_loss']
if init_from != 'resume' and os.path.exists(ckpt_path) and not overwrite and not eval_only:
    fail(f"{out_dir}/ already holds a run; continue it with --init_from=resume, "
         f"or pick another --out_dir, or pass --overwrite=True to replace it")
model = GPT(model_config(model_args))
if checkpoint is not None:
    ckpt_io.load_weights(model, checkpoint, source, quiet=not master_process)
model.to(device)
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if init_from == 'resume':  # a fine-tune starts a fresh optimizer (and warmup) on the loaded weights
    try:
        optimizer.load_state_dict(checkpoint['optimizer'])
        batch_gen.set_state(checkpoint['batch_gen_state'])
        torch.set_rng_state(checkpoint['torch_rng_state'])
    except (ValueError, RuntimeError, TypeError, KeyError) as e:
        fail(f"{source} has an optimizer or RNG state this run cannot restore ({type(e).__name__}); "
             f"fine-tune from it instead: --init_from={source} --out_dir=ANOTHER_DIR")
os.makedirs(out_dir, exist_ok=True)
scaler = torch.amp.GradScaler(enabled=(dtype == 'float16' and device_type == 'cuda'))
raw_model = model
if compile:
    model = torch.compile(model)
if ddp:  # buffers (batchtopk threshold, relu lambda) are averaged by sync_router_state instead
    model = DDP(model, device_ids=[device] if device_type == 'cuda' else None, broadcast_buffers=False)
cfg = raw_model.config
routers = raw_model.routers()  # none in a dense GPT (--moe_every=0)


def sync_router_state():
    """Average the routers' running state over the ranks, so every rank routes identically."""
    for buffer in (b for r in routers for b in r.state().values()) if ddp else ():
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
        buffer.div_(world_size)


if master_process:
    print((f"{cfg.router} routing, {cfg.top_k} of {cfg.n_exp} experts per token: " if routers else
           f"dense GPT (no MoE layers), FFN width {cfg.mlp_dim or 4 * cfg.n_embd}: ") +
          f"{raw_model.num_params() / 1e6:.2f}M parameters, {raw_model.num_params(active=True) / 1e6:.2f}M active; "
          f"device {device}, {dtype}; global batch {batch_size * gradient_accumulation_steps * world_size} "
          f"sequences = {batch_size} x {gradient_accumulation_steps} micro-steps" +
          (f" x {world_size} processes" if ddp else ''))


# -----------------------------------------------------------------------------
# evaluation, learning rate, logging, checkpointing
@torch.no_grad()
def evaluate(split, causal=None, entropy_bins=10):
    """Mean cross-entropy and aux loss over eval_iters fixed batches of a split, and what the
    routing plots need: per layer the experts-per-token histogram and the expert load; mean experts
    per token at each position; mean experts per token against the token's predictive entropy
    (in entropy_bins bins of H / log V); and the worst prefix overspend (experts taken by tokens
    1..m beyond m * top_k, what the online budget promises never happens)."""
    gen = torch.Generator().manual_seed(seed + (split == 'val'))  # the same batches at every eval
    ce, aux, counts = [], [], None
    for _ in range(eval_iters):
        X, Y = get_batch(split, gen)
        with ctx:
            logits, loss, extra = model(X, Y, causal=causal)
        ce.append(loss.item())
        aux.append(float(extra['aux_loss']))
        if extra['routing']:  # a dense GPT (moe_every=0) routes nothing
            masks = torch.stack([mask for mask, _ in extra['routing']]).cpu()  # (layers, B, T, N)
            counts = add_counts(counts, routing_counts(masks, predictive_entropy(logits).cpu(), cfg.top_k, entropy_bins))
    summary = routing_summary(counts, eval_iters) if counts else {}
    return dict(ce=float(np.mean(ce)), aux=float(np.mean(aux)), **summary), counts


def estimate_loss():
    """Train/val losses and per-layer routing statistics on val (experts per token, expert load,
    entropy; the routers' state, e.g. relu's lambda, batchtopk's threshold). For a router with an online
    rule (seqtopk) the val loss is measured with offline (whole-sequence) and causal (online) routing:
    offline routing lets a token's expert count depend on later tokens, so the causal number is the one
    generation reaches."""
    model.eval()
    losses = {'train': evaluate('train')[0]}
    losses['val'], counts = evaluate('val')
    if any(r.spec.online for r in routers):  # 'val' is whichever of the two the model trains with
        other = 'val_offline' if cfg.seq_causal else 'val_causal'
        losses['val_causal' if cfg.seq_causal else 'val_offline'] = losses['val']
        losses[other] = evaluate('val', causal=not cfg.seq_causal)[0]
    layers = [dict(routing_stats(counts['hist'][i], counts['load'][i]),
                   **{name: value.tolist() for name, value in r.state().items()}) for i, r in enumerate(routers)]
    model.train()
    return losses, layers


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def log(record):
    """Append a line to log.jsonl; if the file system refuses, the log is cut back to its last whole line
    (and after a refused write, nothing more is written)."""
    if io_error:
        return
    try:
        ckpt_io.append_line(os.path.join(out_dir, 'log.jsonl'), json.dumps(record))
    except OSError as e:
        io_failed(os.path.join(out_dir, 'log.jsonl'), e)


def save_checkpoint():
    """Atomically (checkpoint.save): a run killed mid-save keeps its last good checkpoint."""
    global saved_iter
    if io_error:  # the run stops after this step; its last good checkpoint stays as it is
        return
    try:
        ckpt_io.save(dict(model=raw_model.state_dict(), optimizer=optimizer.state_dict(),
                          model_args=asdict(raw_model.config), config=config, iter_num=iter_num,
                          best_val_loss=best_val_loss, meta=meta, dataset=dataset,
                          batch_gen_state=batch_state, torch_rng_state=torch.get_rng_state(),
                          pairs_trained=int(pairs_trained), tokens_trained=tokens_trained), ckpt_path)
        saved_iter = iter_num
    except OSError as e:
        io_failed(ckpt_path, e)


def io_failed(path, e):
    """A write the file system refused (disk full, quota, I/O error): the run stops after this step, on
    every rank, keeping its last good checkpoint."""
    global io_error
    io_error = io_error or f"could not write {path} ({e.strerror or e})"


def stop(why, fix):
    """Stop, on every rank, writing nothing more: ckpt.pt keeps the last good state; rank 0 says why and
    how to go on."""
    if ddp:
        dist.destroy_process_group()
    kept = (f"{ckpt_path} is left as it was (step {saved_iter}); {fix}, then continue with: {resume_command()}"
            if saved_iter is not None else f"this run wrote no checkpoint; {fix}, then start again")
    fail(f"{why}; {kept}")


def check_weights(step):
    """Every rank, before evaluating or saving: non-finite weights are never evaluated or saved."""
    bad = ckpt_io.non_finite(raw_model.state_dict())  # the same on every rank: DDP keeps the weights equal
    if bad:
        stop_diverged(step, f"the weights hold NaN or inf ({bad[0]})")


def stop_diverged(step, what):
    """Stop a run that went non-finite, writing nothing: ckpt.pt keeps the last good state."""
    if master_process:
        log(dict(event='diverged', iter=step, what=what))
    stop(f"{what} at step {step}: the run diverged and stopped", f"lower --learning_rate (now {learning_rate:g})")


def request_stop(signum, frame):
    """SIGTERM / SIGINT: the loop finishes the current step, saves, and exits (repeats are ignored)."""
    global stop_signal
    stop_signal = stop_signal or signal.Signals(signum).name


def resume_command():
    args = [a for a in sys.argv[1:] if not a.startswith(('--init_from=', '--overwrite='))]
    launcher = f"torchrun --standalone --nproc_per_node={world_size}" if ddp else "python"
    return f"{launcher} {shlex.join([sys.argv[0], *args, '--init_from=resume'])}"


# -----------------------------------------------------------------------------
# training loop (rank 0 evaluates, logs and saves)
saved_iter = checkpoint['iter_num'] if init_from == 'resume' else None  # this run's checkpoint in ckpt_path
io_error = None  # the first write the file system refused (io_failed)
if init_from != 'resume' and not eval_only and master_process:
    with suppress(FileNotFoundError):
        os.remove(os.path.join(out_dir, 'log.jsonl'))  # a new run starts a new log
    log(dict(event='start', config=config, model_args=asdict(cfg), params=raw_model.num_params(),
             active_params=raw_model.num_params(active=True)))
    if io_error:
        stop(io_error, 'free some space')
stop_signal = None  # set by request_stop
signal.signal(signal.SIGTERM, request_stop)
signal.signal(signal.SIGINT, request_stop)
if eval_only and any(r.needs_calibration() for r in routers):
    # e.g. batchtopk on a checkpoint never trained with it has no threshold (<= 0 passes every expert): set
    # it as training does, from eval_iters training batches in training mode, without a gradient step
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
t_start = t_last = time.time()
while True:
    lr = get_lr(iter_num)
    for group in optimizer.param_groups:
        group['lr'] = lr

    evaluating = iter_num % eval_interval == 0 or iter_num >= max_iters
    if evaluating:
        check_weights(iter_num)
    if evaluating and master_process:
        losses, layers = estimate_loss()
        experts_trained = pairs_trained.item() / tokens_trained if tokens_trained else None
        print(eval_line(iter_num, losses, layers, experts_trained))
        log(dict(event='eval', iter=iter_num, lr=lr, time=time.time() - t_start, layers=layers,
                 experts_trained=experts_trained, **{
            f'{split}_{k}': v for split, d in losses.items() for k, v in d.items()}))
        improved = losses['val']['ce'] < best_val_loss
        best_val_loss = min(best_val_loss, losses['val']['ce'])
        if iter_num > 0 and (improved or always_save_checkpoint or iter_num >= max_iters):
            save_checkpoint()
    if iter_num >= max_iters or eval_only:
        break

    step_loss = 0.0
    # every MoE layer's k for this step (mrltopk draws them), a function of (seed, step) alone: the same on
    # every rank and micro-step, and a resumed run redraws exactly what the straight run drew
    moe_ks = step_budgets(cfg, len(routers), torch.Generator().manual_seed(seed * 1_000_003 + iter_num))
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
    # one small all-reduce: every rank learns whether any rank diverged or was signalled, so all stop at this step
    finite = torch.isfinite(step_loss) & (torch.isfinite(grad_norm) | scaler.is_enabled())  # fp16: scaler skips infs
    flags = torch.stack([~finite, torch.tensor(stop_signal is not None, device=finite.device),
                         torch.tensor(io_error is not None, device=finite.device)]).float()
    if ddp:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    diverged, stopping, failed_write = flags.tolist()
    if failed_write:  # on rank 0 (the only one writing): every rank stops here, none goes on without it
        stop(io_error, 'free some space')
    if diverged:  # the step is not applied; nothing is saved
        stop_diverged(iter_num + 1, f"the training loss is {float(step_loss):.4g}" if not torch.isfinite(step_loss) else
                      f"the gradient norm is {float(grad_norm):.4g}" if not finite else "another process's loss is not finite")
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    sync_router_state()
    raw_model.after_step()  # the routers' step rule, e.g. relu's lambda and thresholds
    iter_num += 1

    if iter_num % log_interval == 0 and master_process:
        now = time.time()
        ms = (now - t_last) * 1000 / log_interval
        t_last = now
        aux = float(extra['aux_loss'].detach()) if torch.is_tensor(extra['aux_loss']) else 0.0
        print(f"iter {iter_num}: ce {ce.item():.4f}, aux {aux:.4f}, lr {lr:.2e}, {ms:.0f} ms/iter")
        log(dict(event='train', iter=iter_num, ce=ce.item(), aux=aux, lr=lr, ms_per_iter=ms))
    if stopping:  # preempted (SIGTERM) or Ctrl-C (SIGINT): keep everything, exit cleanly
        check_weights(iter_num)
        if master_process:
            save_checkpoint()
            log(dict(event='stopped', iter=iter_num, signal=stop_signal))
            if io_error:
                stop(io_error, 'free some space')
            print(f"{stop_signal or 'signal on another rank'}: stopped after step {iter_num} and saved {ckpt_path}; "
                  f"continue with: {resume_command()}", flush=True)
        if ddp:
            dist.destroy_process_group()
        sys.exit(0)

if io_error:  # the final save or log (rank 0)
    stop(io_error, 'free some space')
if ddp:
    dist.destroy_process_group()
if master_process:  # the run's summary, also the last line of log.jsonl (sweep.py reads it)
    summary = dict(event='done', iter=iter_num, time=time.time() - t_begin, router=cfg.router if routers else 'dense',
                   top_k=cfg.top_k, n_exp=cfg.n_exp, mlp_dim=cfg.mlp_dim or 4 * cfg.n_embd, moe_layers=len(routers),
                   params=raw_model.num_params(), active_params=raw_model.num_params(active=True),
                   init_from=init_from, eval_only=eval_only, val_ce=losses['val']['ce'],
                   val_ce_offline=losses.get('val_offline', losses['val'])['ce'],
                   val_ce_causal=losses['val_causal']['ce'] if 'val_causal' in losses else None,
                   experts_trained=experts_trained,
                   **{k: layer_mean(layers, k) for k in ('experts_mean', 'load_cv', 'entropy')})
    log(summary)
    if io_error:
        fail(f"{io_error}; the run finished and {ckpt_path} holds its last checkpoint (step {saved_iter})")
    print(done_line(summary) + (f"; checkpoint in {ckpt_path}" if saved_iter is not None else ''))
