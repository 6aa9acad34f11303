"""Prompts: the text put before every input, as sentence-transformers resolves it."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ..errors import SurgeValueError

__all__ = ["resolve_prompt"]

logger = logging.getLogger(__name__)


def resolve_prompt(
    prompts: Mapping[str, str | None],
    default_prompt_name: str | None,
    prompt: str | None,
    prompt_name: str | None,
    *,
    source: str = "the model",
) -> str | None:
    """The prompt text, with ``SentenceTransformer._resolve_prompt``'s rules.

    ``prompt`` wins (``""`` included: no prompt) and ``prompt_name`` is then ignored
    with a warning; else ``prompts[prompt_name]``; else the default prompt.

    Examples
    --------
    >>> resolve_prompt({"query": "query: "}, None, None, "query")
    'query: '
    >>> resolve_prompt({"query": "query: "}, "query", "", None)
    ''
    """
    if prompt is None:
        if prompt_name is not None:
            if prompt_name not in prompts:
                raise SurgeValueError(
                    f"prompt_name={prompt_name!r} is not one of the prompts of {source}: {sorted(prompts)}. "
                    "Fix: pass one of those, or the text itself with prompt='...'."
                )
            return prompts[prompt_name]
        if default_prompt_name is not None:
            return prompts.get(default_prompt_name)
    elif prompt_name is not None:
        logger.warning(
            "dask-surge: both prompt=%r and prompt_name=%r given; prompt_name is ignored, as "
            "sentence-transformers does",
            prompt,
            prompt_name,
        )
    return prompt
