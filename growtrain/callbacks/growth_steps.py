"""The two halves of ``GrowUntilSaturated``'s work, one per kind of schedule (mixins of the callback,
kept apart so each file reads as one job; growth.py holds what every schedule shares):

* ``StageChecks`` — a converged or periodic check: measure (one probe pass), decide (the decision's
  verdict, then the budgets), act (editor), and the rate around it;
* ``RunParts`` — what a budget's or a plan's part (budget.BudgetRun, scheduled.PlanRun) calls back:
  insert, measure the function's change, record a decision or a planned growth, the end of the fit.
"""

from __future__ import annotations

from typing import Any, Callable

import torch  # noqa: F401  (annotations)
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from growtrain import schedule_rules
from growtrain.callbacks import editor, fork_check, guidance, probe_check, telemetry
from growtrain.callbacks.anneal import schedulers_of
from growtrain.callbacks.budget import BudgetRun
from growtrain.callbacks.probe_data import Converted, first_input
from growtrain.callbacks.schedule import steps_per_epoch
from growtrain.plots import outcome
from growtrain.saturation import SaturationReport

__all__ = ["StageChecks", "RunParts"]


class StageChecks:
    """A converged or periodic schedule's check, on the callback's state."""

    def _resolve_lr_schedule(self, trainer: Trainer) -> None:
        """``lr_schedule=None`` under the converged schedule: ``"anneal"`` — each stage, once its
        monitor has plateaued, is cosine-annealed before the check, so a trial block (itself trained
        with a cosine to zero) is not credited with what annealing the network alone would give —
        unless the network's optimizer has a scheduler of its own, which would fight it: then
        ``"continue"``, said once."""
        schedulers = schedulers_of(trainer, editor.optimizer_for(trainer, self._network))
        resolved = "continue" if schedulers else "anneal"
        if schedulers:
            rank_zero_warn(
                f"GrowUntilSaturated: lr_schedule: the network's optimizer has a scheduler ({', '.join(schedulers)}), so "
                "the default lr_schedule is 'continue': each check runs at the rate your schedule has then, not on an "
                "annealed stage, and a trial block trained with its own anneal may be credited with what annealing "
                "gives. Fix: return no lr_scheduler from configure_optimizers (lr_schedule='anneal' then anneals each "
                "stage before its check), or pass lr_schedule='continue' to keep your schedule.", category=UserWarning)
        self._schedule.lr_schedule = resolved  # the one resolved value (lr_schedule reads it); the config keeps None

    def _horizon_steps(self, trainer: Trainer) -> int | None:
        """Optimizer steps from one check to the next (the fork's horizon)."""
        when = self.schedule  # a stage fork runs under a Periodic schedule only
        if when.min_steps_between_checks is not None:
            return int(when.min_steps_between_checks)
        per_epoch = steps_per_epoch(trainer)
        return None if per_epoch is None else per_epoch * when.every_n_epochs

    def _budget_reason(self, trainer: Trainer | None = None) -> str | None:
        return schedule_rules.budget_reason(growths=self.growths, max_growths=self.max_growths) or (
            self._final_reserved(trainer) if trainer is not None else None)

    def _final_reserved(self, trainer: Trainer) -> str | None:
        return self._schedule.reserved(trainer, self.finished)

    def _check(self, trainer: Trainer, pl_module: LightningModule, annealed: bool = False) -> str:
        """One check, on a fork of the random number generators (probe_check.forked_rng says why);
        candidate blocks have their own seed (``seed``)."""
        with probe_check.forked_rng(trainer, next(self._network.parameters()).device):
            return self._check_unforked(trainer, pl_module, annealed)

    def _check_unforked(self, trainer: Trainer, pl_module: LightningModule, annealed: bool = False) -> str:
        """Measure (one probe pass), decide (the decision's verdict, then the budgets), act (editor)."""
        network = self._network
        self._schedule.checked(trainer.global_step)
        depth, params = self._depth(network), telemetry.count_params(network)
        record: dict[str, Any] = {
            "check": self.checks, "epoch": trainer.current_epoch, "step": trainer.global_step,
            "depth_before": depth, "params_before": params, "level": None,
        }  # fmt: skip
        if annealed:
            record["annealed"] = True
        blocked = self._budget_reason(trainer)
        report, sites, certified = None, [], False
        opened = None
        if blocked is not None:  # known before probing: save the probe
            action, reason = "budget", blocked
        else:
            report = self._measure(trainer, pl_module, network)
            record["level"] = self.alpha
            verdict, ranked, entry = self._decider.judge(probe_check.CheckInputs(
                trainer, pl_module, network, report, self._probe_loader(trainer, shard=False), self._loss, self.alpha,
                record["check"]))  # fmt: skip
            if entry is not None:
                record[self._decider.key] = entry
            if self._fork is not None and entry.get("open_new"):  # no fork was open: open one, decide nothing
                opened = entry["open_new"] if isinstance(entry["open_new"], str) else self._fork.first_sites(report)
                action, reason, sites = "fork", f"{verdict.reason} (at {opened})", []
            else:
                action, reason, sites = schedule_rules.decide_growth(
                    saturated=verdict.saturated, ranked=ranked, reason=verdict.reason, growths=self.growths,
                    max_growths=self.max_growths)  # fmt: skip
            certified = verdict.certified  # only where the verdict's upper bound was below its margin
        if action == "grow":
            record.update(self._grow(trainer, pl_module, network, report, sites))
            if self._fork is not None:  # the run takes the arm (its training is kept), then forks again
                self._fork.adopt(network, editor.optimizer_for(trainer, network))
                if schedule_rules.budget_reason(growths=self.growths, max_growths=self.max_growths) is None:
                    opened = self._fork.first_sites(self._measure(trainer, pl_module, network))
        elif action != "fork":
            if self._fork is not None:
                self._fork.close()
            self._finish(trainer, action, reason, annealed, certified)
        if opened is not None:
            self._fork.open(pl_module, network, editor.optimizer_for(trainer, network), opened,
                            epoch=trainer.current_epoch, step=trainer.global_step)
            record.setdefault("fork", {})["next_site"] = opened
        record.update(telemetry.check_record(report, action, reason, sites, network, self._depth(network),
                                             certified=certified))  # fmt: skip
        if isinstance(record.get("verdicts"), dict) and self._decider.key in record:
            record["verdicts"][self._decider.key] = record[self._decider.key]
        self.history.append(telemetry.plain(record))
        self._emit(trainer, report, record)
        return action

    def _finish(self, trainer: Trainer, why: str, reason: str, annealed: bool = False, certified: bool = False) -> None:
        """Growth has ended: stop, continue at this depth, or start the final anneal (unless the
        stage anneal before this check already annealed the final network)."""
        self.finished, self.stop_reason = why, reason
        words = outcome({"action": why, "certified": certified})  # never "saturated" for an uncertified stop
        if self.on_saturated == "anneal" and annealed:
            trainer.should_stop = True
            rank_zero_info(f"GrowUntilSaturated: growth ended ({words}) on the annealed network; stopping")
        elif self.on_saturated == "anneal":
            if self._anneal.start(editor.optimizer_for(trainer, self._network), "final"):
                rank_zero_info(f"GrowUntilSaturated: growth ended ({words}); annealing the learning rate to 0 over "
                               f"{self.schedule.anneal_epochs} epoch(s), then stopping")  # fmt: skip
        elif why == "saturated" and self.on_saturated == "stop":
            trainer.should_stop = True
            rank_zero_info(f"GrowUntilSaturated: stopping training at epoch {trainer.current_epoch}: {reason}")

    def _grow(self, trainer: Trainer, pl_module: LightningModule, network: nn.Module, report: SaturationReport,
              sites: list[str]) -> dict:  # fmt: skip
        """Insert the scored candidates (the network editor: editor.py), then start the new stage."""
        x = first_input(Converted(self._probe_loader(trainer), trainer))
        done = editor.grow(trainer, pl_module, network, {name: report.record(name).block for name in sites}, x,
                           rewrap=editor.rewrap_ddp)
        if done.pop("restart") and self.lr_schedule == "restart":
            self.restart_pending = True
        self.inserted += len(done["growth_index"])
        self.growths += 1
        self._schedule.new_stage()
        return done


class RunParts:
    """What a budget's or a plan's part calls on the callback: one insertion path, one
    function-preservation check, one history record per decision or growth."""

    def _driven_end(self, trainer: Trainer, path: str, written: bool) -> None:
        """The end of a budget's or a plan's fit: what it did in one summary (rank 0), and a warning where
        it did nothing or the budget's network was handed over un-annealed (budget.BudgetRun.fit_end)."""
        budget = self._run.fit_end(trainer) if isinstance(self._run, BudgetRun) else None
        if not self.history:
            what = ("no budget decision opened: the fit ended before the first decision point "
                    f"({100 * self.schedule.growth_phase / self.schedule.checks:.0f} % of the budget)"
                    if isinstance(self._run, BudgetRun) else "no point of the plan was reached before the fit ended")
            rank_zero_warn(f"GrowUntilSaturated: {what}; the network was not grown. Fix: let the fit run to its "
                           "max_steps/max_epochs, or place the points earlier.", category=UserWarning)  # fmt: skip
        if self.verbose and trainer.is_global_zero:
            depth = self._depth(self._network)
            why = {None: "growth had not ended when the fit stopped", "saturated": (
                "certified that one more block does not pay" if self.history and self.history[-1].get("certified")
                else "one more block was not certified to pay"), "budget": "growth ended: " + str(self.stop_reason)}
            lines = [f"GrowUntilSaturated ({self.schedule.kind} schedule): depth {self.start_depth} → {depth}; "
                     f"{why.get(self.finished, self.finished)}", *([budget] if budget else []),
                     f"checks and forks: {self.check_seconds:.1f} s of {self.fit_seconds:.1f} s of the fit",
                     *guidance.output_lines(trainer, history_path=path, history_written=written)]  # fmt: skip
            telemetry.print_renderable(trainer, "\n".join(lines), soft_wrap=True)

    def probe_loader(self, trainer: Trainer, shard: bool = True) -> Any:
        return self._probe_loader(trainer, shard)

    def add_seconds(self, seconds: float) -> None:
        """Wall time a budget's fork spent beside the run (the checks' share in the summary)."""
        self._decider.seconds += seconds

    def output_change(self, trainer: Trainer, pl_module: LightningModule, arm: nn.Module) -> tuple[float, float]:
        """``(change, tolerance)`` of a fork's arm against the run on the probe's first batch: measured,
        not assumed from the insertion's kind (editor.output_change)."""
        x = first_input(Converted(self._probe_loader(trainer, shard=False), trainer))
        before = fork_check.output_of(pl_module, self._network, x)
        return editor.output_change(before, fork_check.output_of(pl_module, self._network, x, module=arm))

    @staticmethod
    def output_of(trainer: Trainer, pl_module: LightningModule, network: nn.Module, x: Any) -> Any:
        return fork_check.output_of(pl_module, network, x)

    compare_outputs = staticmethod(editor.output_change)

    def insert(self, trainer: Trainer, pl_module: LightningModule, blocks: dict, x: Any = None) -> dict:
        """Insert zero-output ``blocks`` (editor.grow: checked, rolled back on failure, zero optimizer
        state, DDP re-wrapped); ``x``: the batch it is checked on (``None``: the probe's first)."""
        if x is None:
            x = first_input(Converted(self._probe_loader(trainer, shard=False), trainer))
        done = editor.grow(trainer, pl_module, self._network, blocks, x, rewrap=editor.rewrap_ddp)
        self.inserted += len(done["growth_index"])
        return done

    def decided(self, trainer: Trainer, pl_module: LightningModule, action: str, reason: str, sites: list[str],
                certified: bool, entry: dict, *, adopt: Callable[[], dict], last: bool) -> None:  # fmt: skip
        """A budget decision: the paper's Γ̂ against δ+t measured on the run beside it (one probe
        pass), the growth (``adopt``) or the end of growth, one history record, its metrics and lines."""
        network = self._network
        record: dict[str, Any] = {"check": self.checks, "epoch": trainer.current_epoch, "step": trainer.global_step,
                                  "depth_before": self._depth(network), "params_before": telemetry.count_params(network),
                                  "level": self.alpha}  # fmt: skip
        with probe_check.forked_rng(trainer, next(network.parameters()).device):
            report = self._measure(trainer, pl_module, network)
        if action == "grow":
            done = adopt()
            done.pop("restart", None)
            record.update(done)
            self.growths += 1
            if last or schedule_rules.budget_reason(growths=self.growths, max_growths=self.max_growths):
                self.finished = "budget"
                self.stop_reason = (schedule_rules.budget_reason(growths=self.growths, max_growths=self.max_growths)
                                    or f"the growth phase ended ({100 * self.schedule.growth_phase:.0f} % of the "
                                       "budget): the final network trains for the rest")  # fmt: skip
        else:
            self.finished, self.stop_reason = "saturated", reason
        record.update(telemetry.check_record(report, action, reason, sites, network, self._depth(network),
                                             certified=certified))  # fmt: skip
        record["budget"] = entry
        record["verdicts"]["budget"] = entry
        self.history.append(telemetry.plain(record))
        self._emit(trainer, report, record, table=False)
        if self.verbose:
            rank_zero_info(f"GrowUntilSaturated: decision {entry['decision'] + 1}: {reason}. {_paper_line(record)}")

    def planned(self, trainer: Trainer, sites: list[str], reason: str, entry: dict) -> None:
        """A plan's growth: one history record (the plan's figures under ``plan``), its metrics and line."""
        network = self._network
        depth = self._depth(network)
        record: dict[str, Any] = {"check": None, "epoch": trainer.current_epoch, "step": trainer.global_step,
                                  "depth_before": depth - len(entry["growth_index"]), "level": None}  # fmt: skip
        self.growths += 1
        record.update(telemetry.check_record(None, "grow", reason, sites, network, depth))
        record.update(function_preserving=entry["function_preserving"], growth_index=entry.pop("growth_index"),
                      plan=entry)  # fmt: skip
        self.history.append(telemetry.plain(record))
        self._emit(trainer, None, record, table=False)
        if self.verbose:
            rank_zero_info(f"GrowUntilSaturated: step {trainer.global_step}: {reason} → depth {depth}")

    compare_outputs = staticmethod(editor.output_change)


class _Seconds:
    """A budget's or a plan's stand-in for a decision object: the key its state is kept under in the
    callback's checkpoint and the wall time its forks spent (the run part itself keeps the rest)."""

    def __init__(self, key: str):
        self.key, self.seconds = key, 0.0


def _paper_line(record: dict) -> str:
    """The paper's first-order verdict beside a decision's: Γ̂_n against δ+t (or the rule's bound)."""
    gamma, threshold = record.get("gamma"), record.get("threshold")
    if gamma is None or threshold is None:
        return "The first-order probe did not run."
    above = "above" if gamma > threshold else "not above"
    return (f"The paper's test on the run: Γ̂_n = {gamma:.4g} {above} δ+t = {threshold:.4g} "
            f"(first-order rule {record.get('rule')!r}: {'unsaturated' if gamma > threshold else 'saturated'}).")
