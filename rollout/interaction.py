"""Multi-turn interactions: the environment answers the model with a user message, as in
verl's ``multi_turn.interaction_config_path`` (e.g. its ``Gsm8kInteraction``).

After an assistant turn without tool calls the agent loop asks the configured interaction for
a reply. The interaction judges the last assistant message and either ends the trajectory
(correct) or returns feedback that the loop appends as a user turn (response mask 0), and the
model tries again, up to ``max_user_turns`` feedback turns. Config (verl-shaped)::

    actor_rollout_ref.rollout.multi_turn.interaction: {name: gsm8k_feedback, max_user_turns: 2}

``name: null`` (or no section) turns interactions off.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rollout.rewards import answer_reward, extract_answer

CONFIG_KEY = "actor_rollout_ref.rollout.multi_turn.interaction"


@dataclass
class InteractionResponse:
    """The environment's reply to one assistant turn."""

    should_terminate: bool  # True: the trajectory ends here (nothing is appended)
    content: str  # the user message to append when the trajectory goes on
    reward: float | None = None  # the score of the judged assistant turn
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict, as recorded on the ``interaction`` span."""
        return asdict(self)


class Interaction:
    """Base class: judge the conversation so far and reply (verl's ``BaseInteraction``,
    stateless: the agent loop keeps the turn counts)."""

    name = "base"

    def __init__(self, max_user_turns: int = 2) -> None:
        self.max_user_turns = max_user_turns

    async def generate_response(
        self, messages: list[dict[str, Any]], ground_truth: Any
    ) -> InteractionResponse:
        """The reply to the last assistant message of ``messages``."""
        raise NotImplementedError


def last_assistant_text(messages: list[dict[str, Any]]) -> str:
    """The content of the last assistant message ("" if there is none)."""
    for msg in reversed(messages):
        if msg.get("role") == "assistant":
            return str(msg.get("content") or "")
    return ""


CALCULATOR_HINT = (
    '<tool_call>{"name": "calculator", "arguments": {"expression": "<expression>"}}</tool_call>'
)


class Gsm8kFeedbackInteraction(Interaction):
    """GSM8K-style feedback: reward 1.0 and stop when the final answer matches the ground
    truth; otherwise say so and ask for another attempt, hinting at the calculator tool."""

    name = "gsm8k_feedback"

    async def generate_response(
        self, messages: list[dict[str, Any]], ground_truth: Any
    ) -> InteractionResponse:
        text = last_assistant_text(messages)
        answer = extract_answer(text)
        reward = answer_reward(text, ground_truth)
        if reward == 1.0:
            return InteractionResponse(True, "Your answer is correct!", reward, {"answer": answer})
        if answer is None:
            said = "I could not find a final answer."
        else:
            said = f"Your answer {answer} is incorrect."
        content = (
            f"{said} Check your arithmetic (you may use the calculator tool: {CALCULATOR_HINT}) "
            "and answer again with #### <number>."
        )
        return InteractionResponse(False, content, reward, {"answer": answer})


INTERACTIONS: dict[str, type[Interaction]] = {
    Gsm8kFeedbackInteraction.name: Gsm8kFeedbackInteraction,
}


def make_interaction(section: dict[str, Any] | None) -> Interaction | None:
    """The interaction configured by ``section`` (``{name, max_user_turns}``), or None when
    ``section`` or its ``name`` is null. Unknown names and bad values raise ValueError."""
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ValueError(f"{CONFIG_KEY} must be a mapping {{name, max_user_turns}}: {section!r}")
    unknown = sorted(set(section) - {"name", "max_user_turns"})
    if unknown:
        raise ValueError(f"{CONFIG_KEY}: unknown keys {unknown}; valid: max_user_turns, name")
    name = section.get("name")
    if name is not None and name not in INTERACTIONS:
        valid = ", ".join([*sorted(INTERACTIONS), "null"])
        raise ValueError(f"{CONFIG_KEY}.name={name!r}; valid: {valid}")
    turns = section.get("max_user_turns", 2)  # checked even when off: a bad value is a typo
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 0:
        raise ValueError(f"{CONFIG_KEY}.max_user_turns must be an int >= 0: {turns!r}")
    return INTERACTIONS[name](max_user_turns=turns) if name is not None else None
