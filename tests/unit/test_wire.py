"""--wire fp16|bf16: the codecs against their stated error bounds and hand-worked bit patterns, the parameter
server and a worker through the fake communicator (a compressed push is the fp32 update of its rounded
values; error feedback loses nothing), the config's refusals, and the simulator's numerics and bytes.

Tolerance, stated once: |decode(encode(x)) - x| <= BOUND[wire] * |x| for normal values in range
(fp16 2^-11, bf16 2^-8), exact for values the format holds.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from kit.runs import B
from kit.server import P, make_server, push, reply, serve_one
from kit.worker import receive, reference_grad, send

from mpiasgd.comms.protocol import HEADER_BYTES, Message, ProtocolError, Tag, check_size, message_bytes
from mpiasgd.comms.wire import BOUND, ErrorFeedback, decode, encode, roundtrip, wire_dtype
from mpiasgd.config import Config, ConfigError
from mpiasgd.model import build_model
from mpiasgd.optim import SGD

WIRES16 = ("fp16", "bf16")
TINY = {"fp16": 2.0 ** -14, "bf16": 2.0 ** -126}   # smallest normal value
HUGE = {"fp16": 65504.0, "bf16": 3.3895314e38}      # largest finite value


def assert_within_bound(wire, x, got):
    """|got - x| <= BOUND * |x| for the normal in-range values of x; names the worst element otherwise."""
    normal = np.isfinite(x) & (np.abs(x) >= TINY[wire]) & (np.abs(x) <= HUGE[wire])
    err = np.abs(got[normal].astype(np.float64) - x[normal]) / np.abs(x[normal].astype(np.float64))
    worst = int(np.argmax(err))
    assert err[worst] <= BOUND[wire], (f"{wire}: x = {x[normal][worst]!r} decodes to {got[normal][worst]!r}, "
                                       f"relative error {err[worst]:.3g} > {BOUND[wire]:.3g}")


# --- the codecs -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("wire", WIRES16)
def test_round_trip_within_the_stated_bound_on_every_scale(wire):
    """Random float32 over the whole exponent range (tiny, huge, subnormal) and specials: normal in-range
    values within the bound, NaN stays NaN, inf stays inf, signs kept, beyond the range inf."""
    rng = np.random.default_rng(0)
    mags = np.exp2(rng.uniform(-149, 128, 200_000))  # every float32 exponent, subnormals included
    x = (mags * rng.choice([-1.0, 1.0], mags.size)).astype(np.float32)
    x = np.concatenate([x, rng.standard_normal(100_000).astype(np.float32),
                        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-45,
                                  np.float32(3.4028235e38), np.float32(-3.4028235e38)], np.float32)])
    got = roundtrip(wire, x)
    assert got.dtype == np.float32 and got.shape == x.shape
    assert_within_bound(wire, x, got)
    nan = np.isnan(x)
    assert np.isnan(got[nan]).all() and not np.isnan(got[~nan]).any()
    assert (got[np.isposinf(x)] == np.inf).all() and (got[np.isneginf(x)] == -np.inf).all()
    finite = ~nan
    assert (np.signbit(got[finite]) == np.signbit(x[finite])).all()
    over = np.isfinite(x) & (np.abs(x) > HUGE[wire] * (1 + BOUND[wire]))  # past the last rounding boundary
    assert over.any() and np.isinf(got[over]).all()
    if wire == "fp16":  # subnormal fp16: absolute error <= 2^-25
        sub = np.abs(x) < TINY["fp16"]
        assert (np.abs(got[sub].astype(np.float64) - x[sub]) <= 2.0 ** -25).all()


@pytest.mark.parametrize("wire", WIRES16)
def test_values_the_format_holds_round_trip_exactly(wire):
    x = np.array([0, 1, -2, 3, 255, -256, 0.5, 0.375, 2.0 ** -14, 2.0 ** -24, 1024, 65504 if wire == "fp16"
                  else 2.0 ** 100, -2.0 ** -20], np.float32)
    np.testing.assert_array_equal(roundtrip(wire, x), x)
    every = np.arange(2 ** 16, dtype=np.uint16)  # every 16-bit pattern that is a number: decode, encode, same bits
    values = decode(wire, every.view(wire_dtype(wire)), np.empty(every.size, np.float32))
    numbers = ~np.isnan(values)
    again = encode(wire, values, np.empty(every.size, wire_dtype(wire))).view(np.uint16)
    np.testing.assert_array_equal(again[numbers], every[numbers])


def test_bf16_rounds_to_nearest_even_on_hand_worked_bit_patterns():
    """float32 bits -> bf16 bits: below, at and above the tie, with an even and an odd kept half; a carry
    into the exponent; the largest finite rounding to inf; subnormals; NaNs quieted, never turned into inf."""
    cases = [  # (float32 bits, bf16 bits)
        (0x3F800000, 0x3F80),  # 1.0 exactly
        (0x3F807FFF, 0x3F80),  # below the tie: down
        (0x3F808000, 0x3F80),  # 1 + 2^-8, a tie, kept half 0x3F80 even: stays
        (0x3F818000, 0x3F82),  # 1 + 3 * 2^-8, a tie, kept half 0x3F81 odd: up to even
        (0x3F808001, 0x3F81),  # past the tie: up
        (0xBF818000, 0xBF82),  # the same for a negative number
        (0x3FFF8000, 0x4000),  # 1.99609375 (tie, 0x3FFF odd): carries into the exponent, 2.0
        (0x7F7F7FFF, 0x7F7F),  # just below the last tie: the largest bf16, 3.3895e38
        (0x7F7F8000, 0x7F80),  # the tie above the largest bf16 (0x7F7F odd): +inf
        (0x7F7FFFFF, 0x7F80),  # float32's largest: +inf
        (0x7F800000, 0x7F80),  # +inf
        (0xFF800000, 0xFF80),  # -inf
        (0x00018000, 0x0002),  # a float32 subnormal, tie, odd kept half: up
        (0x00008000, 0x0000),  # the smallest tie, even kept half (0): down to 0
        (0x80000000, 0x8000),  # -0
        (0x7FC00000, 0x7FC0),  # the quiet NaN
        (0x7F800001, 0x7FC0),  # a signalling NaN whose payload is all in the dropped half: NaN, not inf
        (0x7FFFFFFF, 0x7FFF),  # a NaN that the rounding formula would carry to -0
        (0xFFFFFFFF, 0xFFFF),  # a negative NaN that would wrap
    ]
    x = np.array([c[0] for c in cases], np.uint32).view(np.float32)
    got = encode("bf16", x, np.empty(x.size, np.uint16))
    assert [hex(v) for v in got.tolist()] == [hex(c[1]) for c in cases]
    back = decode("bf16", got, np.empty(x.size, np.float32))
    assert back.view(np.uint32).tolist() == [c[1] << 16 for c in cases]


def test_fp16_rounds_to_nearest_even_and_overflows_to_inf():
    ulp = 2.0 ** -10  # of fp16 at 1
    x = np.array([1 + ulp / 2, 1 + 3 * ulp / 2, 1 + ulp / 2 + 2.0 ** -20, 65504, 65519.99, 65520, -1e5],
                 np.float32)
    assert roundtrip("fp16", x).tolist() == [1.0, 1 + 2 * ulp, 1 + ulp, 65504, 65504, np.inf, -np.inf]


def test_the_codecs_check_their_arrays():
    x = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match=r"encode\(fp16\): out must be a 1-D C-contiguous float16 array of 4 "
                                         r"values, got uint16 shape \(4,\)"):
        encode("fp16", x, np.zeros(4, np.uint16))
    with pytest.raises(ValueError, match=r"values must be .*float32.*got float64"):
        encode("bf16", np.zeros(4), np.zeros(4, np.uint16))
    with pytest.raises(ValueError, match="not contiguous"):
        decode("bf16", np.zeros(8, np.uint16)[::2], x)
    with pytest.raises(ValueError, match=r"unknown wire format 'fp8': expected one of \('fp32', 'fp16', 'bf16'\)"):
        Message(4, "fp8")
    np.testing.assert_array_equal(encode("fp32", np.arange(4, dtype=np.float32), x), np.arange(4))


def test_the_cpu_path_never_imports_cupy():
    code = ("import sys, numpy as np\n"
            "from mpiasgd.comms.wire import ErrorFeedback, roundtrip\n"
            "x = np.linspace(-3, 3, 100, dtype=np.float32)\n"
            "roundtrip('fp16', x); roundtrip('bf16', x)\n"
            "ErrorFeedback('bf16', 100).encode(x, np.empty(100, np.uint16))\n"
            "print('cupy' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# --- messages ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("wire,size", [("fp32", 4), ("fp16", 2), ("bf16", 2)])
def test_message_size_follows_the_wire_format(wire, size):
    msg = Message(10, wire)
    assert msg.buf.nbytes == message_bytes(10, wire) == HEADER_BYTES + size * 10 and msg.count == 10
    assert int(msg.header["count"]) == 10 and msg.payload.dtype == wire_dtype(wire)
    check_size(Tag.PUSH, 1, 0, HEADER_BYTES + size * 10, 10, wire)


# --- the parameter server ---------------------------------------------------------------------------------

@pytest.mark.parametrize("wire", WIRES16)
def test_a_compressed_push_is_the_fp32_update_of_its_rounded_values(tmp_path, wire):
    """Momentum, weight decay and two workers with staleness: the server under --wire applies exactly the
    update an fp32 server applies to decode(encode(g)), and every reply is encode(the new weights)."""
    opts = dict(momentum=0.9, weight_decay=0.1, staleness_lr="inverse")
    comp, net16, _ = make_server(tmp_path / "c", wire=wire, **opts)
    ref, net32, _ = make_server(tmp_path / "r", **opts)
    rng = np.random.default_rng(1)
    for worker, step, base in [(1, 1, 0), (2, 1, 0), (1, 2, 1), (2, 2, 2)]:
        g = (rng.standard_normal(P) * 1e-2).astype(np.float32)
        push(net16, worker, step=step, version=base, grad=g, wire=wire)
        push(net32, worker, step=step, version=base, grad=roundtrip(wire, g))
        serve_one(comp)
        serve_one(ref)
        np.testing.assert_array_equal(comp.params, ref.params)
        tag, header, payload = reply(net16, worker, wire)
        assert tag == Tag.WEIGHTS and header["version"] == ref.version and header["count"] == P
        assert payload.dtype == wire_dtype(wire)
        np.testing.assert_array_equal(payload.view(np.uint16),
                                      encode(wire, ref.params, np.empty(P, wire_dtype(wire))).view(np.uint16))
    assert comp.params.dtype == np.float32 and not np.array_equal(comp.params, roundtrip(wire, comp.params))
    assert comp.wire_bytes == {"pushed": 4 * message_bytes(P, wire), "pulled": 4 * message_bytes(P, wire)}
    assert ref.wire_bytes == {"pushed": 4 * message_bytes(P), "pulled": 4 * message_bytes(P)}


def test_an_fp32_sized_push_under_fp16_is_a_protocol_error_naming_the_sizes(tmp_path):
    server, net, _ = make_server(tmp_path, wire="fp16")
    push(net, 1, step=1, version=0, grad=np.zeros(P, np.float32))  # fp32-sized
    with pytest.raises(ProtocolError, match=rf"^rank 0: PUSH message from rank 1 is {HEADER_BYTES + 4 * P} bytes, "
                                            rf"expected {HEADER_BYTES + 2 * P} \({HEADER_BYTES}-byte header \+ {P} "
                                            r"float16 values: --wire fp16\)$"):
        serve_one(server)


def test_a_gradient_beyond_fp16_range_arrives_as_inf_and_is_rejected(tmp_path):
    server, net, _ = make_server(tmp_path, wire="fp16")
    before = server.params.copy()
    push(net, 1, step=1, version=0, grad=np.array([1, 2, 7e4, 0, 0, 0], np.float32), wire="fp16")
    serve_one(server)
    assert server.rejected[1] == 1 and server.version == 0
    np.testing.assert_array_equal(server.params, before)
    tag, _, payload = reply(net, 1, "fp16")
    assert tag == Tag.WEIGHTS and payload.astype(np.float32).tolist() == before.tolist()
    push(net, 1, step=2, version=0, grad=np.array([1, 2, 6e4, 0, 0, 0], np.float32), wire="fp16")
    serve_one(server)
    assert server.version == 1  # just inside the range: applied


@pytest.mark.parametrize("wire", WIRES16)
def test_delay_compensation_uses_the_weights_the_worker_decoded(tmp_path, wire):
    """DC-ASGD under --wire: w_pulled is decode(encode(w)) of the worker's last reply, the weights it really
    computed on (hand computation in float64 over five pushes of two workers, as test_server's)."""
    lam = 2.0
    server, net, _ = make_server(tmp_path, num_workers=2, momentum=0.9, weight_decay=0.1, dc_lambda=lam, wire=wire)
    server.start_workers()
    w, v = server.params.astype(np.float64), np.zeros(P)
    pulled = {k: roundtrip(wire, server.params).astype(np.float64) for k in (1, 2)}
    rng = np.random.default_rng(4)
    for worker, step, base in [(1, 1, 0), (2, 1, 0), (1, 2, 1), (1, 3, 3), (2, 2, 2)]:
        g = roundtrip(wire, rng.standard_normal(P).astype(np.float32)).astype(np.float64)
        push(net, worker, step=step, version=base, grad=g.astype(np.float32), wire=wire)
        serve_one(server)
        v = 0.9 * v + g + lam * g * g * (w - pulled[worker]) + 0.1 * w
        w = w - 0.5 * v
        np.testing.assert_allclose(server.params, w, rtol=1e-5, atol=1e-5)
        _, _, payload = reply(net, worker, wire)
        pulled[worker] = decode(wire, payload, np.empty(P, np.float32)).astype(np.float64)
        assert not np.array_equal(pulled[worker], server.params)  # the rounding is not nothing


# --- a worker, error feedback ---------------------------------------------------------------------------

def scripted_worker(digits, wire, feedback):
    """Worker rank 1 of 2 (kit.worker's set-up) in a thread, through its default staging for `wire`: WEIGHTS p0,
    then p1, then STOP. Returns (the worker, its two pushes decoded, p0, p1, its shard sampler)."""
    import threading

    from kit.fakempi import Network

    from mpiasgd.data import ShardSampler
    from mpiasgd.modes.asgd import AsgdWorker
    from mpiasgd.modes.base import WorkerJob

    cfg = Config(batch_size=B, comm_timeout=5.0, seed=3, wire=wire, wire_error_feedback=feedback).validate()
    net, model = Network(3), build_model("digits")
    sampler = ShardSampler(digits.train_y.size, 2, 0, cfg.seed)
    worker = AsgdWorker(WorkerJob(net.comm(1), cfg, model, digits, sampler, 1, np.arange(20, dtype=np.int64)))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    p0 = model.init_params(0)
    p1 = p0 * np.float32(0.99)
    pushes = []
    for version, (tag, weights) in enumerate([(Tag.WEIGHTS, p0), (Tag.WEIGHTS, p1), (Tag.STOP, p1)]):
        send(net, tag, weights, version=version, step=version, wire=wire)
        if tag == Tag.WEIGHTS:
            msg = receive(net, Tag.PUSH, model.num_params, wire=wire)
            pushes.append(decode(wire, msg.payload, np.empty(model.num_params, np.float32)))
    receive(net, Tag.EVAL, 0)
    thread.join(5)
    assert not thread.is_alive()
    return worker, pushes, p0, p1, sampler


@pytest.mark.parametrize("wire", WIRES16)
def test_error_feedback_loses_nothing_over_two_pushes(digits, wire):
    """A worker with --wire-error-feedback: after two pushes, the sum of the decoded pushes plus the residual
    it keeps equals the sum of the true gradients (computed here on the decoded weights it received) to
    float32 rounding; its pushes are encode(g + e). Without it the pushes are encode(g)."""
    worker, plain, p0, p1, sampler = scripted_worker(digits, wire, feedback=False)
    assert worker.staging.feedback is None and worker.staging.params is not worker.staging.weights.payload
    worker, ef, _, _, _ = scripted_worker(digits, wire, feedback=True)
    order = sampler.indices(0)
    g1, _ = reference_grad(roundtrip(wire, p0), digits, order[:B])
    g2, _ = reference_grad(roundtrip(wire, p1), digits, order[B:2 * B])
    np.testing.assert_array_equal(plain[0], roundtrip(wire, g1))
    np.testing.assert_array_equal(plain[1], roundtrip(wire, g2))
    residual = worker.staging.feedback.residual
    total = ef[0].astype(np.float64) + ef[1] + residual
    np.testing.assert_allclose(total, g1.astype(np.float64) + g2, rtol=0,
                               atol=np.finfo(np.float32).eps * (np.abs(g1) + np.abs(g2)).max())
    np.testing.assert_array_equal(ef[0], roundtrip(wire, g1))  # e_1 = 0
    np.testing.assert_array_equal(ef[1], roundtrip(wire, g2 + (g1 - ef[0])))
    assert np.abs(residual).max() > 0 and not np.array_equal(ef[1], plain[1])


@pytest.mark.parametrize("wire", WIRES16)
def test_error_feedback_residual_sums_exactly(wire):
    """ErrorFeedback itself: over 20 pushes sum decode + residual = sum g (to float32 rounding of g + e); the
    values after `size` (layer buffers) are encoded plainly; an overflow is sent as inf and not carried on."""
    rng = np.random.default_rng(7)
    fb = ErrorFeedback(wire, 50)
    total, sent = np.zeros(50), np.zeros(50)
    out = np.empty(60, wire_dtype(wire))
    for _ in range(20):
        g = (rng.standard_normal(60) * 1e-3).astype(np.float32)
        fb.encode(g, out)
        dec = decode(wire, out, np.empty(60, np.float32))
        np.testing.assert_array_equal(dec[50:], roundtrip(wire, g[50:]))
        total += g[:50]
        sent += dec[:50]
    np.testing.assert_allclose(sent + fb.residual, total, rtol=0, atol=1e-9)
    assert fb.residual.dtype == np.float32 and np.abs(fb.residual).max() > 0
    if wire == "fp16":
        g = np.full(60, 1e5, np.float32)
        fb.encode(g, out)
        assert np.isinf(out[:50].astype(np.float32)).all() and (fb.residual == 0).all()
    with pytest.raises(ValueError, match="error feedback needs a 16-bit wire format"):
        ErrorFeedback("fp32", 10)


# --- config ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("values,says", [
    ({"wire": "fp8"}, r"config key 'wire' = 'fp8': expected one of \('fp32', 'fp16', 'bf16'\)"),
    ({"wire_error_feedback": True}, "config key 'wire_error_feedback' = True: expected False with --wire fp32"),
    ({"mode": "easgd", "wire": "fp16"}, r"config key 'wire' = 'fp16': expected 'fp32' in mode 'easgd' \('wire' "
                                        "applies to the async and ssp modes\\)"),
    ({"mode": "sync", "wire": "bf16"}, "config key 'wire' = 'bf16': expected 'fp32' in mode 'sync'"),
])
def test_config_refuses_what_the_wire_does_not_do(values, says):
    with pytest.raises(ConfigError, match=says):
        Config(**values).validate()


def test_config_takes_the_wire_in_async_and_ssp():
    assert Config().wire == "fp32" and Config().wire_error_feedback is False
    for mode in ("async", "ssp"):
        cfg = Config(mode=mode, wire="bf16", wire_error_feedback=True).validate()
        assert (cfg.wire, cfg.wire_error_feedback) == ("bf16", True)


# --- the simulator --------------------------------------------------------------------------------------

def test_a_simulated_fp16_run_has_a_real_runs_numerics_and_bytes(tmp_path):
    """One worker, fp16 wire, 0.25 s links: the final weights are serial SGD where the worker computes on
    decode(encode(w)) and the server applies decode(encode(g)); every wait is the transfer of fp16-sized
    messages; the summary counts their bytes."""
    from kit.runs import read_log

    from mpiasgd.data import MinibatchStream, ShardSampler
    from mpiasgd.data.loader import open_data
    from mpiasgd.sim.cli import main

    steps, bandwidth = 5, 1e4
    argv = ["--workers", "1", "--model", "digits", "--batch-size", str(B), "--no-progress", "--run-dir",
            str(tmp_path), "--name", "w16", "--flush-interval", "60", "--compute-s", "1.0", "--bandwidth",
            str(bandwidth), "--max-pushes", str(steps), "--epochs", "0", "--lr-schedule", "constant",
            "--warmup-epochs", "0", "--lr", "0.05", "--wire", "fp16",
            "--backend", "numpy"]  # the reference below computes on numpy (auto: cpu, other summation orders)
    assert main(argv) == 0
    attrs, t, snapshots = read_log(tmp_path / "w16.h5")
    digits = open_data("digits")
    model = build_model("digits")
    nbytes = message_bytes(model.num_params + model.num_buffers, "fp16")
    w, g = model.init_params(0), np.zeros(model.num_params, np.float32)
    sgd = SGD(w, model.decay_mult(), 0.9, 5e-4, lr_scale=model.lr_mult())
    stream = MinibatchStream(digits, ShardSampler(digits.num_train, 1, 0, 0, digits.chunk, 16), B, 0, 1)
    for _ in range(steps):
        model.bind(roundtrip("fp16", w), g)
        x, y, _ = stream.next()
        model.forward_backward(x, y, minibatch=stream.cursor)
        w = sgd.step(roundtrip("fp16", g), 0.05)
    np.testing.assert_array_equal(snapshots[-1], w)
    transfer = nbytes / bandwidth
    np.testing.assert_allclose(t["pushes"]["wait_s"], [transfer] + [2 * transfer] * (steps - 1), rtol=1e-6)
    assert attrs["wire_bytes_pushed"] == steps * nbytes and attrs["wire_bytes_pulled"] == (steps + 1) * nbytes


@pytest.mark.parametrize("scale", [1.0, 1e-4, 1e-6])
def test_numpy_fp16_equals_the_cast_bit_for_bit_where_it_avoids_it(scale):
    """The numpy fp16 path computes fp16's subnormal range (|x| < 2^-14) itself, with few (scale 1) or many
    (1e-6) values there: every float32 bit pattern class (all exponents, both signs, specials, ties) and
    gradients of the given scale encode to the bits numpy's cast gives, and every fp16 pattern decodes to
    the float32 the cast gives."""
    rng = np.random.default_rng(13)
    n = 200_000
    patterns = ((rng.integers(0, 2, n).astype(np.uint32) << 31) | (rng.integers(0, 256, n).astype(np.uint32) << 23)
                | rng.integers(0, 2**23, n).astype(np.uint32)).view(np.float32)
    ties = np.array([2**-24, 2**-25, 3 * 2**-26, -3 * 2**-26, 5 * 2**-26, 2**-14 * (1 - 2**-12), 0.0, -0.0, np.inf,
                     -np.inf, 65504, 65519.99, 65520], np.float32)
    x = np.concatenate([patterns, ties, (rng.standard_normal(3 * n) * scale).astype(np.float32)])
    with np.errstate(over="ignore"):
        cast = x.astype(np.float16)
    got = encode("fp16", x, np.empty(x.size, np.float16))
    real = ~np.isnan(x)
    np.testing.assert_array_equal(got.view(np.uint16)[real], cast.view(np.uint16)[real])
    assert np.isnan(got[~real]).all()
    codes = np.concatenate([np.arange(65536, dtype=np.uint16), cast.view(np.uint16)]).view(np.float16)
    back = decode("fp16", codes, np.empty(codes.size, np.float32))
    want = codes.astype(np.float32)
    real = ~np.isnan(want)
    np.testing.assert_array_equal(back.view(np.uint32)[real], want.view(np.uint32)[real])
    assert np.isnan(back[~real]).all()


def test_the_device_paths_nan_rewrite_gives_numpys_fp16_nan_bits():
    """CUDA's float-to-half cast writes 0x7FFF for every NaN, numpy keeps the sign and the payload's upper bits
    (0x7C01 where they are 0). The rewrite the cupy path applies after its cast (`_fp16_nan_payloads`), run
    here on numpy over a cast whose NaNs were overwritten as CUDA writes them, gives numpy's bits for every
    NaN pattern below and leaves every other value alone."""
    from mpiasgd.comms.wire import _fp16_nan_payloads

    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA00000,
                     0x7F802000, 0x7F801FFF, 0xFF812345], np.uint32).view(np.float32)
    rng = np.random.default_rng(0)
    values = np.concatenate([nans, rng.standard_normal(1000, dtype=np.float32),
                             np.array([np.inf, -np.inf, 0.0, -0.0], np.float32)])  # float32 all along: no payload lost
    want = values.astype(np.float16).view(np.uint16)
    cuda_like = want.copy()
    cuda_like[np.isnan(values)] = 0x7FFF
    out = cuda_like.view(np.float16)
    _fp16_nan_payloads(np, values, out)
    np.testing.assert_array_equal(out.view(np.uint16), want)
    assert [hex(b) for b in want[:4]] == ["0x7e00", "0xfe00", "0x7c01", "0xfc01"]  # the rule's cases by hand


def test_the_device_paths_nan_rewrite_gives_numpys_decoded_nan_bits():
    """The decoding side: CUDA's half-to-float cast writes 0x7FFFFFFF for every NaN, numpy keeps the sign and
    payload. `_fp16_decode_nan_payloads`, run on numpy over a decode whose NaNs were overwritten as CUDA
    writes them, gives numpy's bits for every fp16 NaN pattern and leaves every other value alone."""
    from mpiasgd.comms.wire import _fp16_decode_nan_payloads

    data = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)  # every fp16 pattern
    want = data.astype(np.float32).view(np.uint32)
    cuda_like = want.copy()
    cuda_like[np.isnan(data)] = 0x7FFFFFFF
    out = cuda_like.view(np.float32)
    _fp16_decode_nan_payloads(np, data, out)
    np.testing.assert_array_equal(out.view(np.uint32), want)
    assert hex(want[0x7E00]) == "0x7fc00000" and hex(want[0xFC01]) == "0xff802000"  # by hand


# --- the compiled fp16 codec of the numpy path (wire_kernels) ----------------------------------------------

FP16_FINITE = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)  # 0 .. 65504, ascending


def nearest_fp16_bits(x):
    """binary16 bits of float32 `x` (no NaN) rounded to nearest, ties to the even pattern, worked out from the
    table of every finite fp16 value (not a cast): the two neighbours lo <= |x| < hi and their midpoint (exact
    in float64); past 65504 the upper neighbour is 65536, i.e. inf (0x7C00)."""
    ax = np.abs(x.astype(np.float64))
    table = np.append(FP16_FINITE, 65536.0)
    lo = np.clip(np.searchsorted(table, ax, side="right") - 1, 0, 0x7BFF)
    hi = lo + 1
    mid = (table[lo] + table[hi]) / 2
    up = (ax > mid) | ((ax == mid) & (hi % 2 == 0))
    bits = np.where(ax >= 65536.0, 0x7C00, np.where(up, hi, lo)).astype(np.uint16)
    return bits | np.where(np.signbit(x), np.uint16(0x8000), np.uint16(0))


def fp16_nan_bits(u):
    """numpy's fp16 NaN for float32 NaN bits `u` (uint32): sign | 0x7C00 | ((u >> 13) & 0x3FF), at least 0x7C01."""
    return (((u >> 16) & 0x8000) | 0x7C00 | np.maximum((u >> 13) & 0x3FF, 1)).astype(np.uint16)


def encode16(x):
    return encode("fp16", x, np.empty(x.size, np.float16)).view(np.uint16)


def cast16(x):
    with np.errstate(over="ignore"):
        return x.astype(np.float16).view(np.uint16)


def test_fp16_encode_equals_numpys_cast_on_every_exponent_mantissas_and_signs():
    """Every float32 exponent (0..255: zeros, float32 subnormals, fp16 subnormals, normals, overflow, inf and NaN)
    x 4,096 random mantissas and the mantissas around fp16's rounding bits x both signs: the compiled encode's
    bits equal numpy's cast's, NaNs included; the numbers equal the nearest fp16 worked out from the table, the
    NaNs numpy's payload rule."""
    rng = np.random.default_rng(21)
    edges = np.array([0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x3000, 0x7FE000, 0x7FEFFF, 0x7FF000, 0x7FFFFF],
                     np.uint32)
    mantissas = np.concatenate([rng.integers(0, 1 << 23, 4096, dtype=np.uint32), edges])
    exponents = np.arange(256, dtype=np.uint32)
    u = ((exponents[:, None] << 23) | mantissas[None, :]).ravel()
    u = np.concatenate([u, u | np.uint32(0x80000000)])
    x = u.view(np.float32)
    got = encode16(x)
    np.testing.assert_array_equal(got, cast16(x))
    nan = np.isnan(x)
    assert nan.sum() == 2 * (mantissas != 0).sum()  # exponent 255 with a non-zero mantissa, both signs
    np.testing.assert_array_equal(got[~nan], nearest_fp16_bits(x[~nan]))
    np.testing.assert_array_equal(got[nan], fp16_nan_bits(u[nan]))
    # a few by hand: 1, -2, 2^-24 (the smallest subnormal), 2^-14 (the smallest normal), 65504, 2^-149 -> +0
    hand = np.array([1.0, -2.0, 2.0 ** -24, 2.0 ** -14, 65504.0, 2.0 ** -149], np.float32)
    assert [hex(b) for b in encode16(hand)] == ["0x3c00", "0xc000", "0x1", "0x400", "0x7bff", "0x0"]


def test_fp16_encode_rounds_every_halfway_case_to_even():
    """For every pair of neighbouring fp16 values lo < hi (lo = 0 .. 65504; hi = 65536 stands for inf): their
    midpoint goes to the even pattern, one float32 ulp below it to lo, one above to hi, both signs. This covers
    each fp16 exponent, 0 / the smallest subnormal (2^-25 -> 0), the subnormal / normal boundary (2^-14 - 2^-25
    -> 0x0400) and the overflow boundary (65520 -> inf, 65520 - ulp -> 65504)."""
    lo = np.arange(0x7C00, dtype=np.uint32)
    values = np.append(FP16_FINITE, 65536.0)
    mid = ((values[:-1] + values[1:]) / 2).astype(np.float32)
    assert ((mid.astype(np.float64) * 2) == values[:-1] + values[1:]).all()  # every midpoint exact in float32
    below = np.nextafter(mid, np.float32(0))
    above = np.nextafter(mid, np.float32(np.inf))
    even = np.where(lo % 2 == 0, lo, lo + 1)
    for sign in (1, -1):
        for x, want in ((mid, even), (below, lo), (above, lo + 1)):
            signed = (sign * x).astype(np.float32)
            want16 = want.astype(np.uint16) | np.uint16(0x8000 if sign < 0 else 0)
            got = encode16(signed)
            np.testing.assert_array_equal(got, want16)
            np.testing.assert_array_equal(got, cast16(signed))
    edge = np.array([2.0 ** -25, 2.0 ** -14 - 2.0 ** -25, 65520.0, np.nextafter(np.float32(65520), np.float32(0)),
                     -65520.0, 3 * 2.0 ** -25], np.float32)
    assert [hex(b) for b in encode16(edge)] == ["0x0", "0x400", "0x7c00", "0x7bff", "0xfc00", "0x2"]


def test_fp16_encode_keeps_every_nan_payload_class_as_numpy_does():
    """Every value of a float32 NaN's upper 10 payload bits (the ones fp16 keeps, quiet bit 0x200 included) x
    lower 13 bits 0, 1, 0x1000, 0x1FFF x both signs: sign | 0x7C00 | upper bits, 0x7C01 where those are 0 (a
    NaN stays a NaN); equal to numpy's cast. +-inf stays +-inf."""
    upper = np.arange(1024, dtype=np.uint32) << 13
    lower = np.array([0, 1, 0x1000, 0x1FFF], np.uint32)
    u = (np.uint32(0x7F800000) | upper[:, None] | lower[None, :]).ravel()
    u = u[u != 0x7F800000]  # that is inf
    u = np.concatenate([u, u | np.uint32(0x80000000)])
    got = encode16(u.view(np.float32))
    np.testing.assert_array_equal(got, fp16_nan_bits(u))
    np.testing.assert_array_equal(got, cast16(u.view(np.float32)))
    assert ((got & 0x7C00) == 0x7C00).all() and ((got & 0x3FF) != 0).all()
    hand = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF801FFF, 0x7FFFFFFF, 0x7FA00000, 0x7F800000,
                     0xFF800000], np.uint32)
    assert [hex(b) for b in encode16(hand.view(np.float32))] == ["0x7e00", "0xfe00", "0x7c01", "0xfc01", "0x7fff",
                                                                  "0x7d00", "0x7c00", "0xfc00"]


def test_fp16_decode_of_all_65536_patterns_is_numpys_cast_and_the_exact_value():
    """Every binary16 pattern decodes to the float32 numpy's cast gives, bit for bit (NaN payloads included), and
    that is its value worked out from sign, exponent and mantissa: m 2^-24 (subnormal), 2^(e-15) (1 + m/1024),
    +-inf, and for NaN sign << 16 | 0x7F800000 | m << 13."""
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = decode("fp16", h.view(np.float16), np.empty(h.size, np.float32))
    np.testing.assert_array_equal(got.view(np.uint32), h.view(np.float16).astype(np.float32).view(np.uint32))
    s, e, m = h >> 15, (h >> 10) & 0x1F, (h & 0x3FF).astype(np.float64)
    magnitude = np.where(e == 0, m * 2.0 ** -24, np.exp2(e.astype(np.float64) - 15) * (1 + m / 1024))
    magnitude = np.where(e == 31, np.inf, magnitude)
    want = np.where(s == 1, -magnitude, magnitude).astype(np.float32)
    number = (e != 31) | (m == 0)
    np.testing.assert_array_equal(got.view(np.uint32)[number], want.view(np.uint32)[number])
    hu = h.astype(np.uint32)
    nan_bits = ((hu & 0x8000) << 16) | 0x7F800000 | ((hu & 0x3FF) << 13)
    np.testing.assert_array_equal(got.view(np.uint32)[~number], nan_bits[~number])
    assert (~number).sum() == 2046
    assert got[0x0001] == 2.0 ** -24 and got[0x03FF] == 1023 * 2.0 ** -24 and got[0x3C00] == 1.0
    assert got[0x7BFF] == 65504.0 and got[0xFC00] == -np.inf and np.signbit(got[0x8000]) and got[0x8000] == 0


def test_fp16_codec_on_empty_and_one_value_arrays():
    out = np.empty(0, np.float16)
    assert encode("fp16", np.empty(0, np.float32), out) is out
    back = np.empty(0, np.float32)
    assert decode("fp16", out, back) is back and back.size == 0
    for x, bits, value in ((1e-6, 0x0011, 17 * 2.0 ** -24), (-65520.0, 0xFC00, -np.inf), (65519.99, 0x7BFF, 65504.0),
                           (-0.0, 0x8000, -0.0), (0.333333, 0x3555, 0.333251953125)):
        one = encode("fp16", np.array([x], np.float32), np.empty(1, np.float16))
        assert one.view(np.uint16).tolist() == [bits], x
        got = decode("fp16", one, np.empty(1, np.float32))
        assert got.tolist() == [value] and np.signbit(got[0]) == np.signbit(value), x


def test_fp16_codec_refuses_wrong_dtypes_shapes_and_layouts_and_writes_nothing():
    """The numpy fp16 path keeps the checks every path makes, with the same messages, before it writes."""
    x = np.arange(8, dtype=np.float32)
    out = np.full(4, 7, np.float16)
    cases = [
        (lambda: encode("fp16", x[::2], out), r"encode\(fp16\): values must be .*float32.*\(not contiguous\)"),
        (lambda: encode("fp16", x[:4].astype(np.float64), out), r"values must be .*float32 array of 4 values, "
                                                                r"got float64 shape \(4,\)"),
        (lambda: encode("fp16", x[:4], out.view(np.uint16)), r"encode\(fp16\): out must be a 1-D C-contiguous "
                                                             r"float16 array of 4 values, got uint16"),
        (lambda: encode("fp16", x[:4].reshape(2, 2), out), r"values must be .* got float32 shape \(2, 2\)"),
        (lambda: encode("fp16", x[:4], np.full(8, 7, np.float16)[::2]), r"out must be .*\(not contiguous\)"),
        (lambda: encode("fp16", x[:4], np.full(5, 7, np.float16)), r"out must be .*of 4 values, got float16 "
                                                                   r"shape \(5,\)"),
        (lambda: decode("fp16", out.view(np.uint16), x[:4]), r"decode\(fp16\): data must be a 1-D C-contiguous "
                                                             r"float16 array of 4 values, got uint16 shape \(4,\)"),
        (lambda: decode("fp16", out, x[:4].astype(np.float64)), r"decode\(fp16\): out must be .*float32.*got "
                                                                r"float64"),
        (lambda: decode("fp16", np.full(8, 7, np.float16)[::2], x[:4]), r"data must be .*\(not contiguous\)"),
        (lambda: decode("fp16", out, x[::2]), r"decode\(fp16\): out must be .*\(not contiguous\)"),
    ]
    for call, says in cases:
        with pytest.raises(ValueError, match=says):
            call()
    assert out.tolist() == [7.0] * 4 and x.tolist() == list(range(8))


def test_the_numpy_reference_path_equals_the_compiled_codec():
    """`_fp16_numpy` and `_fp16_decode_numpy` (the numpy path before the compiled codec, which bench/server.py
    --sweep times against it) give the same bits on random float32 patterns and gradients of about 1e-6."""
    from mpiasgd.comms.wire import _fp16_decode_numpy, _fp16_numpy

    rng = np.random.default_rng(5)
    x = np.concatenate([rng.integers(0, 1 << 32, 100_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
                        rng.standard_normal(100_000).astype(np.float32) * np.float32(1e-6)])
    old = np.empty(x.size, np.float16)
    with np.errstate(over="ignore"):
        _fp16_numpy(np, x, old)
    new = encode16(x)
    np.testing.assert_array_equal(new, old.view(np.uint16))
    back_old = np.empty(x.size, np.float32)
    _fp16_decode_numpy(old, back_old)
    back_new = decode("fp16", old, np.empty(x.size, np.float32))
    np.testing.assert_array_equal(back_new.view(np.uint32), back_old.view(np.uint32))
    assert (np.abs(back_new[100_000:]) < 2.0 ** -14).mean() > 0.9  # the gradients: mostly fp16 subnormals


def test_wire_warm_up_loads_the_fp16_codec_only_for_fp16():
    """`wire.warm_up`: fp32 and bf16 import no numba; fp16 loads the compiled codec."""
    code = ("import sys\n"
            "from mpiasgd.comms import wire\n"
            "wire.warm_up('fp32'); wire.warm_up('bf16')\n"
            "print('numba' in sys.modules)\n"
            "wire.warm_up('fp16')\n"
            "from mpiasgd.comms import wire_kernels\n"
            "print(len(wire_kernels.fp16_encode.signatures), len(wire_kernels.fp16_decode.signatures))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "1", "1"]


def test_the_fp16_server_warms_up_the_codec_its_pushes_and_replies_run(tmp_path):
    """After the server's warm-up (`AsgdServer.warm_up`, before its clocks), decoding a push and encoding its reply
    add no machine code to the compiled codec: the warm-up loaded the versions they use."""
    from mpiasgd.comms import wire_kernels

    server, net, _ = make_server(tmp_path, wire="fp16")
    server.warm_up()
    loaded = len(wire_kernels.fp16_encode.signatures), len(wire_kernels.fp16_decode.signatures)
    assert loaded[0] >= 1 and loaded[1] >= 1
    g = np.array([1e-6, -2e-7, 0.5, -3.0, 0, 1e-9], np.float32)
    before = server.params.copy()
    push(net, 1, step=1, version=0, grad=g, wire="fp16")
    serve_one(server)
    assert server.version == 1
    np.testing.assert_array_equal(server.params, before - np.float32(0.5) * roundtrip("fp16", g))
    tag, _, payload = reply(net, 1, "fp16")
    assert tag == Tag.WEIGHTS
    np.testing.assert_array_equal(payload.view(np.uint16), cast16(server.params))
    assert (len(wire_kernels.fp16_encode.signatures), len(wire_kernels.fp16_decode.signatures)) == loaded
