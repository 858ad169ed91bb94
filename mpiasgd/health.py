"""Divergence and dead-network detection from the training loss (rank 0, every mode).

A run whose step size is too large for its number of workers often does not crash: the loss
spikes, the weights are thrown where every ReLU is off, and the network then predicts a constant.
Its loss sits at ln(C), the cross-entropy of a uniform guess over C classes, and its accuracy at
chance, 1/C, while the run goes on to "complete". `LossWatch` reads the rows rank 0 logs anyway
(each push's or report's minibatch loss, correct count and images) and names two symptoms:

    spike  the mean loss of the latest SPIKE_SAMPLES images or more (one row at batch size >= 32;
           consecutive rows summed for smaller batches, whose single-image losses are too noisy)
           above SPIKE_FACTOR times its running level and more than ln(C) above it; the level is
           an exponential moving average (weight EMA_WEIGHT per such group) that starts at ln(C),
           the loss of a freshly initialised network
    dead   over a window of BIN_EPOCHS epochs starting at epoch >= 1 (after the first epoch): the
           mean loss within DEAD_LOSS_TOLERANCE * ln(C) of ln(C) and the training accuracy below
           DEAD_ACCURACY_FACTOR / C

Each symptom is reported once (an event, a warning on stderr). A dead network that later trains
again (a window's accuracy at least ALIVE_ACCURACY_FACTOR / C) is reported as recovered.
`--on-divergence stop` ends the run once the network is dead (also when that is first seen in the
last, partial window at the end); a spike alone is only a warning, since runs often recover from
one. `final_state` says whether the run ended dead, for the summary and `mpiasgd report`.

Rejected pushes (`Recorder.reject`, --max-rejects) are worded here too: a run of non-finite pushes is
divergence (`rejects_text` ends with the mode's advice), but under --wire fp16 a push whose values are finite
and beyond fp16's range [-65504, 65504] arrives as inf too; `rejected_text` and `rejects_text` name those with
their largest magnitude and point to --wire bf16 instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mpiasgd.comms.wire import RANGE

SPIKE_FACTOR = 3.0          # a loss this many times its running level (and > level + ln C) is a spike
SPIKE_SAMPLES = 32          # images whose mean loss is judged at once (rows summed until there are this many)
EMA_WEIGHT = 0.05           # weight of each judged group in the running level
BIN_EPOCHS = 0.5            # the dead-network window, epochs
DEAD_FROM_EPOCH = 1.0       # windows starting before this epoch are not judged (warm-up, first epoch)
DEAD_LOSS_TOLERANCE = 0.05  # |mean loss - ln C| <= this * ln C
DEAD_ACCURACY_FACTOR = 1.25  # training accuracy < this / C
ALIVE_ACCURACY_FACTOR = 2.0  # a dead network trains again once a window's accuracy is >= this / C (hysteresis)


def likely_cause(workers: int, asynchronous: bool) -> str:
    """The advice a finding ends with."""
    if asynchronous:
        return (f"the step size is likely too large for {workers} asynchronous worker{'s' * (workers != 1)} "
                f"(staleness adds momentum): lower --lr, lengthen --warmup-epochs, or try --staleness-lr inverse")
    return "the step size (or the weight decay) is likely too large: lower --lr or --weight-decay"


def range_cause(largest: float) -> str:
    """What a push beyond fp16's range had (`largest`: its largest magnitude, finite, >= 65520)."""
    return f"the largest magnitude {largest:.6g}; --wire fp16 holds {RANGE}"


WIRE_ADVICE = "use --wire bf16 (float32's range)"


def rejected_text(w: int, step: int, what: str, largest: float = 0.0) -> str:
    """The warning of worker `w`'s first rejected push (step `step`) of a kind: a `what` (gradient, weights) that
    is not finite, or (`largest` > 0) one whose values are finite but beyond fp16's range (--wire fp16: they
    arrived as inf), named with its largest magnitude and the advice --wire bf16."""
    if not largest:
        return f"worker rank {w} pushed a non-finite {what} at step {step}: rejected (not applied)"
    return (f"worker rank {w} pushed a {what} beyond fp16's range at step {step} (its "
            f"{range_cause(largest).removeprefix('the ')}): rejected (not applied); {WIRE_ADVICE}")


AT_START = ("before any update was applied: the network computes non-finite values at its initial weights (its "
            "layers, their initialisation or the scale of its inputs), not because of the step size")


def rejects_text(who: str, w: int, step: int, count: int, limit: int, what: str, advice: str,
                 beyond: int = 0, largest: float = 0.0, updated: bool = True) -> str:
    """The error that ends a run after worker `w` pushed `count` = --max-rejects `limit` rejected `what`s in a row,
    the last at `step`: `beyond` of them finite but beyond fp16's range (the largest magnitude among them
    `largest`), the others not finite. A run of only the latter is divergence (ends with `advice`), unless no
    update was applied yet (`updated` False: the initial weights, AT_START); one with values beyond the range
    names them and points to --wire bf16."""
    steps = f"steps {step - count + 1}..{step}; --max-rejects {limit}"
    whats = f"{count} {what}{'s' * (count != 1)} in a row"
    if not beyond and not updated:
        return f"{who}: worker rank {w} pushed {count} non-finite {what}s in a row ({steps}) {AT_START}"
    if not beyond:
        return (f"{who}: worker rank {w} pushed {count} non-finite {what}s in a row ({steps}): training has "
                f"diverged; {advice}")
    if beyond == count:
        return (f"{who}: worker rank {w} pushed {whats} beyond fp16's range ({steps}; {range_cause(largest)}): "
                f"the values are finite, only too large for fp16: {WIRE_ADVICE}")
    return (f"{who}: worker rank {w} pushed {whats} beyond fp16's range or not finite ({steps}; {beyond} beyond "
            f"fp16's range, {range_cause(largest)}): {WIRE_ADVICE}; if the non-finite ones continue, {advice}")


@dataclass
class Finding:
    """One symptom: `kind` is the run-log event kind ("diverged", "dead" or "recovered"), `text` names
    the symptom, where it was seen and the likely cause."""
    kind: str
    text: str


class LossWatch:
    """(server only) Watches the training loss rows of a run with `num_classes` classes and `num_workers`
    workers (`asynchronous`: through the parameter server, async/ssp); see the module docstring.

    `observe(epoch, loss, correct, samples)` takes one row (epoch: float, the run's epochs done;
    loss: the minibatch's mean cross-entropy in nats; correct, samples: counts) and returns the
    findings that row completes (usually none). Rows with a non-finite loss are left out: the server
    rejects their gradients and counts them (--max-rejects).
    """

    def __init__(self, num_classes: int, num_workers: int, asynchronous: bool = True, advice: str = "") -> None:
        self.chance_loss = math.log(num_classes)  # ln C, nats
        self.chance_accuracy = 1.0 / num_classes
        self.cause = advice or likely_cause(num_workers, asynchronous)  # `advice`: the mode's own
        self.group = [0.0, 0]                    # rows not judged for a spike yet: loss * samples, samples
        self.level = self.chance_loss            # running level of the loss, nats
        self.spiked = False                      # a spike was reported (once per run)
        self.judged = 0                          # groups of rows judged for a spike so far
        self.at_start = ""                       # the first group's loss was a spike: the network, not the step
        self.dead_since: float | None = None     # start epoch of the first dead window of the current spell
        self.dead_reported = False
        self.bin_start: float | None = None      # the window being summed: start epoch, loss*samples, correct, samples
        self.bin = [0.0, 0, 0]
        self.last_epoch = 0.0                    # epoch of the newest row

    def observe(self, epoch: float, loss: float, correct: int, samples: int) -> list[Finding]:
        found = []
        if not math.isfinite(loss):  # a non-finite gradient is rejected and counted by the server (--max-rejects)
            return found
        if samples <= 0:
            return found
        self.group[0] += loss * samples
        self.group[1] += int(samples)
        if self.group[1] >= SPIKE_SAMPLES:
            mean = self.group[0] / self.group[1]
            self.group = [0.0, 0]
            if not self.spiked and mean > max(SPIKE_FACTOR * self.level, self.level + self.chance_loss):
                self.spiked = True
                ratio = f"{mean / self.level:.1f}x" if mean < 1000 * self.level else "over 1000x"
                if not self.judged:  # no level measured yet: the loss of the initial weights themselves
                    self.at_start = (f"the training loss was {mean:.4g} from the first minibatches, {ratio} ln "
                                     f"{round(1 / self.chance_accuracy)} = {self.chance_loss:.3f} (a network that "
                                     f"knows nothing): its initial outputs are far too large (its layers' "
                                     f"initialisation or the scale of its inputs), not the step size")
                    found.append(Finding("diverged", self.at_start))
                else:
                    found.append(Finding("diverged", (
                        f"training loss spiked to {mean:.4g} at epoch {epoch:.2f}, {ratio} its running level "
                        f"{self.level:.4g}: {self.cause}")))
            self.judged += 1
            self.level = (1 - EMA_WEIGHT) * self.level + EMA_WEIGHT * mean
        self.last_epoch = epoch
        if self.bin_start is None:
            self.bin_start = BIN_EPOCHS * math.floor(epoch / BIN_EPOCHS)
        elif epoch >= self.bin_start + BIN_EPOCHS:  # the window is complete: judge it, start the next
            found += self.judge()
            self.bin_start, self.bin = BIN_EPOCHS * math.floor(epoch / BIN_EPOCHS), [0.0, 0, 0]
        self.bin[0] += loss * samples
        self.bin[1] += int(correct)
        self.bin[2] += int(samples)
        return found

    def judge(self) -> list[Finding]:
        """Judge the window summed so far (it is complete); the findings it gives."""
        start, (loss_sum, correct, samples) = self.bin_start, self.bin
        if start is None or start < DEAD_FROM_EPOCH or not samples:
            return []
        mean, accuracy = loss_sum / samples, correct / samples
        dead = (abs(mean - self.chance_loss) <= DEAD_LOSS_TOLERANCE * self.chance_loss
                and accuracy < DEAD_ACCURACY_FACTOR * self.chance_accuracy)
        alive = accuracy >= ALIVE_ACCURACY_FACTOR * self.chance_accuracy
        if dead and self.dead_since is None:
            self.dead_since = start
            if not self.dead_reported:
                self.dead_reported = True
                return [Finding("dead", (
                    f"the network looks dead from epoch {start:.1f}: over epochs {start:.1f}-{start + BIN_EPOCHS:.1f} "
                    f"the training loss is {mean:.4f}, at ln {round(1 / self.chance_accuracy)} = "
                    f"{self.chance_loss:.4f} (a constant prediction), and the training accuracy "
                    f"{100 * accuracy:.1f} %, at chance ({100 * self.chance_accuracy:.0f} %): {self.cause}"))]
        if alive and self.dead_since is not None:
            since, self.dead_since = self.dead_since, None
            return [Finding("recovered", f"the network trains again from epoch {start:.1f} (dead since epoch "
                                         f"{since:.1f}): training loss {mean:.4f}, accuracy {100 * accuracy:.1f} %")]
        return []

    def finish(self) -> list[Finding]:
        """At the run's end: judge the last window too if it covers half a window or more; the findings."""
        start = self.bin_start
        found = self.judge() if start is not None and self.last_epoch - start >= BIN_EPOCHS / 2 else []
        self.bin_start, self.bin = None, [0.0, 0, 0]
        return found

    def final_state(self) -> str:
        """What the run ended as (after `finish`): "" if healthy, else a line naming the state, for the
        summary (log attribute `health`) and `mpiasgd report`."""
        if self.dead_since is None:
            return ""
        return (f"dead from epoch {self.dead_since:.1f} to the end (training loss at ln "
                f"{round(1 / self.chance_accuracy)} = {self.chance_loss:.3f}, chance accuracy): lower --lr")
