"""The 1.x import path of the prompt tools."""

from .prompts import Prompt, first_tokens, run_prompts

__all__ = ["Prompt", "first_tokens", "run_prompts"]
