"""What the broker tests share: `mqds broker` as a restartable process and a paho-mqtt client with bounded waits."""

from __future__ import annotations

import contextlib
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from harness import MQDS

from mqds.tools.ports import free_port
from mqds.tools.waiting import wait_until


class BrokerProcess:
    """`mqds broker` on a fixed port; restartable, so clients reconnect to the same address."""

    def __init__(self, workdir: Path, endpoints: str, hooks: Path | None, node: str) -> None:
        """``hooks``: the rules file; None runs the built-in rules (``DEFAULT_RULES``)."""
        self.port = free_port()
        self.workdir = workdir
        self.args = [
            MQDS,
            "broker",
            "--endpoints",
            endpoints,
            "--listen",
            f"127.0.0.1:{self.port}",
            *(["--hooks", str(hooks)] if hooks is not None else []),
            "--node",
            node,
            "--timeout",
            "20",
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0

    @property
    def out_path(self) -> Path:
        return self.workdir / f"broker-{self.runs}.out"

    def output(self) -> str:
        return self.out_path.read_text(errors="replace") if self.out_path.exists() else ""

    def start(self, timeout_s: float = 30) -> None:
        self.runs += 1
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        proc = self.proc

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"mqds broker exited with {proc.returncode}:\n{self.output()}")
            return "mqds broker: ready" in self.output()

        wait_until("mqds broker ready", ready, timeout_s)

    def stop(self, timeout_s: float = 30) -> str:
        """SIGTERM and wait: the clean stop; returns what it printed."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"mqds broker did not stop within {timeout_s}s:\n{self.output()}") from None
        out = self.output()
        assert code == 0, out
        return out

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    @contextlib.contextmanager
    def running(self) -> Iterator[BrokerProcess]:
        """Started, and killed at the end (a test module's broker)."""
        try:
            self.start()
            yield self
        finally:
            self.kill()


Received = tuple[str, bytes, int, bool]  # topic, payload, qos, retain


class Mqtt:
    """A paho-mqtt 2 client in its own network thread; every wait is bounded."""

    def __init__(
        self,
        port: int,
        clientid: str,
        *,
        clean_session: bool,
        will: tuple[str, bytes] | None = None,
        max_inflight: int = 20,
        manual_ack: bool = False,
    ) -> None:
        """``manual_ack``: never acknowledge a message (no PUBACK/PUBREC): a client that fails on it."""
        self.clientid = clientid
        self.session_present: bool | None = None  # CONNACK's flag
        self.messages: queue.Queue[Received] = queue.Queue()
        self._connected = threading.Event()
        self._acked: set[int] = set()
        self._granted: dict[int, list[int]] = {}  # SUBACK's codes, by message id
        self._suback = threading.Condition()
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=clientid, clean_session=clean_session, manual_ack=manual_ack
        )
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        if will is not None:
            self.client.will_set(will[0], will[1], qos=1)
        self.client.max_inflight_messages_set(max_inflight)  # publishes awaiting their PUBACK at once
        self.client.connect("127.0.0.1", port, keepalive=30)
        self.client.loop_start()
        if not self._connected.wait(10):
            self.close()
            raise AssertionError(f"{clientid} did not connect within 10s")

    def _on_connect(
        self, client: object, userdata: object, flags: mqtt.ConnectFlags, reason: object, props: object
    ) -> None:
        self.session_present = bool(flags.session_present)
        self._connected.set()

    def _on_message(self, client: object, userdata: object, msg: mqtt.MQTTMessage) -> None:
        self.messages.put((msg.topic, bytes(msg.payload), msg.qos, bool(msg.retain)))

    def _on_subscribe(self, client: object, userdata: object, mid: int, codes: list[Any], props: object) -> None:
        with self._suback:
            self._acked.add(mid)
            self._granted[mid] = [int(getattr(code, "value", code)) for code in codes]
            self._suback.notify_all()

    def subscribe(self, topic_filter: str, qos: int = 1) -> int:
        """Subscribe and wait for SUBACK; the code it gave the filter (the QoS granted, or 0x80: refused)."""
        result, mid = self.client.subscribe(topic_filter, qos=qos)
        assert result == mqtt.MQTT_ERR_SUCCESS
        with self._suback:
            assert self._suback.wait_for(lambda: mid in self._acked, 10), f"no SUBACK for {topic_filter}"
            return self._granted[mid][0]

    def publish(self, topic: str, payload: bytes | str, *, qos: int = 1, retain: bool = False) -> None:
        info = self.client.publish(topic, payload, qos=qos, retain=retain)
        info.wait_for_publish(10)
        assert info.is_published(), f"{self.clientid}: {topic} not acknowledged by the broker"

    def take(self, count: int, timeout_s: float = 20) -> list[Received]:
        """Exactly the next ``count`` messages, or fail naming what did arrive."""
        got: list[Received] = []
        deadline = time.monotonic() + timeout_s
        while len(got) < count:
            try:
                got.append(self.messages.get(timeout=max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError(
                    f"{self.clientid}: {len(got)} of {count} messages in {timeout_s}s: {got}"
                ) from None
        return got

    def quiet(self, seconds: float = 1.5) -> list[Received]:
        """What arrives within ``seconds`` (tests expect nothing)."""
        time.sleep(seconds)
        got = []
        while not self.messages.empty():
            got.append(self.messages.get_nowait())
        return got

    def drop(self) -> None:
        """Lose the connection without DISCONNECT (the broker then sends the will)."""
        self.client.loop_stop()
        sock = self.client.socket()
        if sock is not None:
            sock.close()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def payloads(messages: list[Received]) -> list[str]:
    return [payload.decode() for _, payload, _, _ in messages]
