"""
What the scripts set up in their process before a model runs: the device, its dtype and autocast, and
a CPU allocator that keeps freed memory for reuse.
"""
import ctypes
import ctypes.util
import platform

import torch


def pick_device(device):
    """'auto' -> 'cuda' where a GPU is visible, else 'cpu'; ValueError for a device this machine lacks."""
    if device == 'auto':
        return 'cuda' if torch.cuda.is_available() else 'cpu'
    if device.startswith('cuda') and not torch.cuda.is_available() or device == 'mps' and not torch.backends.mps.is_available():
        raise ValueError(f"--device={device} is not available on this machine (no {device.split(':')[0]} device "
                         f"is visible); use --device=cpu")
    return device


def autocast_for(device, dtype):
    """The dtype the model runs in on device ('auto': bf16 on CUDA GPUs that have it, else float32) and
    its autocast context (disabled for float32; the routers stay fp32 either way), for train.py and sample.py."""
    device_type = device.split(':')[0]
    if dtype == 'auto':
        dtype = 'bfloat16' if device_type == 'cuda' and torch.cuda.is_bf16_supported() else 'float32'
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
