"""`mpiasgd export`: a run's weights, from a snapshot of its run log or from its checkpoint, as the
NumPy .npz of `mpiasgd.model.export` (keyed by parameter name, with the network's definition).

    python -m mpiasgd export runs/c10.h5 -o c10.npz               # the run's last weight snapshot
    python -m mpiasgd export runs/c10.h5 --snapshot 3 -o s3.npz   # snapshot 3 (negative: from the end)
    python -m mpiasgd export runs/c10.h5 --checkpoint -o ck.npz   # the checkpoint runs/c10.ckpt.h5
"""

from __future__ import annotations

import errno
import os

from mpiasgd.checkpoint import checkpoint_path, load
from mpiasgd.model.export import export_npz, short
from mpiasgd.model.registry import build_model
from mpiasgd.model.spec import ModelSpecError, stored
from mpiasgd.runlog import open_run
from mpiasgd.runlog.reader import reading, require


def export_run(log: str, output: str, snapshot: int | None = None, checkpoint: bool = False) -> str:
    """Export the weights of the run log `log` to the .npz file `output` (`export_npz`); returns a one-line
    description of what was written.

    By default the last weight snapshot (/snapshots/params and, when the network has buffers,
    /snapshots/buffers); `snapshot` N picks snapshot N (negative: from the end); `checkpoint` takes the
    run's checkpoint file (`checkpoint.checkpoint_path(log)`, or `log` itself when it is a .ckpt.h5: params
    and buffers) instead. The network is the log's (or checkpoint's) `model_spec` attribute; older files
    without one name a built-in in their `model` attribute (`spec.stored`). Every error names the file read
    or written: FileNotFoundError, ValueError (not a run log, damaged, no snapshots, a snapshot out of range,
    weights that do not fit the network; `checkpoint.CheckpointError` for the checkpoint), ModelSpecError (a
    network definition that cannot be built), OSError as the readers do, and for `output` an OSError of one
    sentence naming it and what to do (`unwritable`).
    """
    if checkpoint and snapshot is not None:
        raise ValueError("export: give --snapshot or --checkpoint, not both")
    sources = [log] + ([] if log.endswith(".ckpt.h5") else [log[:-3] + ".ckpt.h5" if log.endswith(".h5") else ""])
    if os.path.isdir(output):
        raise ValueError(f"output '{output}' is a directory; give a file name (e.g. '{output}/net.npz')")
    for source in sources:
        if source and os.path.exists(source) and os.path.exists(output) and os.path.samefile(source, output):
            raise ValueError(f"output '{output}' is the run's own file '{source}'; choose another name")
    if checkpoint:
        ckpt = load(log if log.endswith(".ckpt.h5") else checkpoint_path(log))  # CheckpointError naming it
        source = f"checkpoint '{ckpt.path}'"
        spec = stored({"model_spec": ckpt.model_spec, "model": ckpt.model}, source)
        params, buffers, what = ckpt.params, ckpt.buffers, f"{source} (version {ckpt.version})"
    else:
        source = f"run log '{log}'"
        with open_run(log) as f, reading(log):  # FileNotFoundError / ValueError naming the file
            require(f, log, "snapshots/params")
            spec = stored(f.attrs, source)  # older logs: the built-in their `model` names
            count = f["snapshots/params"].shape[0]
            if count == 0:
                raise ValueError(f"{source} has no weight snapshots")
            index = count - 1 if snapshot is None else snapshot
            if not -count <= index < count:
                raise ValueError(f"{source} has {count} weight snapshots (0..{count - 1}, or -{count}..-1); "
                                 f"there is no snapshot {snapshot}")
            index %= count
            params = f["snapshots/params"][index]
            buffers = f["snapshots/buffers"][index] if "snapshots/buffers" in f else None
            what = f"snapshot {index} of {count} of {source}"
    try:
        build_model(spec, "numpy")  # layers are checked when built (an unknown type, a NaN argument); nothing allocated
    except ModelSpecError as e:
        raise ModelSpecError(f"{source}: its network definition: {e}") from None
    try:
        export_npz(output, spec, params, buffers)
    except ModelSpecError:
        raise
    except OSError as e:
        raise OSError(unwritable(output, e)) from None
    except ValueError as e:  # the lengths: `export_npz` refuses a target that is not a regular file as an OSError
        raise ValueError(f"{what} does not fit its network {short(spec['name'])}: {e}") from None
    return f"{what}, network {short(spec['name'])}: written to '{output}'"


def unwritable(output: str, error: OSError) -> str:
    """One sentence for `export_npz`'s OSError `error` on `output`: the file, why it cannot be written and what
    to do (no bare "[Errno N]")."""
    folder = os.path.dirname(output) or "."
    if error.errno == errno.EEXIST:  # export_npz: a target that is not a regular file (a device, a socket)
        return f"output '{output}' exists and is not a regular file; choose another -o (export replaces only a file)"
    if error.errno == errno.ENOENT and not os.path.isdir(folder):
        return f"output '{output}': its folder '{folder}' does not exist; create it or choose another -o"
    if error.errno == errno.ENOENT:  # the folder is there but takes no new file (/proc)
        return f"output '{output}': no file can be created in '{folder}'; choose another -o"
    if error.errno == errno.ENOTDIR:
        return f"output '{output}': '{folder}' is not a folder; choose another -o"
    remedy = "free some space or choose another -o" if error.errno in (errno.ENOSPC, errno.EDQUOT) else \
        "choose another -o"
    return f"output '{output}' cannot be written ({error.strerror or error}); {remedy}"
