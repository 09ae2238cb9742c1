"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter when no GPU exists.

The variable must be set before any kernel module is imported (``triton.jit`` reads it when it
decorates a function), which is why it is set here, when pytest imports this conftest, before it
collects the test modules.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
