"""The local broker's ports: its controller listens on the port after the client's, so a free client port alone is
not enough (a CI run once lost `gpupool up` to Kafka exiting with 1 on a taken controller port)."""
from __future__ import annotations

import socket

import pytest

from infra import kafka_local


def _listen(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_a_run_of_free_ports_is_free_end_to_end():
    p = kafka_local.free_port_run(3)
    assert all(kafka_local.port_free(p + k) for k in range(6))


def test_a_listener_port_is_picked_below_the_ephemeral_range():
    """Outgoing connections take their local ports from the kernel's ephemeral range; a listener's port picked
    there may be taken before the listener binds it. Ours are picked below it, and free."""
    lo, _ = kafka_local.ephemeral_range()
    ports = {kafka_local.free_port() for _ in range(50)}
    assert all(kafka_local.LISTEN_FLOOR <= p < lo and kafka_local.port_free(p) for p in ports), sorted(ports)
    assert len(ports) > 1  # picked at random, not one port for every caller


def test_a_port_someone_listens_on_is_not_free():
    held = _listen(0)
    try:
        assert not kafka_local.port_free(held.getsockname()[1])
    finally:
        held.close()


@pytest.mark.broker  # launches Kafka's java (to see it fail)
def test_start_names_the_taken_controller_port_before_launching_java(tmp_path, monkeypatch):
    p = kafka_local.free_port_run()
    held = _listen(p + 1)  # someone else's listener on the controller port
    launched = []
    monkeypatch.setattr(kafka_local.LocalBroker, "launch", lambda self, cluster_id=None: launched.append(1))
    try:
        broker = kafka_local.LocalBroker(libs=tmp_path / "libs", data=tmp_path / "data", port=p)
        with pytest.raises(RuntimeError, match=rf"port\(s\) \[{p + 1}\] are held"):
            broker.start()
    finally:
        held.close()
    assert not launched


@pytest.mark.broker  # launches Kafka's java (to see it fail)
def test_a_broker_that_exits_is_reported_with_what_its_log_said(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    (data / "broker.log").write_text("INFO starting\nERROR [KafkaServer] Address already in use\nINFO shut down\n")

    class Exited:
        returncode = 1

        def poll(self):
            return 1

    monkeypatch.setattr(kafka_local.LocalBroker, "launch", lambda self, cluster_id=None: Exited())
    broker = kafka_local.LocalBroker(libs=tmp_path / "libs", data=data, port=kafka_local.free_port_run())
    with pytest.raises(RuntimeError, match="Kafka exited with 1") as err:
        broker.start(timeout=5)
    assert "Address already in use" in str(err.value) and "INFO starting" not in str(err.value)
