"""(--respawn) Rank 0's Respawner without MPI_Comm_spawn: what it does with a replacement's start-up answer (its
error, no answer in time, the run ended meanwhile, a good one: admitted), and its limit of replacements per rank.
The spawn itself, end to end: tests/mpi/test_elastic.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from kit.fakempi import Network
from mpi4py import MPI

from mpiasgd.comms.routed import RoutedComm
from mpiasgd.rank0.respawn import JOIN_TAG, MAX_RESPAWNS, Pending, Respawner, room_note


class Answer:
    """A start-up answer's receive: `value` once done (None: not yet), or the ULFM failure of a dead replacement."""

    def __init__(self, value=None, dead: bool = False) -> None:
        self.value, self.dead = value, dead

    def test(self):
        if self.dead:
            raise MPI.Exception(MPI.ERR_PROC_FAILED)
        return (self.value is not None), self.value


class Merged:
    """The replacement's communicator: what rank 0 sends it."""

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, obj, dest: int, tag: int) -> None:
        self.sent.append((obj, dest, tag))


def loop(stopped: str = "") -> SimpleNamespace:
    """Rank 0's loop as the Respawner sees it: its events, the admitted replacements, its stop."""
    r0 = SimpleNamespace(comm=RoutedComm(Network(4).comm(0)), events=[], admitted=[], preempted="", short=[],
                         cfg=SimpleNamespace(model_timeout=5.0, comm_timeout=5.0, respawn=True))
    r0.rec = SimpleNamespace(stop_reason=stopped, event=lambda kind, text: r0.events.append((kind, text)))
    r0.short_of_workers = lambda w, why: r0.short.append((w, why))
    r0.admit = lambda w, comm, info, seconds, origin="": r0.admitted.append((w, comm, info))
    return r0


def pending(respawner: Respawner, w: int, answer: Answer, deadline: float = 60.0) -> Merged:
    comm = Merged()
    now = time.monotonic()
    respawner.pending[w] = Pending(w, None, comm, answer, now, now + deadline)
    return comm


def test_a_replacement_is_admitted_once_its_answer_comes(capsys):
    r0 = loop()
    respawner = Respawner(r0, "{}", 4, ["train"], {})
    answer = Answer()
    comm = pending(respawner, 2, answer)
    respawner.tick()
    assert r0.admitted == [] and 2 in respawner.pending  # not yet: rank 0 does not wait for it
    info = SimpleNamespace(host="h", pid=7)
    answer.value = (None, info)
    respawner.tick()
    assert r0.admitted == [(2, comm, info)] and respawner.pending == {} and r0.events == []


@pytest.mark.parametrize("answer,deadline,said", [
    (Answer(("DataError: no such file", None)), 60.0, "the replacement for worker rank 2 could not start: DataError"),
    (Answer(dead=True), 60.0, "the replacement for worker rank 2 died during its start-up"),
    (Answer(), -1.0, "the replacement for worker rank 2 did not start within")])
def test_a_replacement_that_cannot_start_is_logged_and_the_run_goes_on(answer, deadline, said, capsys):
    r0 = loop()
    respawner = Respawner(r0, "{}", 4, ["train"], {})
    pending(respawner, 2, answer, deadline)
    respawner.tick()
    assert r0.admitted == [] and respawner.pending == {}
    assert len(r0.events) == 1 and r0.events[0][0] == "respawn_failed" and r0.events[0][1].startswith(said)
    assert f"mpiasgd: warning: {said}" in capsys.readouterr().err
    assert [(w, why.startswith(said)) for w, why in r0.short] == [(2, True)]  # --min-workers is judged again


def test_a_replacement_ready_after_the_stop_is_sent_home():
    r0 = loop()
    respawner = Respawner(r0, "{}", 4, ["train"], {})
    comm = pending(respawner, 3, Answer((None, SimpleNamespace(host="h", pid=1))))
    r0.rec.stop_reason = "epochs"
    respawner.tick()
    assert r0.admitted == [] and comm.sent == [(None, 1, JOIN_TAG)]


def test_no_replacement_after_the_stop_nor_beyond_the_limit(capsys):
    r0 = loop(stopped="epochs")
    respawner = Respawner(r0, "{}", 4, ["train"], {})
    respawner.spawn(2)  # the run stopped: nothing is spawned
    assert respawner.pending == {} and r0.events == []
    r0.rec.stop_reason = ""
    respawner.count[2] = MAX_RESPAWNS
    respawner.spawn(2)
    assert respawner.pending == {} and r0.events[0][0] == "respawn_failed"
    assert f"replaced {MAX_RESPAWNS} times already" in r0.events[0][1]


def test_will_replace_only_under_respawn_below_the_limit_and_before_the_stop():
    r0 = loop()
    respawner = Respawner(r0, "{}", 4, ["train"], {})
    assert respawner.will_replace(2)
    respawner.count[2] = MAX_RESPAWNS
    assert not respawner.will_replace(2) and respawner.will_replace(3)
    r0.preempted = "SIGTERM received by rank 0"
    assert not respawner.will_replace(3)
    r0.preempted, r0.cfg.respawn = "", False  # (--attach alone: no replacement at a death)
    assert not respawner.will_replace(3)


def test_rank0_must_route_by_worker_rank():
    with pytest.raises(TypeError, match="RoutedComm"):
        Respawner(SimpleNamespace(comm=Network(2).comm(0)), "{}", 2, [], {})


def test_the_start_up_note_on_room_for_replacements():
    class Comm:
        def __init__(self, universe, size):
            self.universe, self.size = universe, size

        def Get_attr(self, key):
            assert key == MPI.UNIVERSE_SIZE
            return self.universe

        def Get_size(self):
            return self.size

    assert room_note(Comm(8, 4)) == "" and room_note(Comm(None, 4)) == ""
    assert room_note(Comm(4, 4)) == ("the allocation has 4 slots for the job's 4 ranks: a replacement needs mpiexec "
                                     "--oversubscribe or a host with free slots")
