"""Failure alerts: a Prefect automation that posts to a webhook when one of our flows fails or crashes."""

from __future__ import annotations

import os
from typing import Any

from pydantic import Field

from tasks.formats.recipe_base import Frozen

WEBHOOK_ENV = "SHARDSMITH_ALERT_WEBHOOK_URL"

# The flows a person cares about: the end-to-end ones. Phase subflows (download, validate, ...)
# fail together with their parent, and alerting on both would say everything twice.
TOP_FLOWS = ("pretraining", "finetuning", "nightly-rebuild", "shardsmith-*")
FAILED_STATES = ("Failed", "Crashed", "TimedOut")

# "Why" is the failed run's state message, the error that stopped it: a blocked release's
# (flows/release.reconcile) names the failed checks and what changed since the last release,
# e.g. "changes since v0003: 2 recovered, 310 dead (12 kept), 1 taken down, 311 removed".
SUBJECT = "shardsmith: {{ flow.name }} run {{ flow_run.name }} {{ flow_run.state.name }}"
BODY = (
    "Flow {{ flow.name }}, run {{ flow_run.name }}, ended {{ flow_run.state.name }}.\n"
    "Parameters: {{ flow_run.parameters }}\n"
    "Why: {{ flow_run.state.message }}\n"
    "Run: {{ flow_run|ui_url }}"
)


class AlertConfig(Frozen):
    """Where failure alerts go and which runs raise them.

    Args:
        webhook_url: receives a JSON POST ``{"text", "subject", "body"}`` per failed run
            (``text`` is what Slack-style incoming webhooks show).
        name: the automation's name, and the webhook block's; creating again replaces both.
        flows: flow names (trailing ``*`` is a wildcard) whose failures alert.
        states: flow run state names that alert.
        headers: extra HTTP headers, e.g. an authorization token of the receiver.
    """

    webhook_url: str = Field(pattern=r"^https?://\S+$")
    name: str = Field(default="shardsmith-failures", pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    flows: tuple[str, ...] = Field(default=TOP_FLOWS, min_length=1)
    states: tuple[str, ...] = Field(default=FAILED_STATES, min_length=1)
    headers: dict[str, str] = Field(default_factory=dict)


def config_from_env(webhook_url: str | None = None, **kw: Any) -> AlertConfig:
    """The alert config from an explicit URL or ``SHARDSMITH_ALERT_WEBHOOK_URL``."""
    url = webhook_url or os.environ.get(WEBHOOK_ENV)
    if not url:
        raise ValueError(f"no webhook URL: pass one or set {WEBHOOK_ENV}")
    return AlertConfig(webhook_url=url, **kw)


def create_alert(cfg: AlertConfig) -> dict[str, str]:
    """Save the webhook block and (re)create the automation; returns their ids."""
    from prefect.automations import Automation, EventTrigger, SendNotification
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    block = CustomWebhookNotificationBlock(
        name=cfg.name,
        url=cfg.webhook_url,
        json_data={"text": "{{subject}}\n{{body}}", "subject": "{{subject}}", "body": "{{body}}"},
        headers=dict(cfg.headers) or None,
    )
    block_id = block.save(cfg.name, overwrite=True)
    _delete_named(cfg.name)
    automation = Automation(
        name=cfg.name,
        description="Post to a webhook when a shardsmith flow run fails or crashes (shardsmith alerts).",
        trigger=EventTrigger(
            expect={f"prefect.flow-run.{s}" for s in cfg.states},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={"prefect.resource.role": "flow", "prefect.resource.name": list(cfg.flows)},
            posture="Reactive",
            threshold=1,
        ),
        actions=[SendNotification(block_document_id=block_id, subject=SUBJECT, body=BODY)],
    ).create()
    return {"automation": str(automation.id), "block": str(block_id)}


def _delete_named(name: str) -> None:
    """Remove automations with this name, so running the command again does not alert twice."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for old in client.read_automations_by_name(name):
            client.delete_automation(old.id)
