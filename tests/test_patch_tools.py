"""tool-choice-shared-engine on the real (patched) vLLM: which requests get a structural tag.

vLLM 0.28 builds one parser engine for `--reasoning-parser qwen3 --tool-call-parser qwen3_coder`
and, on that path, attaches no structural tag, so `tool_choice: "required"`, a named function and
strict tools are answered like "auto" (vLLM issues 53745, 54808). These tests drive vLLM's own
ParserManager and request class with the tiny hybrid's tokenizer, knob off and on; the live tests
(tests/test_profiles_live.py, tests/test_gpu.py) show the constrained call coming back.
"""

from __future__ import annotations

import json

import pytest

from rig import patches

patches.ensure_applied()

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402
from vllm.parser.parser_manager import ParserManager  # noqa: E402

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def adjusted(tokenizer, choice, tools=(TOOL,), reasoning="qwen3", tool_parser="qwen3_coder") -> ChatCompletionRequest:
    cls = ParserManager.get_parser(tool_parser_name=tool_parser, reasoning_parser_name=reasoning,
                                   enable_auto_tools=True)
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                tools=list(tools), tool_choice=choice)
    return cls(tokenizer, list(tools)).adjust_request(req)


def tag(req: ChatCompletionRequest) -> dict | None:
    so = req.structured_outputs
    return json.loads(so.structural_tag) if so is not None and so.structural_tag else None


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_knob_off_is_vllms_behaviour_no_tag(tokenizer, monkeypatch, choice):
    monkeypatch.delenv("VLLM_TOOL_CHOICE_SHARED_ENGINE", raising=False)
    assert tag(adjusted(tokenizer, choice)) is None  # the defect: nothing constrains the reply


def test_knob_on_named_choice_forces_that_functions_call(tokenizer, monkeypatch):
    monkeypatch.setenv("VLLM_TOOL_CHOICE_SHARED_ENGINE", "1")
    t = tag(adjusted(tokenizer, NAMED))
    assert t["format"]["type"] == "tag" and t["format"]["begin"] == "<tool_call>\n<function=get_weather>\n", t


def test_knob_on_required_choice_needs_a_call_from_the_offered_tools(tokenizer, monkeypatch):
    monkeypatch.setenv("VLLM_TOOL_CHOICE_SHARED_ENGINE", "1")
    t = json.dumps(tag(adjusted(tokenizer, "required")))
    assert "<function=get_weather>" in t and "<tool_call>" in t


def test_knob_on_changes_nothing_for_auto_without_strict_tools_or_for_no_tools(tokenizer, monkeypatch):
    monkeypatch.setenv("VLLM_TOOL_CHOICE_SHARED_ENGINE", "1")
    assert tag(adjusted(tokenizer, "auto")) is None  # upstream's registry: auto gets a tag only for strict tools
    assert tag(adjusted(tokenizer, "none")) is None
    strict = {"type": "function", "function": {**TOOL["function"], "strict": True}}
    assert tag(adjusted(tokenizer, "auto", tools=(strict,))) is not None  # strict tools now enforced too


def test_knob_on_matches_what_a_composed_pair_already_does(tokenizer, monkeypatch):
    """The same tag a DelegatingParser pair (deepseek_r1 reasoning + qwen3_coder tools) attaches upstream."""
    monkeypatch.setenv("VLLM_TOOL_CHOICE_SHARED_ENGINE", "1")
    composed = tag(adjusted(tokenizer, NAMED, reasoning="deepseek_r1"))
    assert composed is not None and tag(adjusted(tokenizer, NAMED)) == composed
