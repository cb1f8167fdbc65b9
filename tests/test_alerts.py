"""Failure alerts: a gate that fails reaches a loopback webhook through Prefect's automations."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


@pytest.fixture
def receiver():
    """A webhook receiver on loopback; yields (url, list of received JSON bodies)."""
    got: list[dict] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            got.append({"path": self.path, "auth": self.headers.get("x-token"), **json.loads(body)})
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/hooks/shardsmith", got
    server.shutdown()
    server.server_close()


def test_config_is_validated():
    from flows.alerts import AlertConfig, config_from_env

    with pytest.raises(ValueError):
        AlertConfig(webhook_url="ftp://example.org/x")
    with pytest.raises(ValueError, match="SHARDSMITH_ALERT_WEBHOOK_URL"):
        config_from_env(None)


def test_cli_refuses_without_a_server(monkeypatch):
    from cli.main import app

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    result = CliRunner().invoke(app, ["alerts", "--webhook-url", "http://127.0.0.1:9/x"])
    assert result.exit_code == 2 and "PREFECT_API_URL" in result.output


@pytest.mark.slow
def test_failed_gate_alerts_the_webhook_once(prefect_harness, shared_cluster, receiver, tmp_path, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.settings import get_current_settings

    from cli.main import app
    from flows.audit import GateFailed
    from flows.pretraining import pretraining_flow
    from tasks.demo.corpus import prepare_demo

    url, got = receiver
    monkeypatch.setenv("PREFECT_API_URL", str(get_current_settings().api.url))
    name = "test-alerts-gate"
    result = CliRunner().invoke(app, ["alerts", "--webhook-url", url, "--name", name, "--header", "x-token=s3cret"])
    assert result.exit_code == 0, result.output
    # Creating it again replaces it: still one automation, so still one alert per failure.
    result = CliRunner().invoke(app, ["alerts", "--webhook-url", url, "--name", name, "--header", "x-token=s3cret"])
    assert result.exit_code == 0, result.output

    web, _ = prepare_demo(tmp_path, n=30, port=0)
    monkeypatch.setenv("SHARDSMITH_DEMO_DIR", str(tmp_path))
    try:
        # The demo corpus has bad rows on purpose, so a 100 % success threshold fails the gate.
        state = pretraining_flow(
            recipe_path=str(RECIPES / "demo-strict.yaml"),
            phases=["download"],
            workers=1,
            overrides={"min_success_rate": 1.0, "task_retries": 0},
            return_state=True,
        )
    finally:
        web.stop()
    assert state.is_failed()
    assert isinstance(state.result(raise_on_failure=False), GateFailed)

    try:
        deadline = time.monotonic() + 90
        mine = []
        while time.monotonic() < deadline and not mine:
            mine = [g for g in got if "run " + _run_name(state) + " " in g["subject"]]
            time.sleep(0.5)
        assert mine, f"no alert for the failed run; received: {got}"
        time.sleep(3)  # a duplicate, if any, would arrive by now
        mine = [g for g in got if "run " + _run_name(state) + " " in g["subject"]]
        assert len(mine) == 1
        alert = mine[0]
        assert alert["path"] == "/hooks/shardsmith" and alert["auth"] == "s3cret"
        assert alert["subject"].startswith("shardsmith: pretraining run ") and alert["subject"].endswith(" Failed")
        assert "GateFailed" in alert["body"] and "demo-strict" in alert["body"]
        assert alert["text"] == alert["subject"] + "\n" + alert["body"]
        # The phase subflow failed too, but only the end-to-end flow alerts.
        assert not [g for g in got if g["subject"].startswith("shardsmith: download ")]
    finally:
        with get_client(sync_client=True) as client:
            for a in client.read_automations_by_name(name):
                client.delete_automation(a.id)


def _run_name(state) -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(state.state_details.flow_run_id).name
