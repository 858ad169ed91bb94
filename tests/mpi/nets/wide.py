"""A wide network for the preemption tests: --model tests/mpi/nets/wide.py:build --dataset digits.

Flatten - fc 100,000 - ReLU - fc10: 7.5 M parameters, so a checkpoint (weights and momentum) is 60 MB,
as in issue 36 (a 60 MB checkpoint every 0.5 s while the job is sent SIGTERM). A minibatch of 16 digits
takes milliseconds; writing the checkpoint takes 0.1 to 0.5 s.
"""

from mpiasgd.model.layers import Flatten, Linear, ReLU


def build() -> list:
    return [Flatten(), Linear(64, 100000), ReLU(), Linear(100000, 10, init="zeros")]
