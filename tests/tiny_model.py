"""A tiny random-weight Llama with an offline word-level tokenizer and a chat template, saved as a
local Hugging Face directory (safetensors). ``EngineConfig(model=<dir>)`` loads it in about a
second, so worker tests run a real engine without the hub.

Usage: ``build_tiny_model(path)`` (or the ``tiny_model_dir`` session fixture in conftest)."""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ["<unk>", "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
# a fixed vocabulary: the benchmark's words, chat roles and some filler, so prompts tokenize well
WORDS = (
    "system user assistant tool developer summarize this text hello hi world the a an of to and in is it "
    "you that he was for on are with as his they be at one have from or had by word but not what all were "
    "we when your can said there use each which she do how their if will up other about out many then them "
    "these so some her would make like him into time has look two more write go see number no way could "
    "people my than first water been call who oil its now find long down day did get come made may part "
    "once upon story cat dog sea sky blue red green fast slow big small good bad new old yes please thanks "
    "apple banana river mountain city light dark music book paper stone fire wind rain snow tree flower "
    "data model token batch queue worker engine cache block memory compute result answer question reply"
).split()
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} {{ message['content'] }}<|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def build_tokenizer():
    """A ``PreTrainedTokenizerFast`` over ``WORDS`` (whitespace and punctuation split)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for tok in SPECIAL_TOKENS + WORDS + list(".,!?;:'\"()-0123456789"):
        vocab.setdefault(tok, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_model(
    path: str | Path, *, seed: int = 0, num_layers: int = 2, hidden_size: int = 64, max_position_embeddings: int = 8192
) -> Path:
    """Write the tiny model to ``path`` (created) and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    (path / "batchery_tiny.json").write_text(json.dumps({"seed": seed, "vocab_size": len(tokenizer)}))
    return path


if __name__ == "__main__":
    import sys

    print(build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "/tmp/batchery-tiny"))
