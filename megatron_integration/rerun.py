"""Megatron-LM's rerun state machine (``--rerun-mode``, default ``validate_results``).

A NaN or infinite loss or gradient norm is either the run's own (a diverged run: it comes back
whenever the iteration is computed again) or a device's fault (a transient upset, or a device that
computes wrongly). Megatron-LM tells them apart by computing the iteration again, and so does
:class:`ResultValidator`, with Megatron-LM's outcomes and exit statuses:

1. The iteration's loss or gradient norm is rejected on some rank (not finite, or an injected
   error, ``--error-injection-rate``): every rank computes the iteration's forward and backward
   passes again, in place, from the same random state and the same micro-batches (the optimizer
   has not stepped).
2. Not reproduced: a transient fault. A checkpoint of the weights before the iteration is saved
   (``--save``) and the job exits with status 17; a resumed run retrains from it.
3. Reproduced: the devices agree with themselves, which does not tell a correct result from a
   device that is consistently wrong. The checkpoint is saved with a record of the rejected
   results (``rerun_state.json`` in the iteration's directory,
   :mod:`megatron_integration.rerun_record`) and the job exits with status 16: resume it on other
   nodes or devices.
4. The resumed run computes the iteration again. A rank that is back on the node and device that
   rejected the result exits with 16 again (resume elsewhere). Otherwise, reproduced: the result is
   correct, the run itself diverged (lower ``--lr``, check the data); not reproduced: the first
   devices are faulty. Either way the job exits with 17, as Megatron-LM's does;
   ``--rerun-mode disabled`` resumes past the record.

``report_stats`` computes every iteration twice and reports how much the loss and the gradient
norms differ between the two (the run's non-determinism), every two iterations. ``disabled`` stops
on the first NaN or Inf, as Megatron-LM's check does then. Where Megatron-LM lets the first
iteration of a job through unchecked under ``validate_results`` (no checkpoint could be taken
before it), the check here stops the job on it, as ``disabled`` does. The gradient norm is the
steppers' after the data-parallel and embedding reductions, where megatron-core checks each bucket
before its reduction: a NaN born on one replica is every replica's, and the loss (never reduced
before it is read) names the rank it began on.

``--check-for-spiky-loss`` and ``--check-for-large-grads`` (Megatron-LM's, off by default): a rank's
loss or gradient norm of ten times the largest of its first 100 is computed again in place and said
to reproduce or not, and training goes on either way (``disabled``: said only). Megatron-LM checks
each micro-batch's loss sum and each gradient bucket's norm; here each rank's share of the
iteration's loss and its whole gradient norm are checked, as DynaPipe's micro-batches vary in size
by design (a micro-batch's sum grows with its tokens), so the first 100 iterations set the scale.
"""
from __future__ import annotations

import math
import os
import random
import socket
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from dynapipe.errors import DynaPipeError
from megatron_integration.rerun_settings import RerunSettings
from megatron_integration.rerun_tracker import Rejection, append
from megatron_integration import rerun_stats
from megatron_integration.rerun_stats import GRAD_NORM_TOLERANCE, LOSS_TOLERANCE, LargeValues, QuickStats, compare
from megatron_integration.nan_guard import NonFiniteError, describe, local_values, ranks_text, rejection

# megatron.core.rerun_state_machine's exit statuses.
EXIT_RESUME_TO_DISAMBIGUATE = 16
EXIT_FAILED_ON_RESULT_VALIDATION = 17
REPORT_INTERVAL = 2  # iterations between report_stats lines, as Megatron-LM's


class RerunExit(DynaPipeError):
    """The run ends on a rejected result; ``exit_code`` is Megatron-LM's (16 or 17)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Verdict:
    """How a run ends on a rejected result: the status, the line, and whether the weights before
    the iteration are saved (``record``: what the checkpoint keeps for the resumed run)."""

    exit_code: int
    message: str
    checkpoint: bool
    record: Optional[dict] = None


def _where(device: torch.device) -> list:
    """This rank's node and device: the CUDA device index, or on CPUs its local rank."""
    index = torch.cuda.current_device() if device.type == "cuda" else int(os.environ.get("LOCAL_RANK", "0"))
    return [socket.gethostname(), index]


@dataclass
class ResultValidator:
    """Validates each iteration's results before the optimizer step (see the module's text).

    ``check``: ``--check-for-nan-in-loss-and-grad`` as resolved (off: no NaN or Inf is rejected,
    as in Megatron-LM; the spike checks are the settings'); ``module``: this rank's model, whose
    gradient norm is validated; ``resume``: the record of the checkpoint this run resumed from
    (:func:`megatron_integration.rerun_record.load_record`); ``log``: rank 0's line writer.
    Every method is collective over the job."""

    settings: RerunSettings
    check: bool
    module: torch.nn.Module
    device: torch.device
    resume: Optional[dict] = None
    log: Callable[[str], None] = lambda line: None
    # The job's layout (parallel sizes, method, micro-batch size, stage split), which a record must match.
    layout: dict = field(default_factory=dict)
    first_done: bool = False
    places: Optional[list] = None  # every rank's node and device, once gathered (_places)
    stats: dict = field(default_factory=lambda: {"loss": QuickStats(), "gradient norm": QuickStats()})
    large: dict = field(default_factory=lambda: {"loss": LargeValues(), "gradient norm": LargeValues()})

    @classmethod
    def of(cls, cfg, module: torch.nn.Module, device: torch.device) -> "ResultValidator":
        """The validator ``cfg`` (a DynaPipeTrainingConfig) asks for, without a resume record:
        a stepper's own when its run did not set one."""
        return cls(cfg.rerun, cfg.check_for_nan_in_loss_and_grad, module, device)

    def run(self, iteration: int, forward_backward: Callable[[], Optional[float]]) -> Optional[Verdict]:
        """Compute iteration ``iteration`` (0-based) with ``forward_backward`` (zero the gradients,
        forward and backward, reduce the gradients; returns this rank's loss sum, None on ranks
        without a loss), again where the mode asks; None when the optimizer may step, else the
        :class:`Verdict` that ends the run. Raises :class:`NonFiniteError` where no rerun is made."""
        s = self.settings
        if not (self.check or s.check_for_spiky_loss or s.check_for_large_grads):
            forward_backward()
            return None
        mode = s.rerun_mode
        if self.resume is not None and iteration + 1 > self.resume["iteration"]:
            self.resume = None  # its iteration was skipped (--iterations-to-skip): nothing to diagnose
        saved = _rng_state() if mode != "disabled" else None
        values = self._gather(forward_backward(), inject=self._injects())
        resumed = self.resume is not None and mode == "validate_results" and iteration + 1 == self.resume["iteration"]
        if resumed:
            verdict = self._diagnose_resumed(values)
            self.resume = None
            return verdict
        if mode == "report_stats":
            _set_rng_state(saved)
            self._record_stats(values, self._gather(forward_backward()), iteration)
        rejected = _rejected(values) if self.check else []
        if not rejected:
            # Megatron-LM's spike checks: not under report_stats, nor on a job's first iteration
            # under validate_results (no checkpoint could be taken before it).
            verdict = None
            if mode == "disabled" or (mode == "validate_results" and self.first_done):
                verdict = self._check_spikes(iteration, values, saved, forward_backward)
            self.first_done = True
            return verdict
        if mode != "validate_results" or not self.first_done:
            message = describe(iteration + 1, _flags(values))
            if mode != "report_stats":  # Megatron-LM's report_stats rejects (and records) nothing
                self._track(iteration + 1, "RERUN_DISABLED", self._rows(values, rejected))
            if mode == "validate_results":
                message += (" (As in Megatron-LM, a job's first iteration is not computed again; here it stops the "
                            "job.)")
            raise NonFiniteError(message)
        return self._rerun_in_place(iteration, values, rejected, saved, forward_backward)

    # --- the initial run's rejection, its rerun in place -------------------------------------
    def _injects(self) -> bool:
        rate = self.settings.error_injection_rate
        if not rate or not self.check or not self.first_done or self.resume is not None:
            return False
        rank = dist.get_rank() if dist.is_initialized() else 0
        return (random.randint(0, rate - 1) + rank) % rate == 0

    def _gather(self, loss_sum, inject: bool = False) -> torch.Tensor:
        """``[world, 4]``: has a loss, loss sum, gradient norm, injected (0/1), of every rank."""
        local = local_values(self.module, loss_sum, self.device)
        row = torch.cat([local, torch.tensor([1.0 if inject else 0.0], device=local.device)])
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return row.cpu()[None]
        rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, row)
        return torch.stack(rows).cpu().double()

    def _rerun_in_place(self, iteration: int, values, rejected: list[int], saved, forward_backward) -> Verdict:
        self.log(f"iteration {iteration + 1}: result rejected on {ranks_text(rejected)}; computing the iteration again "
                 f"on the same devices to check whether it reproduces")
        _set_rng_state(saved)
        again = self._gather(forward_backward())
        injected = {r: self.settings.error_injection_type for r in rejected if values[r, 3] > 0}
        reproduced = [r for r in rejected if _reproduced(values[r], again[r], injected.get(r), "in_place")]
        first = rejection(iteration + 1, _flags(values)) or (
            f"iteration {iteration + 1}: an injected {_injected_names(injected)}")
        self._track_rerun(iteration + 1, "FIRST_RERUN", values, again, rejected, reproduced)
        # The checkpoint saved next must hold the random state the iteration started from (its
        # dropout masks), as the weights are, so a resumed run computes the same iteration.
        _set_rng_state(saved)
        if not reproduced:
            return Verdict(EXIT_FAILED_ON_RESULT_VALIDATION, checkpoint=True, message=(
                f"{first}, and computing it again on the same devices did not reproduce it: a possible transient "
                f"fault of {ranks_text(rejected)} ({_places(self._places(), rejected)}). Resume from the checkpoint "
                f"before it; if it recurs, leave those devices out."))
        record = {"iteration": iteration + 1, "rejected": rejected, "reproduced": reproduced,
                  "values": values.tolist(), "places": self._places(), "layout": self.layout,
                  "injected": {str(r): t for r, t in injected.items()}, "what": first}
        return Verdict(EXIT_RESUME_TO_DISAMBIGUATE, checkpoint=True, record=record, message=(
            f"{first}; computing it again on the same devices reproduced it on {ranks_text(reproduced)}. Resume "
            f"from the checkpoint before it on other nodes or devices: computed there, it tells a diverged run from a "
            f"faulty device."))

    def _places(self) -> list:
        """Every rank's node and device; gathered once (collective then), as they do not change."""
        if self.places is None:
            self.places = [_where(self.device)]
            if dist.is_initialized() and dist.get_world_size() > 1:
                self.places = [None] * dist.get_world_size()
                dist.all_gather_object(self.places, _where(self.device))
        return self.places

    # --- the resumed run's diagnosis ---------------------------------------------------------
    def _diagnose_resumed(self, values) -> Verdict:
        record = self.resume
        k, rejected, before = record["iteration"], record["rejected"], record["places"]
        initial = torch.tensor(record["values"], dtype=torch.float64)
        here = self._places()
        # As Megatron-LM: a rank that reproduced the result in place must not be back on the node
        # and device it reproduced it on.
        same = [r for r in record.get("reproduced", rejected) if list(here[r]) == list(before[r])]
        if same:
            return Verdict(EXIT_RESUME_TO_DISAMBIGUATE, checkpoint=False, message=(
                f"iteration {k}: resumed to compute the rejected result again elsewhere, but {ranks_text(same)} "
                f"run on the node and device that rejected it ({_places(here, same)}); resume from the same "
                f"checkpoint on other nodes or devices."))
        injected = {int(r): t for r, t in record.get("injected", {}).items()}
        reproduced = [r for r in rejected if _reproduced(initial[r], values[r], injected.get(r), "elsewhere")]
        first = record.get("what", f"iteration {k}: result rejected")
        self._track_rerun(k, "SECOND_RERUN", initial, values, rejected, reproduced, initial_run=False)
        if reproduced:
            return Verdict(EXIT_FAILED_ON_RESULT_VALIDATION, checkpoint=False, message=(
                f"{first}; computed again on other devices ({_places(here, rejected)}), it is reproduced: the result "
                f"is correct and the run itself diverged, not a device. Resume with --iterations-to-skip {k} to "
                f"skip its batch, or lower --lr, check the data and the checkpoint, and resume with --rerun-mode "
                f"disabled to train past the record."))
        return Verdict(EXIT_FAILED_ON_RESULT_VALIDATION, checkpoint=False, message=(
            f"{first}; computed again on other devices ({_places(here, rejected)}), it is not reproduced: the "
            f"devices that gave it ({_places(before, rejected)}) are likely faulty. Leave them out and resume "
            f"with --rerun-mode disabled to train past the record."))

    # --- spikes: computed again, training goes on -------------------------------------------
    def _check_spikes(self, iteration: int, values, saved, forward_backward) -> Optional[Verdict]:
        """Megatron-LM's non-fatal checks: a spike is said, computed again in place under
        ``validate_results`` (the optimizer then steps on the recomputed gradients), and training
        goes on whether or not it reproduced (None). A recomputation that is NaN or Inf where the
        first computation was finite is a transient fault: its :class:`Verdict` ends the run."""
        s, k = self.settings, iteration + 1
        spikes = []  # (rank, quantity, column)
        for r in range(len(values)):
            if s.check_for_spiky_loss and values[r, 0] > 0 and self.large["loss"].large(r, float(values[r, 1])):
                spikes.append((r, "loss", 1))
            if s.check_for_large_grads and self.large["gradient norm"].large(r, float(values[r, 2])):
                spikes.append((r, "gradient norm", 2))
        if not spikes:
            return None
        factor, samples = rerun_stats.SPIKE_FACTOR, rerun_stats.LARGE_VALUE_SAMPLES
        what = "; ".join(f"the {name} of rank {r} is {float(values[r, c]):.4g}, at least {factor:g}x the largest of "
                         f"its first {samples} ({self.large[name].largest[r]:.4g})" for r, name, c in spikes)
        # One tracker line a rank, its first spike's: Megatron-LM compares the first rejected
        # validation of a rank when computing again.
        first_spikes = list({r: (r, name, c) for r, name, c in reversed(spikes)}.values())[::-1]
        if s.rerun_mode == "disabled":
            self.log(f"warning: iteration {k}: {what}; training goes on (--rerun-mode disabled)")
            self._track(k, "RERUN_DISABLED", [(r, name, float(values[r, c])) for r, name, c in first_spikes])
            return None
        self.log(f"iteration {k}: {what}; computing the iteration again on the same devices")
        self._track(k, "INITIAL_RUN", [(r, name, float(values[r, c])) for r, name, c in first_spikes])
        _set_rng_state(saved)
        again = self._gather(forward_backward())
        flags = _flags(again)
        places = self._places()
        same = {r for r, name, c in first_spikes if _same(values, again, r, c)}
        for status, ranks in (("FIRST_RERUN_REPRODUCIBLE", same), ("FIRST_RERUN_NOT_REPRODUCIBLE",
                                                                   {r for r, _, _ in first_spikes} - same)):
            self._track(k, status, [(r, name, float(again[r, c])) for r, name, c in first_spikes if r in ranks])
        if self.check and flags.any():
            bad = [r for r in range(len(again)) if flags[r].any()]
            _set_rng_state(saved)  # the checkpoint holds the state the iteration started from
            return Verdict(EXIT_FAILED_ON_RESULT_VALIDATION, checkpoint=True, message=(
                f"{rejection(k, flags)} when computed again after an unexpectedly large value, finite the first "
                f"time: a possible transient fault of {ranks_text(bad)} ({_places(places, bad)}). Resume from the "
                f"checkpoint before it; if it recurs, leave those devices out."))
        for r, name, c in spikes:
            if _same(values, again, r, c):
                self.log(f"iteration {k}: the {name} of rank {r} is reproduced ({float(again[r, c]):.4g}): the result "
                         f"stands, not a device's fault; training goes on")
            else:
                self.log(f"iteration {k}: the {name} of rank {r} is not reproduced ({float(again[r, c]):.4g}): a "
                         f"possible transient fault of {_places(places, [r])}; training goes on with the recomputed "
                         f"result")
        return None

    # --- the tracker file (--result-rejected-tracker-filename) --------------------------------
    def _track(self, iteration: int, status: str, rows: list) -> None:
        """Append ``rows`` ((rank, what, value) of each rejected result) to the tracker file as
        ``status`` (:data:`megatron_integration.rerun_tracker.STATUSES`), ``iteration`` from 1;
        collective (the ranks' places are gathered), rank 0 writes. A failing write is said, not
        raised: the run's own verdict, and its checkpoint, must not be lost to it."""
        path = self.settings.result_rejected_tracker_filename
        if not path or not rows:
            return
        places = self._places()
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        try:
            append(path, iteration, status, [Rejection(r, places[r][0], places[r][1], v, what) for r, what, v in rows])
        except DynaPipeError as e:
            self.log(f"warning: {e}")

    def _rows(self, values, ranks: list[int], results=None) -> list:
        """(rank, what, value) of each rank of ``ranks`` a rejected result began on, read from
        ``results`` (default ``values``): the ranks whose loss was rejected or that had an error
        injected, else all of ``ranks`` (a gradient norm, read after the data-parallel reduction,
        is every replica's: one rank's NaN would otherwise be reported by all, and the tracker
        skips nothing several ranks of a job reported)."""
        results = values if results is None else results
        flags = _flags(values)
        began = [r for r in ranks if flags[r, 0] > 0 or values[r, 3] > 0] or list(ranks)
        rows = []
        for r in began:
            if values[r, 3] > 0:
                what, c = f"injected {self.settings.error_injection_type}", 1 if values[r, 0] > 0 else 2
            else:
                what, c = ("loss", 1) if flags[r, 0] > 0 else ("gradient norm", 2)
            rows.append((r, what, float(results[r, c])))
        return rows

    def _track_rerun(self, k: int, rerun: str, initial, again, rejected: list[int], reproduced: list[int],
                     initial_run: bool = True) -> None:
        """The tracker lines of a computation again (``rerun``: ``FIRST_RERUN`` in place,
        ``SECOND_RERUN`` elsewhere): the initial run's (``initial_run``), then each rank's outcome."""
        if initial_run:
            self._track(k, "INITIAL_RUN", self._rows(initial, rejected))
        rows = self._rows(initial, rejected, again)
        self._track(k, f"{rerun}_REPRODUCIBLE", [row for row in rows if row[0] in reproduced])
        self._track(k, f"{rerun}_NOT_REPRODUCIBLE", [row for row in rows if row[0] not in reproduced])

    # --- report_stats ------------------------------------------------------------------------
    def _record_stats(self, first, second, iteration: int) -> None:
        for r in range(len(first)):
            if first[r, 0] > 0:
                self.stats["loss"].record(compare(float(first[r, 1]), float(second[r, 1])))
            self.stats["gradient norm"].record(compare(float(first[r, 2]), float(second[r, 2])))
        if (iteration + 1) % REPORT_INTERVAL == 0 and (not dist.is_initialized() or dist.get_rank() == 0):
            self.log("Stats on computation determinism (each iteration computed twice, --rerun-mode report_stats):")
            for name, stats in self.stats.items():
                self.log(f"  {name}: {stats.line()}")


def _flags(values) -> torch.Tensor:
    """``[world, 2]`` non-finite flags (loss, gradient norm) for :func:`describe`."""
    loss_bad = [(1.0 if v[0] > 0 and not math.isfinite(float(v[1])) else 0.0) for v in values]
    grad_bad = [(0.0 if math.isfinite(float(v[2])) else 1.0) for v in values]
    return torch.tensor([loss_bad, grad_bad], dtype=torch.float32).T


def _rejected(values) -> list[int]:
    flags = _flags(values)
    return [r for r in range(len(values)) if flags[r].any() or values[r, 3] > 0]


def _same(values, again, r: int, c: int) -> bool:
    """Whether rank ``r``'s column ``c`` (1: loss, 2: gradient norm) reproduced within
    Megatron-LM's tolerance for it."""
    tolerance = LOSS_TOLERANCE if c == 1 else GRAD_NORM_TOLERANCE
    return compare(float(values[r, c]), float(again[r, c])) <= tolerance


def _reproduced(initial, again, injected: Optional[str], where: str) -> bool:
    """Whether a rank's rerun reproduced its rejected result; an injected error decides as
    Megatron-LM's injector does (a transient one differs in place, a persistent one elsewhere)."""
    if injected is not None:
        return not (injected == "transient_error" if where == "in_place" else injected == "persistent_error")
    same_loss = initial[0] == 0 or compare(float(initial[1]), float(again[1])) <= LOSS_TOLERANCE
    return same_loss and compare(float(initial[2]), float(again[2])) <= GRAD_NORM_TOLERANCE


def _injected_names(injected: dict) -> str:
    kinds = " and ".join(sorted({t.replace("_", " ") for t in injected.values()}))
    return f"{kinds} on {ranks_text(sorted(injected))}"


def _places(places: list, ranks: list[int]) -> str:
    return ", ".join(f"rank {r}: node {places[r][0]} device {places[r][1]}" for r in ranks)


def _rng_state():
    from megatron_integration.checkpoint import get_rng_state

    return get_rng_state()


def _set_rng_state(state) -> None:
    from megatron_integration.checkpoint import set_rng_state

    set_rng_state(state)

