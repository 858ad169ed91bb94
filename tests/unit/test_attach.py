"""(--attach) Rank 0's listener for `mpiasgd attach` over a real TCP socket on this host, with rank 0's loop and
its Respawner stood in for: the attach file (private, removed at the end), a request that brings back the lost
ranks, and each refusal (wrong token, another network or dataset, nothing lost, bad or oversize or slow requests),
logged while the run goes on. End to end with MPI_Comm_spawn: tests/mpi/test_elastic.py."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import threading
import time
from types import SimpleNamespace

import pytest

from mpiasgd.rank0 import attach as attach_module
from mpiasgd.rank0.attach import REQUEST_BYTES, Attacher, attach_path, identity, request

GOOD = identity('{"layers": []}', "digits", "")


def loop(lost: list[int], spawn_ok: bool = True) -> SimpleNamespace:
    """Rank 0's loop as the Attacher sees it: its events, the workers lost, the spawns asked for."""
    r0 = SimpleNamespace(events=[], spawned=[], preempted="", workers=[1, 2, 3],
                         role=SimpleNamespace(lost_order=list(lost)))
    r0.rec = SimpleNamespace(stop_reason="", event=lambda kind, text: r0.events.append((kind, text)))

    def spawn(w, host="", origin=""):
        r0.spawned.append((w, host, origin))
        return spawn_ok

    r0.respawner = SimpleNamespace(pending={}, spawn=spawn, last_failure="" if spawn_ok else
                                   "MPI_Comm_spawn of a replacement for worker rank 2 failed: MPI_ERR_UNKNOWN")
    return r0


@pytest.fixture
def listening(tmp_path):
    """An Attacher for run log tmp/run.h5 and the loop it serves (lost rank 2), closed at the end."""
    made = []

    def make(lost=(2,), spawn_ok=True):
        r0 = loop(list(lost), spawn_ok)
        att = Attacher(r0, str(tmp_path / "run.h5"), GOOD)
        made.append(att)
        return r0, att

    yield make
    for att in made:
        att.close()


def ask(att: Attacher, line: bytes, close: bool = False) -> dict:
    """Send `line` to the listener, tick it until it answers, and return the reply (JSON)."""
    with socket.create_connection(("127.0.0.1", att.port), timeout=10) as sock:
        sock.sendall(line)
        if close:
            sock.shutdown(socket.SHUT_WR)
        sock.settimeout(0.05)
        data = b""
        deadline = time.monotonic() + 10
        while b"\n" not in data and time.monotonic() < deadline:
            att.tick()
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                continue
            if not chunk:
                break
            data += chunk
    return json.loads(data.split(b"\n")[0])


@contextlib.contextmanager
def serving(att: Attacher):
    """Rank 0's loop ticking the listener in a thread while the body runs (the client blocks for the reply)."""
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            att.tick()
            time.sleep(0.005)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def line(token: str, **over) -> bytes:
    return (json.dumps({"token": token, **GOOD, "host": "", "count": 0, **over}) + "\n").encode()


def test_the_attach_file_is_private_and_removed_at_the_end(listening, tmp_path):
    _r0, att = listening()
    path = tmp_path / "run.attach"
    assert attach_path(str(tmp_path / "run.h5")) == str(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    spec = json.loads(path.read_text())
    assert spec["port"] == att.port and spec["host"] == socket.gethostname() and len(spec["token"]) == 32
    assert spec["run"] == str(tmp_path / "run.h5")
    att.close()
    assert not path.exists()


def test_a_crash_left_file_is_made_private_again(tmp_path):
    stale = tmp_path / "run.attach"
    stale.write_text("old")
    os.chmod(stale, 0o644)
    att = Attacher(loop([2]), str(tmp_path / "run.h5"), GOOD)
    try:
        assert stat.S_IMODE(os.stat(stale).st_mode) == 0o600 and json.loads(stale.read_text())["port"] == att.port
    finally:
        att.close()


def test_a_good_request_starts_a_worker_for_each_lost_rank(listening):
    r0, att = listening(lost=(3, 1))
    reply = ask(att, line(att.token, host="node7"))
    assert reply["ok"] is True and reply["ranks"] == [3, 1]
    assert [(w, host) for w, host, _ in r0.spawned] == [(3, "node7"), (1, "node7")]
    assert r0.spawned[0][2].startswith("an attach from 127.0.0.1:")
    assert [kind for kind, _ in r0.events] == ["attach"] and "worker ranks 3, 1 on node7" in r0.events[0][1]


def test_count_limits_the_ranks_started(listening):
    r0, att = listening(lost=(3, 1))
    assert ask(att, line(att.token, count=1))["ranks"] == [3]
    assert [w for w, _, _ in r0.spawned] == [3]


def test_a_rank_whose_replacement_is_starting_is_not_started_again(listening):
    r0, att = listening(lost=(2,))
    r0.respawner.pending[2] = object()
    reply = ask(att, line(att.token))
    assert reply["ok"] is False and "no worker rank is lost" in reply["error"] and r0.spawned == []


@pytest.mark.parametrize("request_line,said", [
    (lambda tok: line("0" * 32), "a wrong token"),
    (lambda tok: (json.dumps({**GOOD}) + "\n").encode(), "a wrong token"),
    (lambda tok: line(tok, network=identity('{"layers": [1]}', "digits", "")["network"]),
     "another network definition"),
    (lambda tok: line(tok, dataset="cifar10:"), "another dataset ('cifar10'; the job's is 'digits')"),
    (lambda tok: line(tok, dataset='f.h5:{"c": 1}'), """another dataset ('f.h5' (fingerprint {"c": 1}); the job's"""),
    (lambda tok: line(tok, network=None), "no network definition in the request (key 'network')"),
    (lambda tok: b"not json\n", "not one line of JSON"),
    (lambda tok: b"[1, 2]\n", "not a JSON object"),
    (lambda tok: line(tok, host="a b"), "is not one host name"),
    (lambda tok: line(tok, count=-1), "count -1 is not an integer >= 0"),
    (lambda tok: line(tok, count=True), "count True is not an integer >= 0"),
])
def test_a_bad_request_is_refused_and_logged_and_nothing_starts(listening, request_line, said, capsys):
    r0, att = listening()
    reply = ask(att, request_line(att.token))
    assert reply["ok"] is False and said in reply["error"]
    assert r0.spawned == [] and len(r0.events) == 1 and r0.events[0][0] == "attach_refused"
    assert r0.events[0][1].startswith("an attach from 127.0.0.1:") and said in r0.events[0][1]
    assert "refused" in capsys.readouterr().err


def test_nothing_lost_is_refused(listening):
    r0, att = listening(lost=())
    reply = ask(att, line(att.token))
    assert not reply["ok"] and "the job has its 3 workers" in reply["error"] and r0.spawned == []


def test_a_run_that_is_ending_starts_nothing(listening):
    r0, att = listening()
    r0.preempted = "SIGTERM"
    assert "the run is ending" in ask(att, line(att.token))["error"] and r0.spawned == []


def test_a_failed_spawn_is_said(listening):
    r0, att = listening(spawn_ok=False)
    reply = ask(att, line(att.token))
    assert not reply["ok"] and reply["error"] == r0.respawner.last_failure  # (the Respawner's text: why)


def test_an_oversize_request_is_refused(listening):
    r0, att = listening()
    reply = ask(att, b"x" * (REQUEST_BYTES + 10))
    assert not reply["ok"] and f"more than {REQUEST_BYTES} bytes" in reply["error"] and r0.spawned == []


def test_a_peer_that_closes_early_is_refused(listening):
    r0, att = listening()
    with socket.create_connection(("127.0.0.1", att.port), timeout=10) as sock:
        sock.sendall(b'{"token": ')
    for _ in range(200):
        att.tick()
        if r0.events:
            break
        time.sleep(0.01)
    assert r0.events and "closed before a whole request line" in r0.events[0][1] and att.peers == []


def test_a_slow_peer_is_dropped_and_rank_0_never_waits(listening, monkeypatch):
    monkeypatch.setattr(attach_module, "REQUEST_TIMEOUT", 0.2)
    r0, att = listening()
    with socket.create_connection(("127.0.0.1", att.port), timeout=10) as sock:
        sock.sendall(b'{"token": "')
        start = time.monotonic()
        ticks = []
        while not r0.events and time.monotonic() - start < 5:
            t = time.monotonic()
            att.tick()
            ticks.append(time.monotonic() - t)
            time.sleep(0.01)
        assert max(ticks) < 0.1  # a tick reads what is there and goes on
        assert r0.events and "no whole request within 0.2 s" in r0.events[0][1]
        assert json.loads(sock.recv(4096).split(b"\n")[0])["ok"] is False


def test_the_client_request_and_its_errors(listening, tmp_path):
    _r0, att = listening()
    with serving(att):
        reply = request(att.path, GOOD, host="", count=0, timeout=10)
        assert reply["ok"] and reply["ranks"] == [2]
        other = request(att.path, identity("{}", "digits", ""), timeout=10)
        assert not other["ok"] and "another network definition" in other["error"]
    bad = tmp_path / "bad.attach"
    bad.write_text("import os")
    with pytest.raises(ValueError, match="is not an attach file"):
        request(str(bad), GOOD)
    with pytest.raises(OSError):
        request(str(tmp_path / "missing.attach"), GOOD)
    port = att.port
    att.close()
    gone = tmp_path / "gone.attach"
    gone.write_text(json.dumps({"host": "127.0.0.1", "port": port, "token": "x"}))
    with pytest.raises(OSError, match="cannot reach the job's rank 0"):
        request(str(gone), GOOD, timeout=5)


def test_identity_tells_networks_and_datasets_apart():
    a = identity('{"layers": []}', "digits", "")
    assert a == identity('{"layers": []}', "digits", "")
    assert a["network"] != identity('{"layers": [] }', "digits", "")["network"]
    assert a["dataset"] == "digits:" and identity("x", "file", '{"name": "f"}')["dataset"] == 'file:{"name": "f"}'


@pytest.fixture
def keep_mpi4py_rc(monkeypatch):
    """`mpiasgd attach` tells mpi4py not to start MPI (mpi4py.rc): undone after the test, for the tests after it."""
    import mpi4py

    for key in ("initialize", "finalize"):
        monkeypatch.setattr(mpi4py.rc, key, getattr(mpi4py.rc, key))


def test_the_command_says_what_is_wrong_in_one_line(tmp_path, capsys, keep_mpi4py_rc):
    from mpiasgd.cli import main

    assert main(["attach", str(tmp_path / "none.attach"), "--model", "digits"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpiasgd attach: error: [Errno 2]") and "none.attach" in err and len(err.splitlines()) == 1
    assert main(["attach", str(tmp_path / "none.attach"), "--count", "-1", "--model", "digits"]) == 2
    assert "--count -1: expected an integer >= 0" in capsys.readouterr().err
    assert main(["attach", str(tmp_path / "none.attach"), "--model", "nonesuch"]) == 2
    assert "nonesuch" in capsys.readouterr().err


def test_the_command_asks_with_the_job_identity(tmp_path, capsys, keep_mpi4py_rc):
    """`mpiasgd attach FILE --model digits` computes the digits network's and dataset's identity as rank 0 does
    (`definition_text`) and is let in; the reply's text is printed."""
    from mpiasgd.cli import main
    from mpiasgd.config import make_parser, resolve
    from mpiasgd.launch.startup import definition_text, load_data

    cfg = resolve(make_parser().parse_args(["--model", "digits"]))
    dataset = load_data(cfg)
    r0 = loop([2])
    att = Attacher(r0, str(tmp_path / "run.h5"), identity(definition_text(cfg, dataset), "digits", ""))
    with serving(att):
        assert main(["attach", att.path, "--model", "digits", "--host", "here"]) == 0
    att.close()
    assert r0.spawned[0][:2] == (2, "here")
    assert "rank 0 starts worker rank 2 on here (MPI_Comm_spawn)" in capsys.readouterr().out


def test_a_host_name_that_does_not_resolve_falls_back_to_the_addresses(listening, tmp_path):
    r0, att = listening()
    spec = json.loads(open(att.path).read())
    moved = tmp_path / "moved.attach"
    moved.write_text(json.dumps({**spec, "host": "no-such-host.invalid", "addresses": ["127.0.0.1"]}))
    with serving(att):
        assert request(str(moved), GOOD, timeout=10)["ranks"] == [2]
    assert r0.spawned[0][0] == 2
