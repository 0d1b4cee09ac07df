"""Waiting for the head of a cluster at an address that this process lost (``ray_head``),
against real sockets: a GCS address nothing listens on, and one that starts listening."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from tests.net import free_port
from trainer_core.errors import InfrastructureError, SpecError
from trainer_core.execution import ray_address, ray_head


@pytest.fixture
def lost(monkeypatch):
    """This process lost the head of the cluster at ``head:6379``, its GCS at a free loopback
    port; returns that port."""
    port = free_port()
    monkeypatch.setattr(ray_head, "_lost_address", ("head:6379", f"127.0.0.1:{port}"))
    return port


def test_a_lost_head_that_never_answers_fails_on_the_infrastructure_budget_naming_it(
    lost, monkeypatch, caplog
):
    monkeypatch.setenv(ray_address.HEAD_WAIT_ENV, "1")
    with (
        caplog.at_level(logging.WARNING, "relaytrain.engine"),
        pytest.raises(InfrastructureError) as raised,
    ):
        ray_head.await_head("head:6379", poll_s=0.2)
    message = str(raised.value)
    assert "the Ray cluster at head:6379" in message and f"127.0.0.1:{lost}" in message
    assert ray_address.HEAD_WAIT_ENV in message  # the fix: wait longer
    assert "waiting up to 1 s (RELAYTRAIN_RAY_HEAD_WAIT_S)" in caplog.text


def test_a_lost_head_that_answers_again_is_waited_for(lost, monkeypatch, caplog):
    monkeypatch.setenv(ray_address.HEAD_WAIT_ENV, "60")
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def come_back() -> None:
        time.sleep(1.0)
        server.bind(("127.0.0.1", lost))
        server.listen()

    back = threading.Thread(target=come_back)
    back.start()
    try:
        with caplog.at_level(logging.WARNING, "relaytrain.engine"):
            ray_head.await_head("head:6379", poll_s=0.2)  # returns: no error
        back.join()
        assert "does not answer (its head restarting?)" in caplog.text  # it did wait
    finally:
        back.join()
        server.close()


def test_a_first_contact_where_no_cluster_answers_is_refused_naming_the_fix(lost, monkeypatch):
    """Another address than the lost one is a first contact: where nothing accepts connections
    it is refused (a SpecError, no retry) after ``first_contact_s``, not waited for as a lost
    head (``RELAYTRAIN_RAY_HEAD_WAIT_S``, 60 s here), nor retried by ``ray.init`` for minutes."""
    monkeypatch.setenv(ray_address.HEAD_WAIT_ENV, "60")
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(SpecError) as raised:
        ray_head.await_head(dead, poll_s=0.2, first_contact_s=1)
    message = str(raised.value)
    assert f"no Ray cluster answers at RAY_ADDRESS={dead!r}" in message, message
    assert "ray start --head" in message and "unset it" in message
    assert raised.value.budget == "none"


def test_an_address_that_is_no_address_is_refused_at_once():
    with pytest.raises(SpecError) as raised:
        ray_head.await_head("not an address", first_contact_s=30)
    assert "RAY_ADDRESS='not an address' is not the address of a Ray cluster" in str(raised.value)
