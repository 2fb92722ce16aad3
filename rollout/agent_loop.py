"""A multi-turn, tool-using agent loop shaped like verl's ``ToolAgentLoop``.

chat template (with tool schemas) -> engine.generate -> parse tool calls -> run tools
concurrently -> append tool responses -> ... until no tool call, the turn limit or the
response-length limit. With an interaction configured (``rollout/interaction.py``), a turn
without tool calls is judged and, when wrong, answered with a user feedback message, and the
model tries again. Records the response mask (1 = model token, 0 = tool/user/template token).
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from rollout.engines.base import Engine, GenerateOutput, SamplingParams
from rollout.interaction import make_interaction
from rollout.parser import ParseResult, ToolCall, parse_tool_calls
from rollout.rewards import compute_reward
from rollout.tools import ToolRegistry, ToolResult
from tracer import trace_op

SYSTEM_PROMPT = (
    "You are a careful math assistant. Solve the problem step by step. You can call the "
    "calculator tool for arithmetic. End your final answer with '#### <number>'."
)


def hermes_tool_prompt(tools: list[dict[str, Any]]) -> str:
    """The Hermes/Qwen tool instructions, for chat templates that do not render ``tools``."""
    listing = "\n".join(json.dumps(t) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{listing}\n</tools>\n\nFor each function call, return a json object with function "
        "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


@dataclass
class AgentLoopConfig:
    """Limits of one trajectory (names follow verl's ``rollout`` / ``multi_turn`` sections)."""

    max_assistant_turns: int = 4
    prompt_length: int | None = None  # longer prompts are rejected (ValueError), as in verl
    response_length: int = 256  # all response tokens: model + tool responses
    max_tool_response_length: int = 512  # characters of one tool response
    tool_response_truncate_side: str = "right"
    use_tools: bool = True
    # multi_turn.interaction: {name: gsm8k_feedback | null, max_user_turns: 2}; None: off
    interaction: dict[str, Any] | None = None
    # multi_turn.tool_choice, per assistant turn (the last one repeats): auto | required | none
    # (vLLM's meaning; "required" is one tool call by structured decoding). ["required", "auto"]:
    # the first turn calls a tool, later turns choose.
    tool_choice: list[str] = field(default_factory=lambda: ["auto"])
    # reward section: score = accuracy + format_weight * format; mode strict (a final
    # "#### <number>" or wrong, as verl's GSM8K default) or flexible (rollout/rewards.py)
    reward_mode: str = "strict"
    format_weight: float = 0.1

    def __post_init__(self) -> None:
        from rollout.engines.structured import check_tool_choice

        if isinstance(self.tool_choice, str):
            self.tool_choice = [self.tool_choice]
        self.tool_choice = [check_tool_choice(c) for c in self.tool_choice] or ["auto"]

    def tool_choice_for(self, turn: int) -> str:
        """The tool choice of assistant turn ``turn`` (0-based)."""
        return self.tool_choice[min(turn, len(self.tool_choice) - 1)]


@dataclass
class Turn:
    """One segment of the response: an assistant generation or a block of tool responses."""

    role: str  # "assistant" | "tool" | "user" (interaction feedback)
    token_ids: list[int]
    finish_reason: str | None = None  # assistant turns: "stop" | "length"
    text: str = ""


@dataclass
class AgentLoopOutput:
    """A finished trajectory, ready for training (ids + mask) and for analysis."""

    request_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None
    messages: list[dict[str, Any]]
    turns: list[Turn]
    num_assistant_turns: int
    finish_reason: str  # "stop" | "length" | "max_turns"
    tool_calls: int = 0
    tool_errors: int = 0
    num_user_turns: int = 0  # interaction feedback turns appended
    turn_rewards: list[float] = field(default_factory=list)  # interaction score per judged turn
    reward: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class ToolAgentLoop:
    """Runs one trajectory per :meth:`run` call; safe to run many concurrently."""

    def __init__(
        self, engine: Engine, tools: ToolRegistry | None, config: AgentLoopConfig | None = None
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer  # used by the tracer's token2text
        self.tools = tools
        self.config = config or AgentLoopConfig()
        schemas = tools.schemas() if tools is not None and self.config.use_tools else []
        self.tool_schemas = schemas
        template = getattr(self.tokenizer, "chat_template", None) or ""
        self._template_has_tools = "tools" in template
        self._eos_text = self._eos_token_text()
        self.interaction = make_interaction(self.config.interaction)

    # ---------------------------------------------------------------- templating
    def _eos_token_text(self) -> str:
        tok = self.tokenizer
        for name in ("<|im_end|>", tok.eos_token):
            if name and tok.convert_tokens_to_ids(name) not in (None, tok.unk_token_id):
                return name
        return ""

    def _prepare(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Any]:
        """Messages and ``tools`` argument for the template (tool prompt injected if needed)."""
        if not self.tool_schemas:
            return messages, None
        if self._template_has_tools:
            return messages, self.tool_schemas
        prompt = hermes_tool_prompt(self.tool_schemas)
        if messages and messages[0]["role"] == "system":
            head = {"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}
            return [head, *messages[1:]], None
        return [{"role": "system", "content": prompt}, *messages], None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """The chat-template text of ``messages`` (with tool schemas)."""
        msgs, tools = self._prepare(messages)
        return self.tokenizer.apply_chat_template(
            msgs, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of template text (special tokens in the text are recognized)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def tool_response_ids(
        self, tool_messages: list[dict[str, Any]], ended_with_eos: bool
    ) -> list[int]:
        """Template tokens that follow an assistant turn: its end-of-turn remainder, the tool
        responses (or user messages), and the next assistant generation prompt (verl's
        incremental encoding)."""
        base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": "A"}]  # fmt: skip
        before = self.render(base, add_generation_prompt=False)
        after = self.render(base + tool_messages, add_generation_prompt=True)
        if not after.startswith(before):
            raise RuntimeError("chat template is not prefix-stable for tool messages")
        suffix = before[before.rindex("A") + 1 :]  # what the template puts after the content
        if ended_with_eos and self._eos_text and suffix.startswith(self._eos_text):
            suffix = suffix[len(self._eos_text) :]
        return self.encode(suffix + after[len(before) :])

    # ---------------------------------------------------------------- traced ops
    @trace_op(kind="generate")
    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        messages: list[dict[str, Any]],
        request_id: str | None = None,
    ) -> dict[str, Any]:
        """One engine call; returns ``response_ids``, ``finish_reason`` and ``logprobs``."""
        out: GenerateOutput = await self.engine.generate(prompt_ids, params, request_id)
        return {"response_ids": out.token_ids, "finish_reason": out.finish_reason,
                "logprobs": out.logprobs}  # fmt: skip

    @trace_op(kind="parse")
    def parse(self, text: str) -> ParseResult:
        """Extract tool calls from the assistant text."""
        return parse_tool_calls(text)

    async def call_tool(self, call: ToolCall) -> ToolResult:
        """Run one parsed call (a malformed call becomes an error result); never raises."""
        if self.tools is None:
            return ToolResult(call.name, "Error: no tools available", "no tools available")
        result = await self.tools.call(call.name, call.arguments, parse_error=call.error)
        limit = self.config.max_tool_response_length
        if len(result.content) > limit:
            cut = "...(truncated)"
            if self.config.tool_response_truncate_side == "left":
                result.content = cut + result.content[-limit:]
            else:
                result.content = result.content[:limit] + cut
        return result

    @trace_op(kind="interaction", name="interaction")
    async def interact(self, messages: list[dict[str, Any]], ground_truth: Any) -> dict[str, Any]:
        """The interaction's reply to the last assistant turn: ``should_terminate``,
        ``content`` (the user message), ``reward`` and ``metadata``."""
        assert self.interaction is not None
        reply = await self.interaction.generate_response(messages, ground_truth)
        return reply.to_dict()

    # ---------------------------------------------------------------- the loop
    @trace_op(kind="trajectory")
    async def run(
        self,
        messages: list[dict[str, Any]],
        sampling: SamplingParams,
        ground_truth: Any = None,
        request_id: str | None = None,
    ) -> AgentLoopOutput:
        """Roll out one trajectory from ``messages``; scores it when ``ground_truth`` is given."""
        cfg = self.config
        request_id = request_id or uuid.uuid4().hex
        messages = copy.deepcopy(messages)
        prompt_ids = self.encode(self.render(messages, add_generation_prompt=True))
        if cfg.prompt_length is not None and len(prompt_ids) > cfg.prompt_length:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens, more than prompt_length="
                f"{cfg.prompt_length} (actor_rollout_ref.rollout.prompt_length)"
            )
        response: list[int] = []
        mask: list[int] = []
        logprobs: list[float] | None = [] if sampling.logprobs else None
        turns: list[Turn] = []
        n_assistant = n_calls = n_errors = n_user = 0
        turn_rewards: list[float] = []
        interacts = self.interaction is not None and ground_truth is not None
        finish = "stop"
        while True:
            remaining = cfg.response_length - len(response)
            if remaining <= 0:
                finish = "length"
                break
            params = copy.copy(sampling)
            params.max_tokens = min(sampling.max_tokens, remaining)
            if sampling.seed is not None:  # a new draw per turn, reproducible per trajectory
                params.seed = (sampling.seed + 1_000_003 * n_assistant) % 2**32
            if self.tool_schemas:
                params.tool_choice = cfg.tool_choice_for(n_assistant)
                params.tools = self.tool_schemas
            out = await self.generate(prompt_ids + response, params, messages, request_id)
            ids = out["response_ids"]
            response += ids
            mask += [1] * len(ids)
            if logprobs is not None:
                logprobs += out["logprobs"] or [0.0] * len(ids)
            n_assistant += 1
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            turns.append(Turn("assistant", ids, out["finish_reason"], text))
            parsed = self.parse(text)
            msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            if parsed.tool_calls:
                msg["tool_calls"] = [c.to_message_dict() for c in parsed.tool_calls]
            messages.append(msg)
            truncated = out["finish_reason"] == "length"
            if truncated and not interacts:
                finish = "length"
                break
            ended_with_eos = bool(ids) and self.tokenizer.decode(ids[-1:]) == self._eos_text
            if truncated or not parsed.tool_calls or not self.tool_schemas:
                if not interacts:
                    break
                # the interaction judges every final-answer turn (tool calls take precedence);
                # a wrong answer gets feedback while the turn and length limits allow
                assert self.interaction is not None
                reply = await self.interact(messages, ground_truth)
                if reply["reward"] is not None:
                    turn_rewards.append(float(reply["reward"]))
                finish = "length" if truncated else "stop"
                if reply["should_terminate"]:
                    break
                if n_assistant >= cfg.max_assistant_turns or (
                    n_user >= self.interaction.max_user_turns
                ):
                    finish = "length" if truncated else "max_turns"
                    break
                user_msgs = [{"role": "user", "content": reply["content"]}]
                delta = self.tool_response_ids(user_msgs, ended_with_eos)
                if len(response) + len(delta) >= cfg.response_length:
                    finish = "length"
                    break
                messages.extend(user_msgs)
                n_user += 1
                response += delta
                mask += [0] * len(delta)
                if logprobs is not None:
                    logprobs += [0.0] * len(delta)
                turns.append(Turn("user", delta, None, reply["content"]))
                continue
            if n_assistant >= cfg.max_assistant_turns:
                finish = "max_turns"
                break
            results = await asyncio.gather(*(self.call_tool(c) for c in parsed.tool_calls))
            n_calls += len(results)
            n_errors += sum(not r.ok for r in results)
            tool_msgs = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
            messages.extend(tool_msgs)
            delta = self.tool_response_ids(tool_msgs, ended_with_eos)
            if len(response) + len(delta) >= cfg.response_length:
                finish = "length"
                break
            response += delta
            mask += [0] * len(delta)
            if logprobs is not None:
                logprobs += [0.0] * len(delta)
            turns.append(Turn("tool", delta, None, "\n".join(r.content for r in results)))
        output = AgentLoopOutput(
            request_id=request_id, prompt_ids=prompt_ids, response_ids=response,
            response_mask=mask, response_logprobs=logprobs, messages=messages, turns=turns,
            num_assistant_turns=n_assistant, finish_reason=finish, tool_calls=n_calls,
            tool_errors=n_errors, num_user_turns=n_user, turn_rewards=turn_rewards,
        )  # fmt: skip
        if ground_truth is not None:
            assistant_texts = [t.text for t in turns if t.role == "assistant"]
            final = assistant_texts[-1] if assistant_texts else ""
            output.reward = compute_reward(final, ground_truth, assistant_texts,
                                           cfg.format_weight, cfg.reward_mode)  # fmt: skip
        return output
