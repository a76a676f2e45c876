"""
What the scripts set up in their process before a model runs: the device, its dtype and autocast, the
process group of a torchrun launch, and a CPU allocator that keeps freed memory for reuse; and how a
training run stops (Stopper): on every rank at once, in one line, its last good checkpoint kept.
"""
import ctypes
import ctypes.util
import os
import platform
import re
import shlex
import signal
import sys

import torch
import torch.distributed as dist

from checkpoint import non_finite


def pick_device(device):
    """'auto' -> 'cuda' where a GPU is visible, else 'cpu'; ValueError for a device this machine lacks."""
    if device == 'auto':
        return 'cuda' if torch.cuda.is_available() else 'cpu'
    if device.startswith('cuda') and not torch.cuda.is_available() or device == 'mps' and not torch.backends.mps.is_available():
        raise ValueError(f"--device={device} is not available on this machine (no {device.split(':')[0]} device "
                         f"is visible); use --device=cpu")
    return device


def join_torchrun(device, accumulation, world_size):
    """Under torchrun (world_size processes): join the process group (NCCL on GPUs, gloo on the CPU) and
    return this rank's device (cuda:LOCAL_RANK on GPUs) and its share of the global gradient accumulation
    steps; ValueError for a launch these cannot be split over. Every rank checks, so that rank 0 says it."""
    if device.startswith('cuda'):
        local_rank, gpus = int(os.environ['LOCAL_RANK']), torch.cuda.device_count()
        if int(os.environ.get('LOCAL_WORLD_SIZE', local_rank + 1)) > gpus:
            raise ValueError(f"torchrun started more processes on this node than the {gpus} visible GPU(s): "
                             f"use --nproc_per_node={gpus}, or --device=cpu (gloo)")
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend='nccl' if device.startswith('cuda') else 'gloo')
    if accumulation > world_size and accumulation % world_size:
        raise ValueError(f"--gradient_accumulation_steps={accumulation} must be a multiple of the {world_size} "
                         f"processes (each runs gradient_accumulation_steps / {world_size}), or at most {world_size}")
    return device, max(1, accumulation // world_size)  # below one each, every rank runs one micro-step


def auto_dtype(device_type, capability=None):
    """--dtype=auto: bf16 on CUDA GPUs that compute in it (compute capability 8.0+: A100, H100,
    RTX 30 and later), fp16 with the loss scaler on older ones (V100, T4: torch would emulate bf16,
    slowly), float32 elsewhere."""
    if device_type != 'cuda':
        return 'float32'
    return 'bfloat16' if capability >= (8, 0) else 'float16'


def autocast_for(device, dtype):
    """The dtype the model runs in on device (auto_dtype for 'auto') and its autocast context
    (disabled for float32; the routers stay fp32 either way), for train.py and sample.py."""
    device_type = device.split(':')[0]
    if dtype == 'auto':
        capability = torch.cuda.get_device_capability(device) if device_type == 'cuda' else None
        dtype = auto_dtype(device_type, capability)
    return dtype, torch.autocast(device_type, dtype=getattr(torch, dtype), enabled=dtype != 'float32')


def keep_freed_cpu_memory():
    """Let glibc's malloc keep freed memory for reuse instead of returning it to the OS (as jemalloc
    or tcmalloc do, which PyTorch's CPU tuning guide recommends). Otherwise every large CPU tensor
    of 32 MB and up is a fresh mmap whose pages fault in one by one: the expert dispatch's gathers
    cost ~8x more. Linux with glibc only; elsewhere nothing changes."""
    if platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc':
        return
    libc = ctypes.CDLL(ctypes.util.find_library('c'))
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)  # allocations under 1 GB come from the reusable heap
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 31)  # and freeing keeps up to 2 GB of it for the next ones


class StopRequest:
    """SIGTERM (a preemption) or SIGINT (Ctrl-C): the loop finishes its step, saves and exits; the
    signal's name, once received (repeats are ignored)."""

    def __init__(self):
        self.signal = None
        signal.signal(signal.SIGTERM, self.request)
        signal.signal(signal.SIGINT, self.request)

    def request(self, signum, frame):
        self.signal = self.signal or signal.Signals(signum).name


def agree(ddp, *flags):
    """Whether any rank raised each flag: one small all-reduce, so that every rank stops at the
    same step (a diverged loss, a signal, a refused write)."""
    flags = torch.stack([torch.as_tensor(f, device=flags[0].device) for f in flags]).float()
    if ddp:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [bool(f) for f in flags.tolist()]


def resume_command(world_size, ddp):
    """The command that continues this run."""
    args = [a for a in sys.argv[1:] if not a.startswith(('--init_from=', '--overwrite='))]
    launcher = f"torchrun --standalone --nproc_per_node={world_size}" if ddp else "python"
    return f"{launcher} {shlex.join([sys.argv[0], *args, '--init_from=resume'])}"


def on_lost_peer(say, kept):
    """Under torchrun: when a collective fails because another process of the job died (killed, out
    of memory, its node preempted), exit with one line instead of a traceback (rank 0 says it, with
    kept(): what is left and how to resume); torchrun then ends the job and names the process."""
    default = sys.excepthook

    def hook(kind, error, tb):
        lost = isinstance(error, dist.DistError) or isinstance(error, RuntimeError) and any(
            s in str(error) for s in ('closed by peer', 'reset by peer', 'Broken pipe', 'Timed out'))
        if not lost:
            return default(kind, error, tb)
        if say:
            why = (str(error).strip().splitlines() or [kind.__name__])[0]
            why = re.sub(r'^\[[^\]]*\]\s*', '', why).split('. ')[0]  # gloo's: no source line, no advice
            print(f"error: a process of this torchrun job is gone ({why}); {kept()}", file=sys.stderr, flush=True)
    sys.excepthook = hook


class Stopper:
    """How a training run stops: every rank at the same step, writing nothing more, its last good
    checkpoint (run: checkpoint.RunFiles) kept; rank 0 says in one line why and how to go on.
    After listen(), SIGTERM (a preemption) or SIGINT (Ctrl-C) stops it after its step, saved."""

    def __init__(self, run, ddp, master_process, world_size, learning_rate):
        self.run, self.ddp, self.master = run, ddp, master_process
        self.world_size, self.learning_rate = world_size, learning_rate
        self.request = None

    def fail(self, message):  # under torchrun rank 0 alone says it
        raise SystemExit(f"error: {message}" if self.master else 1)

    def stop(self, why, fix):
        if self.ddp:
            dist.destroy_process_group()
        self.fail(f"{why}; {self.run.kept(fix, resume_command(self.world_size, self.ddp))}")

    def write_failed(self):  # a write the file system refused (rank 0): stop, nothing more written
        if self.run.error:
            self.stop(self.run.error, 'free some space')

    def diverged(self, step, what):
        if self.master:
            self.run.log(dict(event='diverged', iter=step, what=what))
        self.stop(f"{what} at step {step}: the run diverged and stopped",
                  f"lower --learning_rate (now {self.learning_rate:g})")

    def check_weights(self, model, step):
        """Every rank, before evaluating or saving: non-finite weights are never used or saved."""
        if bad := non_finite(model.state_dict()):  # equal on every rank under DDP
            self.diverged(step, f"the weights hold NaN or inf ({bad[0]})")

    def listen(self):
        self.request = StopRequest()

    def check_step(self, step, step_loss, grad_norm, scaled):
        """Before step `step` is applied, on every rank at once: a non-finite loss or gradient on
        any rank (scaled: fp16's scaler skips infs itself) stops the run with the step unapplied,
        as does a write rank 0 could not make; returns whether a signal asks to stop after it."""
        finite = torch.isfinite(step_loss) & (torch.isfinite(grad_norm) | scaled)
        diverged, stopping, failed_write = agree(self.ddp, ~finite, self.request.signal is not None,
                                                 self.run.error is not None)
        if failed_write:
            self.stop(self.run.error, 'free some space')
        if diverged:
            self.diverged(step, f"the training loss is {float(step_loss):.4g}"
                          if not torch.isfinite(step_loss) else f"the gradient norm is "
                          f"{float(grad_norm):.4g}" if not finite else
                          "another process's loss is not finite")
        return stopping

    def after_signal(self, model, step, checkpoint):
        """Save the step just taken (checkpoint(): its state), say how to resume, exit cleanly."""
        self.check_weights(model, step)
        if self.master:
            self.run.save(checkpoint())
            self.run.log(dict(event='stopped', iter=step, signal=self.request.signal))
            self.write_failed()
            print(f"{self.request.signal or 'signal on another rank'}: stopped after step {step} "
                  f"and saved {self.run.ckpt_path}; continue with: "
                  f"{resume_command(self.world_size, self.ddp)}", flush=True)
        if self.ddp:
            dist.destroy_process_group()
        sys.exit(0)

    def on_lost_peer(self):
        """Under torchrun: another process of the job dies: one line on rank 0, no traceback."""
        on_lost_peer(self.master, lambda: self.run.kept("see torchrun's summary",
                                                        resume_command(self.world_size, self.ddp)))
