"""What an exception out of a user's own loop means to the orchestrator (user_loop.loop_error):
a collective that lost its peer is the infrastructure's, the loop's own exceptions its code's.
The peer failures are torch's own: a real gloo pair whose peer process exits, and torch's
distributed error types."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.unit.test_peer_failure import peer_death
from trainer_core.errors import InfrastructureError, InjectedFault, SpecError, TrainingCodeError
from trainer_core.train.user_loop import loop_error


def test_a_collective_whose_peer_exited_is_an_infrastructure_failure():
    error = peer_death()  # gloo: "Connection closed by peer", a plain RuntimeError
    classified = loop_error(error, report=3, rank=0)
    assert isinstance(classified, InfrastructureError) and classified.step == 3
    assert "Connection closed by peer" in str(classified)


@pytest.mark.parametrize(
    "error",
    [dist.DistBackendError("NCCL communicator was aborted on rank 1"), dist.DistStoreError("x")],
)
def test_torch_distributed_errors_are_infrastructure_failures(error):
    assert isinstance(loop_error(error, report=1, rank=1), InfrastructureError)


def test_the_loops_own_errors_stay_its_code_s_and_relaytrain_s_stay_as_they_are():
    code = loop_error(ValueError("bad shape"), report=5, rank=1)
    assert isinstance(code, TrainingCodeError)
    assert (code.error_type, code.step, code.rank) == ("ValueError", 5, 1)
    fault = loop_error(InjectedFault("injected"), report=2, rank=0)
    assert isinstance(fault, TrainingCodeError) and fault.error_type == "InjectedFault"
    spec_error = SpecError("no such file")
    assert loop_error(spec_error, report=2, rank=0) is spec_error
