"""Tool calls: a request with a tools schema must come back as parsed ``tool_calls``, not text.

The silent failure this catches: a parser that does not match the model's call format (``hermes``
on a model that writes Qwen XML) leaves the call in ``content`` as text, HTTP 200, no error.
"""

from __future__ import annotations

import json


def check_message(msg: dict, name: str, required: list[str]) -> list[str]:
    """Problems with one assistant message (empty list: a proper parsed call)."""
    calls = msg.get("tool_calls") or []
    content = msg.get("content") or ""
    if not calls:
        leaked = " (the call came back as text: wrong TOOL_PARSER?)" if "<tool_call>" in content or \
            "<function=" in content else ""
        return [f"no tool_calls{leaked}; content: {content[:120]!r}"]
    problems = []
    fn = calls[0].get("function", {})
    if fn.get("name") != name:
        problems.append(f"called {fn.get('name')!r}, expected {name!r}")
    try:
        args = json.loads(fn.get("arguments") or "")
    except ValueError as e:
        return problems + [f"arguments are not JSON ({e}): {fn.get('arguments')!r}"]
    if not isinstance(args, dict):
        return problems + [f"arguments are not a JSON object: {args!r}"]
    missing = [k for k in required if k not in args]
    if missing:
        problems.append(f"arguments lack {missing}: {args}")
    return problems


def run(client, suite) -> dict:
    """Every case, greedy, thinking off; per-case problems and the pass count."""
    cases = []
    for case in suite.cases:
        body = {"messages": [{"role": "user", "content": case.prompt}], "tools": [case.tool],
                "tool_choice": "auto", "temperature": 0, "max_tokens": suite.max_tokens,
                "chat_template_kwargs": {"enable_thinking": False}}
        msg = client.chat(body)["choices"][0]["message"]
        problems = check_message(msg, case.expect_name, case.required)
        calls = [c.get("function") for c in msg.get("tool_calls") or []]
        cases.append({"prompt": case.prompt, "ok": not problems, "problems": problems, "tool_calls": calls})
    return {"passed": sum(c["ok"] for c in cases), "total": len(cases), "cases": cases}
