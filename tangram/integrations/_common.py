"""What the in-process adapters (verl, SkyRL) share: an exec result as the model sees it,
and as the trainer's metrics record it."""

from __future__ import annotations

from typing import Any

from tangram.protocol.results import ExecResult


def render_result(result: ExecResult, *, timeout_s: float, max_chars: int) -> str:
    """stdout, then stderr, then one bracketed line for a timeout, a sandbox error or a
    non-zero exit; cut to ``max_chars``."""
    text = result.stdout
    if result.stderr:
        text += ("\n" if text and not text.endswith("\n") else "") + result.stderr
    if result.outcome == "timeout":
        text += f"\n[timed out after {timeout_s:g} s]"
    elif result.outcome not in ("ok", "failed"):
        text += f"\n[sandbox error: {result.detail or result.outcome}]"
    elif result.exit_code:
        text += f"\n[exit code {result.exit_code}]"
    if len(text) > max_chars:
        text = text[:max_chars] + "\n[output truncated]"
    return text


def result_metrics(result: ExecResult) -> dict[str, Any]:
    """Outcome, exit code, queue / exec / ACT seconds and the number of cores."""
    return {
        "outcome": result.outcome,
        "exit_code": result.exit_code,
        "queue_s": result.queue_s,
        "exec_s": result.exec_s,
        "act_s": result.act_s,
        "cores": len(result.cores),
    }
