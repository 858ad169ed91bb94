"""Helpers shared by the test tiers (importable as `kit.*`: tests/ is on sys.path, see tests/conftest.py).

    launch      the mpiexec harness: start/run a job in its own session under a timeout, kill it whole
    runs        FAST (the flags of a short digits run), B (its minibatch), read_log, wait_for_pushes
    fakempi     an in-process stand-in for mpi4py's communicator (Network, Group, rank0)
    server      rank 0 driven in-process: make_server, push, serve_one, reply
    worker      a worker driven in-process: start_worker, send, receive, reference_grad, worker_pair
    pipeline    reference_two_modules: a 2-module pipeline's weights computed by hand
    cifar       CIFAR-10 batches in both official layouts, write_tiny_cifar
    checkpoints make_ckpt: a checkpoint with known fields
    grads       assert_close, numeric_grad, check_model_gradient: gradients against finite differences
    threads     Loop, start, join, run_threads: in-process loops in threads, joined under a timeout

No test module imports another test module; what two of them share lives here (fixtures: tests/conftest.py).
"""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
