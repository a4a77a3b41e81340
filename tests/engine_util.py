"""Shared helpers for the engine tests: the HF reference and tiny random-weight models."""

from __future__ import annotations

import torch

from batchery.engine.attention.backend import ATTN_IMPLEMENTATION
from batchery.engine.loader import LoadedModel

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 50.",
    "Who wrote Pride and Prejudice?",
    "Translate 'good morning' into Spanish.",
    "Give me a tip for learning to cook.",
    "What is 17 times 23?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "Suggest a name for a bakery.",
    "What does a compiler do?",
    "Tell me a short story about a robot and a dog. Make it cheerful and include a surprise ending that nobody "
    "expects.",
    "How do I boil an egg?",
    "Summarize the plot of Romeo and Juliet.",
    "What are the benefits of regular exercise?",
]


def hf_greedy(
    loaded: LoadedModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    ignore_eos: bool = True,
    with_logprobs: bool = False,
):
    """Hugging Face ``generate`` on one prompt alone, greedy, with transformers' own attention.
    Returns the new token ids, and with ``with_logprobs`` also each one's log-probability."""
    model = loaded.model
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa" if not getattr(model.config, "attn_logit_softcapping", None) else "eager")
    try:
        ids = torch.tensor([prompt_ids], device=loaded.device)
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids))
        if ignore_eos:
            kwargs.update(min_new_tokens=max_new_tokens)
        with torch.inference_mode():
            out = model.generate(ids, **kwargs, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
        new = out.sequences[0, len(prompt_ids) :].tolist()
        if not with_logprobs:
            return new
        lps = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, new)]
        return new, lps
    finally:
        if previous == ATTN_IMPLEMENTATION:
            model.set_attn_implementation(previous)
