"""A one-rank NCCL job on cuda:0 for the GPU checks of the Flight Recorder actor.

``--probe`` exits 0 when torch sees a CUDA device and NCCL. Otherwise it joins a world of one
(NCCL, file store), serves the SDK sockets with ``--sdk``, runs all_reduces on the GPU and prints
``READY`` after the first few; it keeps stepping until ``--max-runtime-s``. The NCCL debug-info
pipe and Flight Recorder come from the environment the test sets
(``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``, ``TORCH_FR_BUFFER_SIZE``, ...).
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--init", default="")
    ap.add_argument("--sdk", action="store_true")
    ap.add_argument("--max-runtime-s", type=float, default=120.0)
    args = ap.parse_args()
    import torch
    import torch.distributed as dist

    if args.probe:
        return 0 if torch.cuda.is_available() and dist.is_nccl_available() else 1
    if args.sdk:
        from agent import sdk

        sdk.serve_control()
        sdk.serve_torch_worker()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=args.init, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    x = torch.ones(1024, device="cuda")
    deadline = time.monotonic() + args.max_runtime_s
    step = 0
    while time.monotonic() < deadline:
        dist.all_reduce(x)
        torch.cuda.synchronize()
        step += 1
        if step == 3:
            print("READY", flush=True)
        time.sleep(0.05)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
