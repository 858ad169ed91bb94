"""The CUDA backend of `mpiasgd.ops`: our kernels (kernels/*.cu) launched through CuPy, one file per job.

    constants.py  the constants shared with the .cu files (kernels/constants.cuh is generated from it)
    tiles.py      conv tiles: shapes, the -D options that select one, names
    runtime.py    kernel sources, NVRTC modules (cupy.RawModule), argument C types
    device.py     the device: launch limits, index, wave of blocks, the clock autotune times with
    planner.py    the Planner object: tile, split-K, tap tables and autotune plans of each conv pass
    backend.py    CupyBackend: the ops (the wrappers), built by mpiasgd.ops.get_backend("cupy")

Importing any of them needs neither cupy nor a GPU.
"""
