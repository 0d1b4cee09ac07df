"""What must hold after a scenario, each a check of its own returning its violations (empty:
it held). The judgments come from outside relaytrain: the reference run's bits, the step each
fault was placed at, the files in storage read by their documented layout, the damage the
scenario did, the secrets it planted, the processes it started."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.adversary import departures, scoring
from tests.adversary.drive import Outcome, Player
from tests.adversary.reference import Reference, losses
from tests.adversary.verdict import Violation


def judge(
    player: Player, reference: Reference, secrets: list[str]
) -> tuple[list[str], list[Violation]]:
    """Every check on a played scenario: the names of those run, and what was violated. From
    the step where the run parted from its reference by a documented rule (``departures``),
    the final state is not judged and the losses only up to that step."""
    outcomes = player.outcomes
    moved = departures.parted(player)
    checks: dict[str, Callable[[], list[Violation]]] = {
        "commands_end_as_their_faults_call_for": lambda: commands(outcomes),
        "damage_spends_no_retry_and_deletes_nothing": lambda: damage_contained(outcomes),
        "final_state_is_the_references": lambda: final_state(player, reference),
        "one_row_per_step_each_the_references": lambda: history(player, reference, moved),
        "steps_lost_are_the_fault_steps": lambda: steps_lost(player),
        "the_best_checkpoint_verifies": lambda: best(player),
        "the_weights_score_what_their_checkpoints_record": lambda: scoring.scores(player),
        "exports_load_and_match": lambda: exports(player),
        "no_secret_in_storage": lambda: no_secrets(player, secrets),
        "no_process_left_running": lambda: processes(outcomes),
    }
    if moved is not None:
        del checks["final_state_is_the_references"]
    violations: list[Violation] = []
    for name, check in checks.items():
        try:
            violations += check()
        except Exception as e:  # a check that cannot read what it judges is a violation too
            violations.append(Violation(name, f"the check failed: {type(e).__name__}: {e}"))
    return list(checks), violations


def commands(outcomes: list[Outcome]) -> list[Violation]:
    found = []
    for o in outcomes:
        if o.hung:
            found.append(
                Violation(
                    "liveness",
                    f"{o.kind} (action {o.index}) was still running after the campaign's bound "
                    f"and was killed: {o.tail(8)}",
                )
            )
        elif o.expect == "ok" and o.code != 0:
            found.append(
                Violation("commands", f"{o.kind} (action {o.index}) exited {o.code}: {o.tail(12)}")
            )
        elif o.expect == "lease_refused" and o.code != 2:
            found.append(
                Violation(
                    "commands", f"a second flow exited {o.code}, not 2 (the lease): {o.tail(8)}"
                )
            )
        elif o.expect == "damaged_data":
            text = Path(o.log).read_text(errors="replace")
            if o.code == 0:
                found.append(
                    Violation(
                        "commands", f"a run over a damaged data page completed (action {o.index})"
                    )
                )
            elif "part-0" not in text or "row group" not in text:
                found.append(
                    Violation(
                        "commands",
                        "a damaged data file failed the run without naming the file and row "
                        f"group: {o.tail(8)}",
                    )
                )
        elif o.fault is not None and o.fault.kind == "lose_node":
            # The node is lost, not too small: what the command says while it waits must not
            # send the user to change a spec that ran (the spec's knobs: "Lower scaling...").
            text = Path(o.log).read_text(errors="replace")
            advice = [line for line in text.splitlines() if "lower scaling." in line.lower()]
            if advice:
                found.append(
                    Violation(
                        "commands",
                        "a lost node's wait told the user to change the spec that ran on it: "
                        f"{advice[0][-300:]}",
                    )
                )
        elif o.expect == "store_full" and o.code != 0:  # 0: it ended before it wrote again
            text = Path(o.log).read_text(errors="replace")
            if "run.storage" not in text or "full" not in text.lower():
                found.append(
                    Violation(
                        "commands",
                        f"a full store failed the run (exit {o.code}) without naming it and "
                        f"run.storage: {o.tail(8)}",
                    )
                )
    return found


def damage_contained(outcomes: list[Outcome]) -> list[Violation]:
    """A run stopped by what it cannot train past (a damaged data page, a full store) spends at
    most one attempt (none when setup's own read finds it) and no retry, and deletes no
    committed checkpoint, unless it committed newer ones from the rows before the damage (then
    retention keeps ``keep_last``, as after any commit)."""
    found = []
    for o in outcomes:
        if o.expect not in ("damaged_data", "store_full") or o.code == 0:
            continue
        what = "damaged data" if o.expect == "damaged_data" else "a full store"
        if o.attempts_after - o.attempts_before > 1:
            found.append(
                Violation(
                    "damage",
                    f"{what} took {o.attempts_after - o.attempts_before} attempts "
                    "(retries spent on it)",
                )
            )
        gone = sorted(set(o.committed_before) - set(o.committed_after))
        newer = [s for s in o.committed_after if s > max(o.committed_before, default=0)]
        if gone and not newer:  # with newer commits (steps before the damaged page), retention
            found.append(
                Violation(
                    "damage",
                    f"committed checkpoints {gone} deleted by a run that {what} stopped",
                )
            )
    return found


def final_state(player: Player, reference: Reference) -> list[Violation]:
    files = player.files
    committed = files.committed_steps()
    if not committed:
        return [Violation("final_state", "no committed checkpoint")]
    newest = committed[-1]
    found = []
    for name, expected in (("model.pt", reference.model), ("optimizer.pt", reference.optimizer)):
        got = files.tensors(newest, name)
        differences = differ(got, expected)
        if differences:
            found.append(
                Violation(
                    "final_state",
                    f"step {newest} {name} differs from the reference: {differences[:5]}",
                )
            )
    return found


def differ(a: Any, b: Any, where: str = "") -> list[str]:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or not torch.equal(a, b):
            return [where or "tensor"]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [d for k in a for d in differ(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differ(x, y, f"{where}[{i}]")
        ]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def history(player: Player, reference: Reference, upto: int | None = None) -> list[Violation]:
    """One row per step, the reference's steps, each loss the reference's (up to ``upto``:
    ``departures.parted``)."""
    got = losses(player.files)
    steps = [s for s, _ in got]
    found = []
    if len(steps) != len(set(steps)):
        found.append(Violation("history", "a step has more than one row"))
    expected = dict(reference.losses)
    if sorted(steps) != sorted(expected):
        missing = sorted(set(expected) - set(steps))[:10]
        extra = sorted(set(steps) - set(expected))[:10]
        found.append(Violation("history", f"steps missing {missing}, not in the reference {extra}"))
    wrong = [
        (s, loss, expected[s])
        for s, loss in got
        if s in expected and loss != expected[s] and (upto is None or s <= upto)
    ]
    if wrong:
        found.append(Violation("history", f"losses differ from the reference at {wrong[:5]}"))
    return found


def steps_lost(player: Player) -> list[Violation]:
    """Each placed raise or kill that fired: the failure it caused records the steps between
    the checkpoint it resumed from and the fault's step as lost (the fault fires as its step
    begins: ``step - 1 - resumed_from``). A raise ends its attempt; a kill is restarted in
    place, or ends its attempt where restarts in place are off (a lost node's scenario)."""
    summary = player.files.summary() or {}
    attempts = summary.get("attempts") or []
    found = []
    for o in player.outcomes:
        if o.fault_step is None or o.fault is None or o.fault_attempt is None:
            continue
        record = next((a for a in attempts if a["attempt"] == o.fault_attempt), None)
        if record is None:
            continue
        if o.fault.kind == "raise" or (record["status"] == "failed" and not record["restarts"]):
            failures = [record] if record["status"] == "failed" else []
            resumed = [a for a in attempts if a["attempt"] == o.fault_attempt + 1]
            pairs = (
                [(failures[0]["steps_lost"], resumed[0]["resumed_from_step"])]
                if failures and resumed
                else []
            )
        else:
            pairs = [
                (r["steps_lost"], r["resumed_from_step"]) for r in record.get("restarts") or []
            ][:1]
        if not pairs:
            found.append(
                Violation(
                    "steps_lost",
                    f"the {o.fault.kind} at step {o.fault_step} (attempt {o.fault_attempt}) "
                    "left no failure in the result",
                )
            )
            continue
        lost, resumed_from = pairs[0]
        if resumed_from is None or lost != o.fault_step - 1 - resumed_from:
            found.append(
                Violation(
                    "steps_lost",
                    f"the {o.fault.kind} at step {o.fault_step} resumed from {resumed_from}: "
                    f"recorded {lost} steps lost, not {o.fault_step - 1 - (resumed_from or 0)}",
                )
            )
    return found


def best(player: Player) -> list[Violation]:
    """The best checkpoint the result names is committed and verifies against its manifest
    (read here, not by relaytrain), and no verified checkpoint kept records a better metric."""
    files = player.files
    summary = files.summary()
    if summary is None or not summary.get("best_checkpoint_uri"):
        return []
    uri = summary["best_checkpoint_uri"].split("?")[0].rstrip("/")
    step = int(uri.rsplit("checkpoint-", 1)[-1])
    found = []
    if step not in files.committed_steps():
        return [Violation("best", f"the best checkpoint {step} is not committed")]
    if not files.verified(step):
        found.append(
            Violation("best", f"the best checkpoint {step} does not verify against its manifest")
        )
    metric = "val_loss" if player.scenario.shape.validation else "loss"
    recorded = {
        s: files.manifest(s).get("metrics", {}).get(metric)
        for s in files.committed_steps()
        if files.verified(s)
    }
    best_value = recorded.get(step)
    better = {
        s: v
        for s, v in recorded.items()
        if v is not None and best_value is not None and v < best_value
    }
    if better:
        found.append(
            Violation(
                "best",
                f"verified checkpoints {sorted(better)} record a lower {metric} than the best "
                f"{step} ({best_value})",
            )
        )
    return found


def exports(player: Player) -> list[Violation]:
    found = []
    for o in player.outcomes:
        if o.kind != "export" or o.code != 0:
            continue
        got = torch.load(o.detail["out"], weights_only=True)
        summary = o.detail.get("summary") or {}
        uri = (
            summary.get("best_checkpoint_uri")
            if "--best" in o.argv
            else summary.get("latest_checkpoint_uri")
        )
        if not uri:
            continue
        step = int(uri.split("?")[0].rstrip("/").rsplit("checkpoint-", 1)[-1])
        if step not in player.files.committed_steps():
            continue  # retention removed it since
        model = player.files.tensors(step, "model.pt")
        differences = differ(got, model)
        if differences:
            found.append(
                Violation(
                    "exports",
                    f"the export of {o.argv[-2]} is not checkpoint {step}'s model: "
                    f"{differences[:3]}",
                )
            )
    return found


def no_secrets(player: Player, secrets: list[str]) -> list[Violation]:
    found = []
    for name in player.files.every_file():
        data = player.files.read(name)
        for secret in secrets:
            if secret.encode() in data:
                found.append(
                    Violation("secrets", f"{name} holds a secret of the command's environment")
                )
    for o in player.outcomes:
        text = Path(o.log).read_text(errors="replace")
        for secret in secrets:
            if secret in text:
                found.append(
                    Violation(
                        "secrets", f"the output of {o.kind} (action {o.index}) shows a secret"
                    )
                )
    return found


def processes(outcomes: list[Outcome]) -> list[Violation]:
    return [
        Violation("processes", f"{o.kind} (action {o.index}) left running: {o.left_running}")
        for o in outcomes
        if o.left_running
    ]


def report(violations: list[Violation]) -> str:
    return json.dumps([v.as_dict() for v in violations], indent=1)
