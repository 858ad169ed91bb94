"""A user-defined network for the tests: defined outside the package, trained with --model
tests/mpi/nets/small_bn.py:build --dataset digits (8x8 digit images, 10 classes).

conv3x3(16, no bias) BN ReLU - a residual block with a projection shortcut (stride 2) - a residual
block with the identity - dropout - global average pooling - fc10. It uses the layers with state
(BatchNorm's running statistics), the residual graph and dropout: what a network from a file must carry
into the run log as data.
"""

from mpiasgd.model.layers import BatchNorm2d, Conv2d, Dropout, GlobalAvgPool, Linear, ReLU, Residual


def block(cin: int, cout: int, stride: int) -> Residual:
    main = [Conv2d(cin, cout, 3, stride, 1, bias=False), BatchNorm2d(cout), ReLU(),
            Conv2d(cout, cout, 3, 1, 1, bias=False), BatchNorm2d(cout)]
    shortcut = [Conv2d(cin, cout, 1, stride, 0, bias=False), BatchNorm2d(cout)] if stride != 1 or cin != cout else []
    return Residual(main, shortcut, [ReLU()])


def build() -> list:
    return [Conv2d(1, 16, 3, 1, 1, bias=False), BatchNorm2d(16), ReLU(),
            block(16, 32, 2), block(32, 32, 1), Dropout(0.1), GlobalAvgPool(), Linear(32, 10, init="zeros")]


def wrong_classes() -> list:
    """Does not fit digits: 3 logits for 10 classes."""
    return [Conv2d(1, 8, 3, 1, 1), ReLU(), GlobalAvgPool(), Linear(8, 3)]


def wrong_input() -> list:
    """Does not fit digits: expects 3-channel images."""
    return [Conv2d(3, 8, 3, 1, 1), ReLU(), GlobalAvgPool(), Linear(8, 10)]


def exits() -> list:
    """A model file that ends the process (rank 0 must report it, not leave the workers waiting)."""
    import sys

    sys.exit(3)


def numpy_sizes() -> list:
    """Sizes given as NumPy integers (as code computing them often does): stored as plain JSON numbers."""
    import numpy as np

    width = np.int64(8)
    return [Conv2d(1, width, 3, 1, 1), ReLU(), GlobalAvgPool(), Linear(width, np.int32(10), init="zeros")]


def sleeps() -> list:
    """Never returns (a file stuck on something): rank 0 stops it after --model-timeout."""
    import time

    time.sleep(3600)
    return build()


def deaf() -> list:
    """Never returns and blocks the signals that would stop it: the workers give up on rank 0 and abort."""
    import signal
    import time

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGTERM, signal.SIGUSR1, signal.SIGINT})
    time.sleep(3600)
    return build()


def _start_thread() -> None:
    import threading
    import time

    threading.Thread(target=time.sleep, args=(3600,), name="users-thread").start()  # not a daemon


def with_thread() -> list:
    """Leaves a thread running that Python would wait for at exit: rank 0 must end regardless."""
    _start_thread()
    return build()


def thread_then_raises() -> list:
    """The same, then fails: the start-up error, and an exit."""
    _start_thread()
    raise RuntimeError("bad net")
