"""A real multi-turn, tool-using agentic rollout (verl-style) that the tracer observes.

Submodules: ``engines`` (scripted, transformers, vLLM), ``models`` (builtin models and
tokenizers), ``agent_loop``, ``parser``, ``tools``, ``rewards``, ``worker``, ``config``, ``cli``.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
