"""How long ``relaytrain run`` waits for Prefect's embedded server to start."""

from __future__ import annotations

from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

from flows.embedded_server import DEFAULT_STARTUP_TIMEOUT_S, startup_timeout_s


def test_the_wait_is_longer_than_prefects_unless_the_user_set_it():
    # (Prefect read the environment at its import: the test session does not set it)
    prefects_own = PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
    assert startup_timeout_s() == DEFAULT_STARTUP_TIMEOUT_S > prefects_own
    # set in a profile or the environment, even to Prefect's default: the user's value
    for value in (prefects_own, 45):
        with temporary_settings(updates={PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: value}):
            assert startup_timeout_s() == value
