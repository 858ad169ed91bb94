"""Training modes, one module each: a `Mode` (`mpiasgd.modes.base`) with its checks, its layout of
the workers, its communicators, its rank-0 role and its worker loop.

    asgd.py      async: A-SGD through the parameter server (nsync, --overlap, --warm-start)
    ssp.py       ssp: the parameter server with a staleness bound
    sync.py      sync: workers allreduce; rank 0 logs
    pipeline/    pipeline: decoupled backpropagation, N replicas x K modules
    easgd.py     easgd: elastic averaging SGD with a center variable on rank 0

`registry.py` names them and declares the config keys each one owns; it imports none of them, so
the config and `--help` never start MPI.
"""
