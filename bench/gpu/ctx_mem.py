#!/usr/bin/env python3
"""GPU memory of a bare CUDA context as nvidia-smi reports it per process: torch
initialises the device and allocates one byte. The reference for the standby's
overhead ("the CUDA context + 64 MiB")."""

import os
import subprocess
import time

import torch

torch.zeros(1, device="cuda")
torch.cuda.synchronize()
time.sleep(0.5)
q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                   capture_output=True, text=True, timeout=30)
mine = [line.split(",")[1].strip() for line in q.stdout.splitlines() if line.split(",")[0].strip() == str(os.getpid())]
print(f"bare CUDA context (torch {torch.__version__}, lazy module loading "
      f"{os.environ.get('CUDA_MODULE_LOADING', 'default')}): {mine[0] if mine else '?'} MiB")
