"""A minimal real CUDA process: initialise the driver, hold a context and some device memory.

Uses the CUDA driver API through ctypes on ``libcuda.so.1`` (no torch, no toolkit needed), so the
driver itself creates the user-triggered coredump FIFO at init when the environment arms it.

Usage:
    cuda_target.py --probe            exit 0 when a CUDA device is usable, 1 otherwise
    cuda_target.py --ready-file PATH  init CUDA, write our pid to PATH, then sleep (bounded)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time


def init_cuda() -> tuple[ctypes.CDLL, ctypes.c_void_p, ctypes.c_uint64]:
    """cuInit, a context on device 0 and a 16 MiB allocation; raises OSError when unusable."""
    lib = ctypes.CDLL("libcuda.so.1")
    count = ctypes.c_int(0)
    device = ctypes.c_int(0)
    context = ctypes.c_void_p()
    memory = ctypes.c_uint64(0)
    for name, call in (
        ("cuInit", lambda: lib.cuInit(0)),
        ("cuDeviceGetCount", lambda: lib.cuDeviceGetCount(ctypes.byref(count))),
        ("cuDeviceGet", lambda: lib.cuDeviceGet(ctypes.byref(device), 0)),
        ("cuDevicePrimaryCtxRetain", lambda: lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)),
        ("cuCtxSetCurrent", lambda: lib.cuCtxSetCurrent(context)),
        ("cuMemAlloc_v2", lambda: lib.cuMemAlloc_v2(ctypes.byref(memory), ctypes.c_size_t(16 << 20))),
    ):
        status = call()
        if status != 0:
            raise OSError(f"{name} returned CUDA error {status}")
        if name == "cuDeviceGetCount" and count.value < 1:
            raise OSError("no CUDA device")
    return lib, context, memory


def main() -> int:
    parser = argparse.ArgumentParser(description="minimal CUDA target")
    parser.add_argument("--probe", action="store_true")
    parser.add_argument("--ready-file", default="")
    parser.add_argument("--lifetime-s", type=float, default=300.0)
    args = parser.parse_args()
    try:
        init_cuda()
    except OSError as exc:
        print(f"CUDA unusable: {exc}", file=sys.stderr)
        return 1
    if args.probe:
        return 0
    tmp = args.ready_file + ".tmp"
    with open(tmp, "w", encoding="ascii") as fh:
        fh.write(str(os.getpid()))
    os.replace(tmp, args.ready_file)
    time.sleep(args.lifetime_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
