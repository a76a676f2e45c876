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
import pickle
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, fields

import numpy as np
import torch

from configurator import apply_overrides
from model import GPT, GPTConfig

# -----------------------------------------------------------------------------
# I/O
out_dir = 'out'
eval_interval = 250
eval_iters = 20
log_interval = 25
always_save_checkpoint = False  # else only when val loss improves (and at the end)
overwrite = False               # allow a new run to replace the checkpoint already in out_dir
init_from = 'scratch'           # 'scratch' or 'resume' (from out_dir/ckpt.pt)
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
moe_every = 1
router = 'topk'                 # topk | seqtopk
seq_min_k = 1
seq_max_k = 0                   # 0 = top_k + 2 (the paper's default); n_exp = no upper bound
norm_topk_prob = False
aux_loss_weight = 0.01
z_loss_weight = 0.001
moe_impl = 'grouped'            # 'grouped' (torch._grouped_mm) or 'loop' (one matmul per expert)
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
overridden = apply_overrides(globals(), sys.argv[1:])
config = {k: globals()[k] for k in sorted(globals()) if not k.startswith('_') and
          isinstance(globals()[k], (int, float, bool, str)) and k not in ('overridden',)}
MODEL_KEYS = [f.name for f in fields(GPTConfig)]
ROUTING_KEYS = {'router', 'top_k', 'seq_min_k', 'seq_max_k', 'norm_topk_prob', 'aux_loss_weight',
                'z_loss_weight', 'moe_impl', 'dropout'}  # may change on resume; the rest is architecture


def fail(message):
    raise SystemExit(f"error: {message}")


if device == 'auto':
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
device_type = 'cuda' if device.startswith('cuda') else device
if dtype == 'auto':
    dtype = 'bfloat16' if device_type == 'cuda' and torch.cuda.is_bf16_supported() else 'float32'
if device_type == 'cuda' and not torch.cuda.is_available():
    fail("device=cuda but no CUDA GPU is visible; use --device=cpu")
lr_decay_iters = lr_decay_iters or max_iters
torch.manual_seed(seed)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
ctx = nullcontext() if device_type == 'cpu' else torch.autocast(device_type=device_type, dtype=ptdtype)
os.makedirs(out_dir, exist_ok=True)

# -----------------------------------------------------------------------------
# data: the built-in datasets are prepared on first use, anything else must exist
data_dir = os.path.join('data', dataset)
if not os.path.exists(os.path.join(data_dir, 'train.bin')):
    builtin = {'shakespeare_char': [], 'shakespeare': ['--tokenizer=gpt2']}
    if dataset not in builtin:
        fail(f"no data in {data_dir}/; make it with `python prepare.py --text=FILE` or "
             f"`--dataset=HUB_NAME` (or use the built-in --dataset=shakespeare_char)")
    print(f"preparing the built-in dataset '{dataset}' in {data_dir}/")
    import prepare
    prepare.main(builtin[dataset] + [f'--out_dir={data_dir}'])
with open(os.path.join(data_dir, 'meta.pkl'), 'rb') as f:
    meta = pickle.load(f)
data = {split: np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=np.uint16, mode='r')
        for split in ('train', 'val')}
for split, arr in data.items():
    if len(arr) <= block_size:
        fail(f"{data_dir}/{split}.bin has {len(arr)} tokens, fewer than block_size={block_size} + 1")
batch_gen = torch.Generator().manual_seed(seed)  # its state goes into the checkpoint


def get_batch(split, generator=batch_gen):
    arr = data[split]
    ix = torch.randint(len(arr) - block_size, (batch_size,), generator=generator).tolist()
    x = torch.stack([torch.from_numpy(arr[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(arr[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    if device_type == 'cuda':
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


# -----------------------------------------------------------------------------
# model, optimizer, and (for resume) the checkpoint they continue from
model_args = {k: config[k] for k in MODEL_KEYS if k in config}
model_args['vocab_size'] = meta['vocab_size']
iter_num, best_val_loss, checkpoint = 0, float('inf'), None
ckpt_path = os.path.join(out_dir, 'ckpt.pt')
if init_from == 'resume':
    if not os.path.exists(ckpt_path):
        fail(f"--init_from=resume but there is no {ckpt_path}")
    checkpoint = torch.load(ckpt_path, map_location=device, weights_only=True)
    for k, saved in checkpoint['model_args'].items():
        if k in overridden and model_args.get(k) != saved and k not in ROUTING_KEYS:
            fail(f"{ckpt_path} was trained with {k}={saved!r}, this run asks for {k}={model_args[k]!r}; "
                 f"drop --{k} or use another --out_dir")
        if k not in overridden:
            model_args[k] = saved
    if checkpoint['model_args']['vocab_size'] != meta['vocab_size']:
        fail(f"{ckpt_path} has vocab_size={checkpoint['model_args']['vocab_size']}, but {data_dir} has "
             f"{meta['vocab_size']}; resume on the dataset it was trained on (--dataset={checkpoint['dataset']})")
    iter_num, best_val_loss = checkpoint['iter_num'], checkpoint['best_val_loss']
elif init_from != 'scratch':
    fail(f"init_from must be 'scratch' or 'resume', got '{init_from}'")
elif os.path.exists(ckpt_path) and not overwrite:
    fail(f"{out_dir}/ already holds a run; continue it with --init_from=resume, "
         f"or pick another --out_dir, or pass --overwrite=True to replace it")
try:
    model = GPT(GPTConfig(**model_args))
except ValueError as e:
    fail(e)
if checkpoint is not None:
    model.load_state_dict(checkpoint['model'])
model.to(device)
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if checkpoint is not None:
    optimizer.load_state_dict(checkpoint['optimizer'])
    batch_gen.set_state(checkpoint['batch_gen_state'])
    torch.set_rng_state(checkpoint['torch_rng_state'])
scaler = torch.amp.GradScaler(enabled=(dtype == 'float16' and device_type == 'cuda'))
raw_model = model
if compile:
    model = torch.compile(model)
cfg = raw_model.config
print(f"{cfg.router} routing, {cfg.top_k} of {cfg.n_exp} experts per token: "
      f"{raw_model.num_params() / 1e6:.2f}M parameters, {raw_model.num_params(active=True) / 1e6:.2f}M active; "
      f"device {device}, {dtype}")


# -----------------------------------------------------------------------------
# evaluation, learning rate, logging, checkpointing
def routing_summary(routing):
    """Experts per token over all MoE layers of a forward pass: mean, min, max."""
    counts = torch.cat([mask.sum(-1).flatten() for mask, _ in routing]).float()
    return dict(mean=counts.mean().item(), min=counts.min().item(), max=counts.max().item())


@torch.no_grad()
def estimate_loss():
    """Mean train/val cross-entropy (and aux loss) over eval_iters batches from a fixed stream."""
    model.eval()
    out = {}
    for split in ('train', 'val'):
        gen = torch.Generator().manual_seed(seed + (split == 'val'))  # same batches at every eval
        ce, aux, experts = [], [], []
        for _ in range(eval_iters):
            X, Y = get_batch(split, gen)
            with ctx:
                _, loss, extra = model(X, Y)
            ce.append(loss.item())
            aux.append(float(extra['aux_loss']))
            experts.append(routing_summary(extra['routing'])['mean'])
        out[split] = dict(ce=float(np.mean(ce)), aux=float(np.mean(aux)), experts_per_token=float(np.mean(experts)))
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def log(record):
    with open(os.path.join(out_dir, 'log.jsonl'), 'a') as f:
        f.write(json.dumps(record) + '\n')


def save_checkpoint():
    """Write to a temporary file, then rename: a run killed mid-save keeps its last good checkpoint."""
    ckpt = dict(model=raw_model.state_dict(), optimizer=optimizer.state_dict(),
                model_args=asdict(raw_model.config), config=config, iter_num=iter_num,
                best_val_loss=best_val_loss, meta=meta, dataset=dataset,
                batch_gen_state=batch_gen.get_state(), torch_rng_state=torch.get_rng_state())
    torch.save(ckpt, ckpt_path + '.tmp')
    os.replace(ckpt_path + '.tmp', ckpt_path)


# -----------------------------------------------------------------------------
# training loop
if init_from == 'scratch':
    open(os.path.join(out_dir, 'log.jsonl'), 'w').close()  # a new run starts a new log
    log(dict(event='start', config=config, model_args=asdict(cfg), params=raw_model.num_params(),
             active_params=raw_model.num_params(active=True)))
X, Y = get_batch('train')
t_start = t_last = time.time()
while True:
    lr = get_lr(iter_num)
    for group in optimizer.param_groups:
        group['lr'] = lr

    if iter_num % eval_interval == 0 or iter_num == max_iters:
        losses = estimate_loss()
        print(f"step {iter_num}: train ce {losses['train']['ce']:.4f}, val ce {losses['val']['ce']:.4f}, "
              f"aux {losses['val']['aux']:.4f}, experts/token {losses['val']['experts_per_token']:.2f}")
        log(dict(event='eval', iter=iter_num, lr=lr, time=time.time() - t_start, **{
            f'{split}_{k}': v for split, d in losses.items() for k, v in d.items()}))
        improved = losses['val']['ce'] < best_val_loss
        best_val_loss = min(best_val_loss, losses['val']['ce'])
        if iter_num > 0 and (improved or always_save_checkpoint or iter_num == max_iters):
            save_checkpoint()
    if iter_num >= max_iters:
        break

    for micro_step in range(gradient_accumulation_steps):
        with ctx:
            _, ce, extra = model(X, Y)
            loss = (ce + extra['aux_loss']) / gradient_accumulation_steps
        X, Y = get_batch('train')  # fetch the next batch while the backward runs on GPU
        scaler.scale(loss).backward()
    if grad_clip:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1

    if iter_num % log_interval == 0:
        now = time.time()
        ms = (now - t_last) * 1000 / log_interval
        t_last = now
        aux = float(extra['aux_loss'].detach()) if torch.is_tensor(extra['aux_loss']) else 0.0
        print(f"iter {iter_num}: ce {ce.item():.4f}, aux {aux:.4f}, lr {lr:.2e}, {ms:.0f} ms/iter")
        log(dict(event='train', iter=iter_num, ce=ce.item(), aux=aux, lr=lr, ms_per_iter=ms))

print(f"done: {iter_num} iterations in {time.time() - t_start:.0f}s, best val ce {best_val_loss:.4f}; "
      f"checkpoint in {ckpt_path}")
