"""
bench.py's GPU columns from the profiler's events, on the CPU: synthetic events stand in for a
GPU's (kernels that overlap, a memcpy, a memset, a GPU-side annotation).
Run: python -m pytest -q tests/test_bench.py
"""
import types

import torch
from torch.autograd import DeviceType

import bench

# (name, start µs, duration µs, kind): two kernels overlapping on 5-10, a third after a gap
EVENTS = [('gemm', 0.0, 10.0, 'kernel'), ('gelu', 5.0, 10.0, 'kernel'),
          ('Memcpy HtoD (Pageable -> Device)', 16.0, 50.0, 'gpu_memcpy'),
          ('Memset (Device)', 17.0, 40.0, 'gpu_memset'),
          ('MoE.forward', 0.0, 100.0, 'gpu_user_annotation'),
          ('add', 20.0, 2.0, 'kernel'), ('inside gemm', 1.0, 3.0, 'kernel')]


def test_gpu_busy_is_the_union_of_kernel_intervals_and_copies_are_not_kernels():
    busy, count = bench.kernel_work(EVENTS)
    assert count == 4  # gemm, gelu, add, inside gemm: no memcpy, memset or annotation
    assert busy == 15.0 + 2.0  # 0-15 once (not 10 + 10 + 3), then 20-22; the copies' 50 µs apart
    # an older torch's events have no kind: the names tell the copies apart
    busy, count = bench.kernel_work([(n, s, d, None) for n, s, d, kind in EVENTS[:4]])
    assert (busy, count) == (15.0, 2)
    assert bench.kernel_work([]) == (0.0, 0)


def test_bench_s_gpu_columns_come_from_kernel_work_per_call(monkeypatch):
    # device_work on a stand-in profiler whose events are EVENTS (a GPU's) and a CPU op
    def event(name, start, length, kind, device=DeviceType.CUDA):
        return types.SimpleNamespace(name=name, device_type=device, activity_type=kind,
                                     time_range=types.SimpleNamespace(
                                         start=start, elapsed_us=lambda: length))

    class Profile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return [event(*e) for e in EVENTS] + [event('aten::mm', 0.0, 500.0, 'cpu_op',
                                                        DeviceType.CPU)]
    monkeypatch.setattr(bench, 'device_type', 'cuda')
    monkeypatch.setattr(bench, 'profile', Profile)
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda: None)
    ran = []
    busy, kernels = bench.device_work(lambda: ran.append(1), calls=2)
    assert ran == [1] and kernels == 2 and abs(busy - 17e-6 / 2) < 1e-12
