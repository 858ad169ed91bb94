"""(`--attach`, rank 0) A second launch brings back worker ranks the job lost: `mpiasgd attach RUN.attach`.

`MPI_Comm_connect` from a second `mpiexec` to a running job hangs with the wheel's Open MPI (the two launches share
no PMIx server: docs/training.md), so the second launch does not become an MPI process of the job itself: it asks
rank 0, over a TCP socket rank 0 listens on, to start a worker for lost ranks, and rank 0 starts each one with
`MPI_Comm_spawn` (`Respawner.spawn`, on the host the request names where given), which joins as a `--respawn`
replacement does. The steps, rank 0 on the left:

    listen             a TCP port on all of rank 0's addresses; RUN.attach beside the run log, mode 0600 (the job's
                       user alone reads it), JSON: {"host", "addresses" (its IPv4 addresses), "port", "token" (128
                       random bits, hex), "run"}
    <- request         one JSON line of at most REQUEST_BYTES: {"token", "network", "dataset", "host", "count"}:
                       `identity` of the attaching command's network and dataset, where to start the workers ("":
                       where MPI places them), how many (0: a worker for every lost rank)
    reply ->           one JSON line: {"ok": true, "ranks": [the worker ranks started], "text"} or
                       {"ok": false, "error"}

A request with a wrong token, another network or dataset, malformed JSON, more than REQUEST_BYTES, or none
within REQUEST_TIMEOUT seconds is refused, logged (event "attach_refused", naming the peer's address) and
said on rank 0's stderr; the run goes on. Rank 0 never waits for a peer: the socket and its connections are
non-blocking and read at each tick of its loop. Reading a request runs no code from it (JSON only).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import sys
import time
from typing import Any

from mpiasgd.runlog.summary import ATTACH_ORIGIN

__all__ = ["ATTACH_SUFFIX", "REQUEST_BYTES", "REQUEST_TIMEOUT", "Attacher", "attach_path", "identity", "request"]

ATTACH_SUFFIX = ".attach"   # RUN.attach beside RUN.h5
REQUEST_BYTES = 64 * 1024   # the largest request line rank 0 reads
REQUEST_TIMEOUT = 5.0       # seconds a peer has to send its whole request
MAX_PEERS = 8               # connections read at once; more are refused at once
POLL_INTERVAL = 0.05        # seconds between two looks at the socket


def attach_path(log_path: str) -> str:
    """The attach file of the run log `log_path` (runs/NAME.h5 -> runs/NAME.attach)."""
    stem = log_path[:-3] if log_path.endswith(".h5") else log_path
    return stem + ATTACH_SUFFIX


def identity(definition: str, dataset_name: str, fingerprint: str) -> dict[str, str]:
    """What an attach must match: the network definition's SHA-256 (`definition`: the JSON text every worker builds
    from, `launch.startup.definition_text`) and the dataset (`dataset_name`, and a file's `fingerprint`, "" for a
    built-in set)."""
    return {"network": hashlib.sha256(definition.encode()).hexdigest(), "dataset": f"{dataset_name}:{fingerprint}"}


def addresses(host: str) -> list[str]:
    """The IPv4 addresses of `host` as this host resolves them (an attach tries them after the name: a name another
    host cannot resolve still leaves a way in); [] when it does not resolve."""
    try:
        found = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return []
    return sorted({str(info[4][0]) for info in found})


def shown(key: str, value: str) -> str:
    """An identity's `key` ("network" or "dataset") as a refusal names it: the network's hash cut to 12 digits; the
    dataset's name, and its file's fingerprint where it has one."""
    if key == "network":
        return f"SHA-256 {value[:12]}"
    name, _, fingerprint = value.partition(":")
    return repr(name) + (f" (fingerprint {fingerprint})" if fingerprint else "")


class Peer:
    """A connection being read: its socket, address text, bytes so far and the time by which it must be whole."""

    def __init__(self, sock: socket.socket, address: str, deadline: float) -> None:
        self.sock, self.address, self.deadline = sock, address, deadline
        self.data = b""


class Attacher:
    """(rank 0) Listens for `mpiasgd attach` (module docstring). `r0` is the loop (`Rank0`), whose `respawner`
    starts the workers; `run` the run log's path (the attach file goes beside it: `attach_path`); `expected` the
    run's `identity`. Raises OSError when the port cannot be opened or the file not written (`serve` says so and
    the run goes on without attach)."""

    def __init__(self, r0: Any, run: str, expected: dict[str, str]) -> None:
        self.r0, self.run, self.path, self.expected = r0, run, attach_path(run), expected
        self.token = secrets.token_hex(16)
        self.server = socket.create_server(("", 0), family=socket.AF_INET, backlog=MAX_PEERS)
        self.server.setblocking(False)
        self.port = self.server.getsockname()[1]
        self.host = socket.gethostname()
        self.peers: list[Peer] = []
        self.polled = 0.0  # when `tick` last looked (monotonic seconds)
        self.write_file()

    def write_file(self) -> None:
        """RUN.attach, readable and writable by this user alone (written under another name, then renamed)."""
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # (a file left by a crash keeps its mode: made private again)
            os.write(fd, json.dumps({"host": self.host, "addresses": addresses(self.host), "port": self.port,
                                     "token": self.token, "run": self.run}).encode())
        finally:
            os.close(fd)
        os.replace(tmp, self.path)

    def tick(self) -> None:
        """Take new connections and read those open; answer each whole request (`handle`). At most every
        POLL_INTERVAL seconds (rank 0 ticks between any two messages)."""
        now = time.monotonic()
        if now - self.polled < POLL_INTERVAL:
            return
        self.polled = now
        while True:
            try:
                sock, address = self.server.accept()
            except OSError:  # (BlockingIOError: no one waiting)
                break
            where = f"{address[0]}:{address[1]}"
            if len(self.peers) >= MAX_PEERS:
                self.answer(sock, self.refused(where, f"more than {MAX_PEERS} attach connections at once"))
                continue
            sock.setblocking(False)
            self.peers.append(Peer(sock, where, now + REQUEST_TIMEOUT))
        for peer in list(self.peers):
            self.read(peer, now)

    def read(self, peer: Peer, now: float) -> None:
        try:
            while b"\n" not in peer.data:
                chunk = peer.sock.recv(4096)
                if not chunk:  # the peer closed before a whole line
                    self.drop(peer, "the connection closed before a whole request line came")
                    return
                peer.data += chunk
                if len(peer.data) > REQUEST_BYTES:
                    self.drop(peer, f"a request of more than {REQUEST_BYTES} bytes")
                    return
        except (BlockingIOError, InterruptedError):
            if now > peer.deadline:
                self.drop(peer, f"no whole request within {REQUEST_TIMEOUT:g} s")
            return
        except OSError as e:
            self.drop(peer, f"the connection failed ({e})")
            return
        self.peers.remove(peer)
        line = peer.data.split(b"\n", 1)[0]
        reply: dict[str, Any] = {"ok": False, "error": "rank 0 failed while it handled the request"}
        try:
            reply = self.handle(line, peer.address)
        finally:
            self.answer(peer.sock, reply)

    def handle(self, line: bytes, address: str) -> dict[str, Any]:
        """The reply to one request line from `address`: refused (and logged) unless the token, network and
        dataset match and a worker rank is lost; else a worker is started for each lost rank asked for."""
        try:
            req = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return self.refused(address, "the request is not one line of JSON")
        if not isinstance(req, dict):
            return self.refused(address, "the request is not a JSON object")
        token = req.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self.token.encode()):
            return self.refused(address, "a wrong token (the one in the job's attach file is needed)")
        for key, what in (("network", "network definition"), ("dataset", "dataset")):
            theirs = req.get(key)
            if not isinstance(theirs, str):
                return self.refused(address, f"no {what} in the request (key {key!r})")
            if theirs != self.expected[key]:
                return self.refused(address, f"another {what} ({shown(key, theirs)}; the job's is "
                                             f"{shown(key, self.expected[key])})")
        host, count = req.get("host", ""), req.get("count", 0)
        if not isinstance(host, str) or len(host) > 255 or any(c.isspace() or c == "," for c in host):
            return self.refused(address, f"host {host!r} is not one host name")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            return self.refused(address, f"count {count!r} is not an integer >= 0")
        r0, respawner = self.r0, self.r0.respawner
        if r0.rec.stop_reason or r0.preempted:
            return self.refused(address, "the run is ending")
        lost = [w for w in r0.role.lost_order if w not in respawner.pending]
        if not lost:
            return self.refused(address, f"no worker rank is lost: the job has its {len(r0.workers)} workers "
                                         "(an attach brings back lost ranks; a job does not grow beyond its launch's)")
        ranks = lost[:count] if count else lost
        started = [w for w in ranks if respawner.spawn(w, host=host, origin=f"{ATTACH_ORIGIN} {address}")]
        if not started:
            return {"ok": False, "error": respawner.last_failure or "MPI_Comm_spawn failed"}
        where = f" on {host}" if host else ""
        text = (f"{ATTACH_ORIGIN} {address}: rank 0 starts worker rank{'s' * (len(started) > 1)} "
                f"{', '.join(map(str, started))}{where} (MPI_Comm_spawn)")
        r0.rec.event("attach", text)
        print(f"mpiasgd: {text}", file=sys.stderr, flush=True)
        return {"ok": True, "ranks": started, "text": text}

    def refused(self, address: str, why: str) -> dict[str, Any]:
        text = f"{ATTACH_ORIGIN} {address} refused: {why}; the run goes on"
        self.r0.rec.event("attach_refused", text)
        print(f"mpiasgd: warning: {text}", file=sys.stderr, flush=True)
        return {"ok": False, "error": why}

    def drop(self, peer: Peer, why: str) -> None:
        self.peers.remove(peer)
        self.answer(peer.sock, self.refused(peer.address, why))

    @staticmethod
    def answer(sock: socket.socket, reply: dict[str, Any]) -> None:
        """Send `reply` as one JSON line (best effort: a peer that left gets nothing) and close."""
        try:
            sock.setblocking(True)
            sock.settimeout(1.0)
            sock.sendall((json.dumps(reply) + "\n").encode())
        except OSError:
            pass
        finally:
            sock.close()

    def close(self) -> None:
        """Stop listening and remove the attach file (the run ended)."""
        for peer in self.peers:
            peer.sock.close()
        self.peers.clear()
        self.server.close()
        try:
            os.remove(self.path)
        except OSError:
            pass


def request(path: str, ident: dict[str, str], host: str = "", count: int = 0, timeout: float = 60.0) -> dict:
    """(`mpiasgd attach`) Ask the job whose attach file is `path` to start workers for its lost ranks: `ident` this
    command's `identity`, `host` where ("" = where MPI places them), `count` how many (0 = all lost). Returns rank 0's
    reply ({"ok", "ranks", "text"} or {"ok": False, "error"}). Raises OSError (no such file, no answer within
    `timeout` seconds, the job gone) or ValueError (the file is not an attach file) naming `path`."""
    with open(path, "rb") as f:
        raw = f.read(REQUEST_BYTES)
    try:
        spec = json.loads(raw.decode("utf-8"))
        where, port, token = str(spec["host"]), int(spec["port"]), str(spec["token"])
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise ValueError(f"'{path}' is not an attach file (JSON with host, port and token, written by a job run "
                         "with --attach)") from None
    line = json.dumps({"token": token, **ident, "host": host, "count": count}) + "\n"
    others = spec.get("addresses", [])
    tried = [where, *(a for a in (others if isinstance(others, list) else []) if isinstance(a, str) and a != where)]
    for i, address in enumerate(tried):
        try:
            sock = socket.create_connection((address, port), timeout=timeout)
        except OSError as e:
            if i + 1 < len(tried):
                continue
            raise OSError(f"'{path}': cannot reach the job's rank 0 at {where}:{port} ({e}); has the run "
                          "ended?") from None
        break
    try:
        with sock:
            sock.sendall(line.encode())
            data = b""
            while b"\n" not in data:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError as e:
        raise OSError(f"'{path}': rank 0 at {where}:{port} did not answer ({e})") from None
    try:
        reply = json.loads(data.split(b"\n", 1)[0].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise OSError(f"'{path}': rank 0 at {where}:{port} gave no answer (the run ended?)") from None
    if not isinstance(reply, dict):
        raise OSError(f"'{path}': rank 0 at {where}:{port} gave no reply of an attach")
    return reply
