"""Build the default job's tiny model source: a byte-level BPE tokenizer trained on the bundled
sample data, and a small Llama config (the weights are random, built from the config at run time).

    .venv/bin/python models/build_tiny_llama.py   # rewrites models/tiny-llama/

Deterministic: the same data gives the same tokenizer.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parent
DATA = ROOT.parent / "data" / "sample" / "train.jsonl"
OUT = ROOT / "tiny-llama"
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def texts() -> list[str]:
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    out = []
    for row in rows:
        out.append(f"### Instruction:\n{row['instruction']}\n\n")
        if row.get("input"):
            out.append(f"### Input:\n{row['input']}\n\n")
        out.append(f"### Response:\n{row['output']}")
    return out


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def main() -> None:
    tokenizer = build_tokenizer(vocab_size=2048)
    tokenizer.save_pretrained(OUT)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    config.save_pretrained(OUT)
    print(f"wrote {OUT}: vocab {len(tokenizer)}, {config.num_hidden_layers} layers, hidden {config.hidden_size}")


if __name__ == "__main__":
    main()
