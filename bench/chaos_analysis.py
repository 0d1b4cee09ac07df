"""The chaos campaign's analysis: what the run left, judged against the uninterrupted run and
against the faults that were injected, and the campaign's figures.

``verdict`` reads the run directory (attempt records, checkpoints, metrics history) and the
campaign's record of its faults; each worker group that failed is charged to the faults in the
``EFFECT_S`` before it, and must have drawn on a budget that one of them calls for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Any

from bench import common
from bench.chaos_faults import KEEP_LAST, Campaign
from bench.chaos_kinds import KINDS, Fault
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.execution import cluster
from trainer_core.run import attempts
from trainer_core.run.attempts import AttemptRecord
from trainer_core.run.summary import attempt_summaries, steps_computed

#: The budgets a failure that ``kind`` causes may draw on. A drain whose notice the loop does
#: not see in time fails like a node loss; an outage the storage retries ride out fails nothing.
EXPECTED_BUDGETS: dict[str, set[str]] = {
    "worker_kill": {"infrastructure"},
    "node_kill": {"infrastructure"},
    "drain": {"preemption", "infrastructure"},
    "flow_kill": {"infrastructure"},  # DriverLost: killed between two attempts
    "second_flow": set(),
    "s3_outage": {"infrastructure"},
    "s3_slow": set(),  # storage slow, not gone: nothing may fail of it
    "corrupt": set(),
    "prefect_outage": set(),  # the orchestrator away: training goes on, nothing may fail of it
    # StorageFullError, not retried: the flow fails, and is run again; DriverLost on the
    # infrastructure budget when the store was still full as the train task closed the record
    "disk_full": {"none", "infrastructure"},
    # the job went with the old head: the new one's job server no longer knows it
    "head_restart": {"infrastructure"},
    # DataFileDamagedError, not retried: the flow fails, and is run again once it is restored
    "data_damaged": {"none"},
}
#: The failures on no budget that a fault may cause: a full store's, a damaged data file's.
NOT_RETRIED = {"StorageFullError", "DataFileDamagedError"}


def failures(records: list[AttemptRecord]) -> list[dict[str, Any]]:
    """Every worker group that ended by failing: when, on which budget, and when the next group
    resumed (None if none did)."""
    found = []
    for index, record in enumerate(records):
        for restart in record.restarts:
            if restart.get("reason") in ("capacity", None) or "failed_at" not in restart:
                continue
            found.append(
                {
                    "at": restart["failed_at"],
                    "budget": restart["reason"],
                    "error_class": restart.get("error_class"),
                    "resumed_at": restart.get("resumed_at"),
                    "resumed_from_step": restart.get("resumed_from_step"),
                    "restore_s": restart.get("restore_s"),
                    "checkpoint_created_at": restart.get("checkpoint_created_at"),
                }
            )
        if record.status == "failed":
            following = records[index + 1] if index + 1 < len(records) else None
            restore = (following.restore if following else None) or {}
            found.append(
                {
                    "at": record.ended_at or record.started_at,
                    "budget": record.error_budget,
                    "error_class": record.error_class,
                    "resumed_at": following.resumed_at if following else None,
                    "resumed_from_step": following.resumed_from_step if following else None,
                    "restore_s": restore.get("restore_s"),
                    "checkpoint_created_at": restore.get("checkpoint_created_at"),
                    # when the attempt is known to have run (DriverLost: no ended_at); the
                    # next one's start is when its driver opened its record (``recovery``)
                    "between": (record.started_at, following.started_at if following else None),
                }
            )
    return sorted(found, key=lambda f: f["at"])


def place_lost_drivers(found: list[dict[str, Any]], flow_exits: list[float]) -> None:
    """A DriverLost attempt (its record closed by a later launch, no ``ended_at``) ended when
    its flow went: the last flow exit the campaign caused (a kill, a full store's failure)
    between its start and the next attempt's."""
    for failure in found:
        if failure["error_class"] != "DriverLost":
            continue
        began, until = failure["between"]
        ends = [t for t in flow_exits if (began or 0) <= t <= (until or float("inf"))]
        if ends:
            failure["at"] = max(ends)
    found.sort(key=lambda f: f["at"])


#: How long after a fault a failure may still be its doing: a drain's deadline (10 s), an
#: outage's length and the storage retries after it, the detection of a death.
EFFECT_S = 30.0


def attribute(faults: list[Fault], failure: dict[str, Any]) -> list[Fault]:
    """The faults a failure may answer, newest first: those in the ``EFFECT_S`` before it (a
    second of clock slack), or before their end (``back_at``: a head lost until a new one
    answered). Overlapping faults blur the cause: a worker killed while a node drains is
    charged to the preemption, by design (the survivors of a preemption fail first). A damaged
    data file stays damaged until it is restored: a failure of one answers the newest damage
    before it, however long before (its rows are met when they are read again)."""
    causes = [
        f
        for f in reversed(faults)
        if failure["at"] - EFFECT_S <= f.detail.get("back_at", f.at)
        and f.at <= failure["at"] + 1.0
        and f.kind not in ("corrupt", "data_damaged")  # met when read: below
    ]
    if failure.get("error_class") == "DataFileDamagedError":
        damage = [f for f in faults if f.kind == "data_damaged" and f.at <= failure["at"] + 1.0]
        causes = damage[-1:] if damage else []
    return causes


def in_effect(faults: list[Fault], proxy_events: list[tuple[float, str]]) -> list[Fault]:
    """The faults at the time each took effect, oldest first. An outage armed for the next
    checkpoint upload begins when that upload is cut, which can be long after it was armed (the
    group was down, or the flow killed and run again); one never cut stays where it was armed.
    One outage is armed at a time, so the first cut after its arming is its own."""
    cuts = sorted(t for t, what in proxy_events if what.startswith("cut on"))
    placed = []
    for fault in faults:
        if fault.kind == "s3_outage" and fault.detail.get("when") == "the next checkpoint upload":
            cut = next((t for t in cuts if t >= fault.at), None)
            if cut is not None:
                fault = dataclasses.replace(fault, at=cut)
        placed.append(fault)
    return sorted(placed, key=lambda f: f.at)


def verdict(
    campaign: Campaign, run_dir: RunDirectory, reference_dir: RunDirectory
) -> dict[str, Any]:
    """The checks (``problems``: empty when everything held) and the figures."""
    records = attempts.read(run_dir)
    found = failures(records)
    kills = [f.at for f in campaign.faults if f.kind == "flow_kill"]
    place_lost_drivers(found, kills + [e["at"] for e in campaign.full_store_exits])
    effective = in_effect(campaign.faults, campaign.proxy.events)
    causes_problems, per_kind = judge_failures(campaign.faults, effective, found)
    problems = [
        *outcome_problems(campaign, records, run_dir, reference_dir),
        *causes_problems,
        *flow_problems(campaign),
    ]
    return {
        "problems": problems,
        "figures": figures(campaign, records, found, effective, per_kind),
        "attempts": [
            {k: getattr(r, k) for k in ATTEMPT_FIELDS} | {"restarts": len(r.restarts)}
            for r in records
        ],
    }


#: What the result keeps of each attempt record (to read a failed check back).
ATTEMPT_FIELDS = (
    "attempt",
    "status",
    "started_at",
    "ended_at",
    "resumed_from_step",
    "last_step",
    "error_class",
    "error_budget",
)


def outcome_problems(
    campaign: Campaign,
    records: list[AttemptRecord],
    run_dir: RunDirectory,
    reference_dir: RunDirectory,
) -> list[str]:
    """The run against what it must end as: completed without failing on its own, the
    uninterrupted run's final state and metrics history, and every commit that retention did
    not drop still there."""
    from tests.recovery import assert_same_tensors, final_state, losses

    problems: list[str] = []
    if not records or records[-1].status != "completed":
        problems.append(f"the run did not complete: {[r.status for r in records]}")
    if campaign.unexpected_exits:
        problems.append(f"the flow failed without a fault's kill: {campaign.unexpected_exits}")
    try:
        assert_same_tensors(final_state(run_dir), final_state(reference_dir))
    except AssertionError as e:
        problems.append(f"final state differs from the uninterrupted run's: {e}")
    history, expected = losses(run_dir), losses(reference_dir)
    steps = [step for step, _ in history]
    if steps != list(range(1, campaign.steps + 1)):
        problems.append(f"metrics history steps are not 1..{campaign.steps} once each")
    elif history != expected:
        problems.append("metrics history losses differ from the uninterrupted run's")
    kept = {c.step for c in run_dir.scan().committed}
    must_keep = set(sorted(campaign.committed_seen | kept)[-KEEP_LAST:])
    if not must_keep <= kept:
        problems.append(f"committed checkpoints lost: kept {sorted(kept)}, newest {must_keep}")
    return problems


#: A recovery's phases (``common.recovery_phases``), from a fault to the next worker group's
#: resume: until the group was known to have failed (its attempt's record closed, or its
#: restart in place begun), until the next attempt's driver opened its record (a Prefect
#: retry, or the flow run again; none in place), until its workers had resumed.
PHASES = ("detect_s", "relaunch_s", "start_s")


def recovery(failure: dict[str, Any], fault: Fault) -> dict[str, float]:
    """A resumed failure's recovery from ``fault``: its seconds in all and by phase. A failure
    may be charged to a fault up to a second after it (clock slack): known at the fault then."""
    known = max(failure["at"], fault.at)
    _, next_started = failure.get("between", (None, None))
    return {
        "recovery_s": failure["resumed_at"] - fault.at,
        **common.recovery_phases(fault.at, known, next_started or known, failure["resumed_at"]),
    }


def judge_failures(
    faults: list[Fault], effective: list[Fault], found: list[dict[str, Any]]
) -> tuple[list[str], dict[str, list[dict[str, float]]]]:
    """Each failure against the faults that may have caused it (``effective``: placed when they
    took effect): one came before it, one of them calls for its budget, and its resume did not
    read a damaged checkpoint. The problems, and the recoveries (``recovery``) by the kind of
    each failure's newest cause."""
    corrupted = {(f.detail["step"], f.at) for f in faults if f.kind == "corrupt"}
    problems: list[str] = []
    per_kind: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    for failure in found:
        causes = attribute(effective, failure)
        if not causes:
            problems.append(f"a failure with no fault in the {EFFECT_S:g} s before it: {failure}")
            continue
        if not any(failure["budget"] in EXPECTED_BUDGETS[f.kind] for f in causes):
            problems.append(
                f"{[f.kind for f in causes]} at {causes[0].at:.1f} was followed by a failure on "
                f"the {failure['budget']} budget ({failure['error_class']})"
            )
        # the failures on no budget a fault may cause: a full store's, a damaged file's
        if failure["budget"] == "none" and failure["error_class"] not in NOT_RETRIED:
            problems.append(f"a failure no fault explains, not retried: {failure}")
        fault = causes[0]
        if failure["resumed_at"] is not None:
            per_kind[fault.kind].append(recovery(failure, fault))
        for step, at in corrupted:
            # an attempt that failed before its workers resumed holds the planned step only
            if failure["resumed_from_step"] == step and read_damaged(failure, at):
                problems.append(f"a resume read the damaged checkpoint of step {step}")
    return problems, per_kind


def read_damaged(failure: dict[str, Any], damaged_at: float) -> bool:
    """Whether the resume after ``failure`` read the damaged checkpoint of its step: it began
    reading after ``damaged_at`` (its workers loaded it, ``resumed_at``, ``restore_s`` after
    they began), a checkpoint written before it. A resume that began before (a group that
    resumed, then failed after the damage; its resume heard late) read the checkpoint whole,
    as the final state's comparison proves; one that read the step written again (a resume
    fell past the damaged one and trained the step anew) read the new commit. Where the
    record does not say when its checkpoint was written, the step alone judges."""
    if failure["resumed_at"] is None:
        return False
    written = failure.get("checkpoint_created_at")
    if written is not None and written > damaged_at:
        return False
    return failure["resumed_at"] - (failure.get("restore_s") or 0.0) > damaged_at


def flow_problems(campaign: Campaign) -> list[str]:
    """Every second flow refused by the lease, every failure of a full store named as one, and
    every fault injected before the run ended."""
    problems = []
    for _, process, log in campaign.second_flows:
        code = process.poll()
        text = log.read_text()
        if code != 2 or ("LeaseHeldError" not in text and "is held by" not in text):
            problems.append(f"a second flow was not refused by the lease: exit {code}, {log}")
    for exit in campaign.full_store_exits:
        text = (campaign.workdir / exit["log"]).read_text()
        if "storage is full" not in text or "run.storage" not in text:
            problems.append(f"a flow failed of a full store without saying so: {exit}")
    damaged = [f.detail for f in campaign.faults if f.kind == "data_damaged"]
    for exit, detail in zip(campaign.damaged_exits, damaged, strict=False):
        text = (campaign.workdir / exit["log"]).read_text()
        if detail["file"] not in text or f"row group {detail['row_group']}" not in text:
            problems.append(f"a flow failed of a damaged file without naming it: {exit}")
    if len(campaign.damaged_exits) != len(damaged):
        problems.append(
            f"{len(damaged)} data files damaged, {len(campaign.damaged_exits)} failed the flow: "
            "a damaged page was never read, or failed it as something else"
        )
    if campaign.pending:
        problems.append(f"the run ended before these faults came: {campaign.pending}")
    return problems


def figures(
    campaign: Campaign,
    records: list[AttemptRecord],
    found: list[dict[str, Any]],
    effective: list[Fault],
    per_kind: dict[str, list[dict[str, float]]],
) -> dict[str, Any]:
    """Goodput, what the faults did to the worker groups, and per kind the recoveries (their
    medians in all and by phase); where the recovery seconds went, summed by phase."""
    computed = steps_computed(attempt_summaries(records))
    recoveries = [r for values in per_kind.values() for r in values]
    return {
        "faults": len(campaign.faults),
        "faults_by_kind": {k: sum(f.kind == k for f in campaign.faults) for k in KINDS},
        "steps": campaign.steps,
        "steps_computed": computed,
        "goodput": round(campaign.steps / computed, 4) if computed else None,
        "attempts": len(records),
        "restarts_in_place": sum(len(r.restarts) for r in records),
        "failures": len(found),
        "faults_during_recovery": _during_recovery(effective, found),
        "checkpoint_uploads_cut": sum(
            1 for _, what in campaign.proxy.events if what.startswith("cut on")
        ),
        "flow_launches": campaign.launches,
        "flow_failed_of_full_store": len(campaign.full_store_exits),
        "flow_failed_of_damaged_data": len(campaign.damaged_exits),
        "recovery_phases_s": {p: round(sum(r[p] for r in recoveries), 1) for p in PHASES},
        "recovery_s_by_kind": {
            kind: {
                "count": sum(f.kind == kind for f in campaign.faults),
                "restarts_caused": len(values),
                **{f"median_{p}": _median(values, p) for p in ("recovery_s", *PHASES)},
            }
            for kind, values in per_kind.items()
        },
    }


def _median(recoveries: list[dict[str, float]], phase: str) -> float | None:
    return round(statistics.median(r[phase] for r in recoveries), 1) if recoveries else None


def _during_recovery(faults: list[Fault], found: list[dict[str, Any]]) -> int:
    """Faults that arrived while a worker group was failing over (failure to resume)."""
    windows = [(f["at"], f["resumed_at"]) for f in found if f["resumed_at"]]
    return sum(1 for fault in faults if any(a < fault.at < b for a, b in windows))


def stuck(chaos: Campaign) -> str:
    """What the run under faults was doing (when it ``Overran``): the faults so far, its
    attempts, Ray's jobs and placement groups, and the flow's log without Ray's own lines."""
    from ray.util.state import list_placement_groups

    address = chaos.cluster.job_address
    faults = [(f.kind, time.strftime("%H:%M:%S", time.localtime(f.at))) for f in chaos.faults]
    parts = [f"faults: {faults}"]
    with contextlib.suppress(Exception):
        records = [
            (a["attempt"], a.get("status"), a.get("last_step"), a.get("error_class"))
            for a in chaos.run_dir.read_attempts()
        ]
        parts.append(f"attempts (number, status, last step, error): {records}")
    with contextlib.suppress(Exception):
        jobs = cluster.job_submission_client(address).list_jobs()
        parts.append(f"jobs: {[(j.submission_id, j.status.value) for j in jobs]}")
    with contextlib.suppress(Exception):
        groups = list_placement_groups(address=address, limit=100)
        parts.append(f"placement groups: {[(g.placement_group_id[:8], g.state) for g in groups]}")
    parts.append("flow log:\n" + "\n".join(chaos.own_lines(60)))
    return "\n".join(parts)
