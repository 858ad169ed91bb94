"""`mpiasgd simulate`: the asynchronous protocol (modes async and ssp) with N virtual workers in one
process, without MPI, on a virtual clock (GPU A-SGD, Paine et al. 2013, arXiv 1312.6186: how the number
of clients, nsync, stragglers and the warm start change training, at cluster sizes one machine cannot run).

    timing   TimingModel: compute seconds per minibatch (ComputeDraws: a worker's, one after another),
             latency, bandwidth, server time; JSON profiles, fitted from a run log
    comm     the transport: sends copied when posted, delivered by the engine at their virtual time
    engine   Simulation: the event loop, the virtual workers (real gradients), the real rank-0 role
    run      simulate(): start-up as `train`'s, the run log, the summary
    cli      the `mpiasgd simulate` flags
"""

from mpiasgd.sim.timing import (
    ComputeDraws,
    ComputeTime,
    ProfileError,
    TimingModel,
    fit_run_log,
    load_profile,
    save_profile,
)

__all__ = ["ComputeDraws", "ComputeTime", "ProfileError", "TimingModel", "fit_run_log", "load_profile",
           "save_profile"]
